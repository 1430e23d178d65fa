"""Formulation arithmetic of the backward: per-dim integer geometry that the backends' formulations read.

Polyphase taps (``phase_taps``), the sub-pixel fusion of the phases, space-to-depth blocks by the dilation,
the stride phases of x for grad_weight, a tap's rows (``tap_rows``) and the one
asymmetric-pad split (``pad_split``) that every builder uses to pad symmetrically inside a conv. Each function
takes one dim's integers; ``ConvSpec``'s properties zip them over the dims. Integers only, no torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from convgrad.spec.arguments import Pair

__all__ = ["PadSplit", "PhaseTaps", "dilation_block", "leftover_rows", "output_rows", "pad_split", "pad_then_crop",
           "pad_to_rows", "padded_sizes", "padding_only_taps", "phase_data_rows", "phase_taps", "stride_phase",
           "strided_crop", "subpixel_dim", "tap_rows", "transposed_output_rows"]


def output_rows(i: int, k: int, s: int, d: int, pads: Pair) -> int:
    """Rows o of a forward conv's output along one dim: floor((i + p_lo + p_hi - d(k-1) - 1) / s) + 1."""
    lo, hi = pads
    return (i + lo + hi - d * (k - 1) - 1) // s + 1


def pad_then_crop(pads: Iterable[Pair]) -> tuple[tuple[Pair, ...], tuple[Pair, ...]]:
    """(lo, hi) pads per dim, a negative amount a crop, as a padding by the positive parts, then a crop (rows
    removed, >= 0) of the negative parts. In this order a crop that only the other side's padding makes room for
    works (F.pad crops first and fails there).

    Examples:
        >>> pad_then_crop([(2, -1), (-3, 0)])
        (((2, 0), (0, 0)), ((0, 1), (3, 0)))
    """
    pairs = tuple(pads)
    return (tuple((max(lo, 0), max(hi, 0)) for lo, hi in pairs),
            tuple((max(-lo, 0), max(-hi, 0)) for lo, hi in pairs))


def padded_sizes(sizes: Iterable[int], pads: Iterable[Pair]) -> tuple[int, ...]:
    """Extents after padding each dim by (lo, hi); a negative amount crops.

    Examples:
        >>> padded_sizes((5, 7), [(1, 2), (-2, 0)])
        (8, 5)
    """
    return tuple(n + lo + hi for n, (lo, hi) in zip(sizes, pads))


def pad_to_rows(pads: Pair, padded: int, rows: int) -> Pair:
    """Pads (lo, hi) of one dim, which make it ``padded`` rows, with the high side grown (or cut) so that they make
    it ``rows`` rows instead: (lo, hi + rows - padded).

    Examples:
        >>> pad_to_rows((1, 1), padded=7, rows=10)   # 5 rows padded (1, 1) are 7; (1, 4) makes 10
        (1, 4)
    """
    lo, hi = pads
    return lo, hi + rows - padded


def transposed_output_rows(o: int, k: int, s: int, d: int, op: int, pads: Pair) -> int:
    """Rows i of a transposed conv's output along one dim: (o-1)s + d(k-1) + 1 + output_padding - p_lo - p_hi."""
    lo, hi = pads
    return (o - 1) * s + d * (k - 1) + 1 + op - lo - hi


def leftover_rows(i: int, o: int, k: int, s: int, d: int, pads: Pair) -> int:
    """r along one dim: the trailing rows of the padded big side that no output reads (the package docstring)."""
    lo, hi = pads
    return i + lo + hi - d * (k - 1) - 1 - (o - 1) * s


def padding_only_taps(i: int, o: int, k: int, s: int, d: int, p_lo: int) -> tuple[int, ...]:
    """The taps t of one dim that meet padding alone at every output m < o (tap t reads x row t*d - p_lo + m*s):
    their grad_weight is exactly 0. None when x or y is empty.

    Args:
        i: x's extent (unpadded); o: y's extent; k: the kernel's taps; s: stride; d: dilation; p_lo: the padding
            before x (all ints, >= 0).

    Returns:
        The taps, ascending.

    Examples:
        >>> padding_only_taps(1, 1, 3, 1, 1, 1)   # one row of x, padded by 1: taps 0 and 2 read padding only
        (0, 2)
        >>> padding_only_taps(8, 4, 3, 2, 1, 1)
        ()
    """
    if i == 0 or o == 0:
        return ()
    taps = []
    for t in range(k):
        first = t * d - p_lo  # the row tap t reads at output 0 (negative: padding)
        m = max(0, -(first // s))  # the first output at which it reads a row >= 0
        if m >= o or first + m * s >= i:
            taps.append(t)
    return tuple(taps)


class PhaseTaps(NamedTuple):
    """The kernel taps that reach one phase of the big side along one dim (polyphase grad of x).

    Phase rho holds the rows x[rho], x[rho + s], x[rho + 2s], ... (``ConvSpec.phase_rows`` of them).
    They are a stride-1 convolution, dilation ``dilation`` = d/g (g = gcd(s, d)), of y padded by
    ``pads`` with the taps flipped[first], flipped[first + step], ... (``count`` of them, step = s/g)
    of the kernel flipped in that dim. See ``phase_taps`` for the derivation.
    """

    first: int
    step: int
    count: int
    pads: Pair
    dilation: int


def phase_taps(i: int, k: int, s: int, d: int, p_lo: int, o: int) -> tuple[PhaseTaps | None, ...]:
    """For each phase rho = 0..s-1 of one dim of the big side, its taps, or None when no tap reaches it.

    Row u = rho + s*b of x sits at m = u + p_lo in x_pad, whose gradient is the sum of y[j] w[t]
    over j*s + t*d = m. Write m = phi + s*(b + e) with phi = (rho + p_lo) mod s, e = (rho + p_lo) div s.
    Then t*d = phi (mod s): with g = gcd(s, d), S = s/g, D = d/g this needs g | phi and
    t = t0 (mod S), t0 = (phi/g) * D^-1 (mod S); so t = t0 + S*q, q < count = ceil((k - t0)/S), and
    j = b + e - c0 - q*D with c0 = (t0*d - phi)/s. Flipping q (q' = count-1-q, flipped tap
    first + S*q', first = k-1-t0-S*(count-1)) turns this into a stride-1 conv with dilation D of y
    padded by lo = c0 + (count-1)*D - e, and hi such that it yields ceil(i/s) rows. A phase is empty
    when no tap reaches it, or when its window of y lies wholly in the padding.
    """
    g = math.gcd(s, d)
    step, dil, rows = s // g, d // g, -(-i // s)
    out: list[PhaseTaps | None] = []
    for rho in range(s):
        phi, e = (rho + p_lo) % s, (rho + p_lo) // s
        t0 = (phi // g) * pow(dil, -1, step) % step if step > 1 else 0
        count = -(-(k - t0) // step)
        if phi % g or rho >= i or count < 1:
            out.append(None)
            continue
        lo = (t0 * d - phi) // s + (count - 1) * dil - e
        hi = rows + (count - 1) * dil - o - lo
        out.append(None if -lo >= o or o + hi <= 0 else PhaseTaps(k - 1 - t0 - step * (count - 1), step, count,
                                                                   (lo, hi), dil))
    return tuple(out)


def tap_rows(size: int, rows: int, offset: int, reach: int) -> tuple[int, int, int]:
    """A stride-1 conv evaluated tap by tap, along one dim: output row r reads data row r + offset + reach
    (reach = tap * dilation), which exists for 0 <= r + offset + reach < size.

    Args:
        size: rows of the data (int). rows: rows of the output (int).
        offset: data row read by output row 0 at tap 0 (int; negative: that row is padding).
        reach: tap * dilation (int, >= 0).

    Returns:
        ``(first, stop, data_first)``: the output rows first..stop-1 read a data row, the first of them
        row data_first. ``first >= stop`` when the tap reads no data row at all.

    Source: the polyphase form in the docs' "Derivation" page (fwdconv's ``DepthwiseTaps`` sums the taps this way).

    Examples:
        >>> tap_rows(size=4, rows=4, offset=-1, reach=0)   # padding 1 before: row 0 reads nothing
        (1, 4, 0)
        >>> tap_rows(size=4, rows=4, offset=-1, reach=2)   # tap 1 at dilation 2: the last row reads nothing
        (0, 3, 1)
    """
    first, stop = max(0, -(offset + reach)), min(rows, size - offset - reach)
    return first, stop, first + offset + reach


class PadSplit(NamedTuple):
    """Per-dim pads (lo, hi) of one operand, split for a conv that can only pad symmetrically (one int per dim).

    The conv pads ``grow`` = max(lo, hi, 0) on both sides; its output then starts ``start`` = grow - max(lo, 0)
    rows early and ends ``surplus`` = grow - max(hi, 0) rows late (the rows the wanted pads did not ask for,
    skipped). The negative parts, ``crops`` = (min(lo, 0), min(hi, 0)), are cropped from the operand before the
    conv (a view, never a copy).
    """

    grow: tuple[int, ...]
    start: tuple[int, ...]
    crops: tuple[Pair, ...]
    surplus: tuple[int, ...]

    @property
    def offset(self) -> tuple[int, ...]:
        """Per dim, the row of the cropped operand that the wanted output's row 0 reads at tap 0: -max(lo, 0)
        (negative: padding), as ``tap_rows`` takes it."""
        return tuple(s - q for s, q in zip(self.start, self.grow))

    def conv_rows(self, rows: Iterable[int]) -> tuple[int, ...]:
        """Per dim, the output rows of the stride-1 conv padding ``grow``, when the operand padded by the wanted
        (lo, hi) gives ``rows``: ``start`` more before and ``surplus`` more after.

        Examples:
            >>> pad_split([(2, -1), (0, 3)]).conv_rows((5, 5))   # 5 + 0 before + 2 after; 5 + 3 before + 0 after
            (7, 8)
        """
        return tuple(r + b + a for r, b, a in zip(rows, self.start, self.surplus))


def pad_split(pads: Iterable[Pair]) -> PadSplit:
    """Split (lo, hi) pads per dim into a symmetric conv padding, the rows it adds before and after, and a crop.

    Padding by ``crops``, then by ``grow`` on both sides, then dropping ``start`` rows before gives exactly the
    operand padded by ``pads``, followed by ``surplus`` = ``grow - max(hi, 0)`` rows after, which a conv's output
    rows never need to read.

    Examples:
        >>> pad_split([(2, -1), (-3, 1), (0, 0)])
        PadSplit(grow=(2, 1, 0), start=(0, 1, 0), crops=((0, -1), (-3, 0), (0, 0)), surplus=(2, 0, 0))
    """
    pairs = tuple(pads)
    grow = tuple(max(lo, hi, 0) for lo, hi in pairs)
    start = tuple(q - max(lo, 0) for q, (lo, _) in zip(grow, pairs))
    crops = tuple((min(lo, 0), min(hi, 0)) for lo, hi in pairs)
    surplus = tuple(q - max(hi, 0) for q, (_, hi) in zip(grow, pairs))
    return PadSplit(grow, start, crops, surplus)


def strided_crop(start: int, step: int, rows: int, wanted: int) -> Pair:
    """The crop (lo, hi), as negative pads, of one dim of a conv's output that reads its operand with ``start``
    surplus rows before (a multiple of the conv's stride ``step``) and gives ``rows`` rows, of which the
    ``wanted`` ones follow the first start/step.

    Examples:
        >>> strided_crop(start=4, step=2, rows=7, wanted=3)   # rows 2, 3, 4 of 0..6
        (-2, -2)
    """
    return -(start // step), -(rows - start // step - wanted)


def phase_data_rows(size: int, rows: int, s: int, rho: int, lo: int) -> tuple[int, int, int]:
    """Which rows of phase rho (the rows rho, rho + s, ... of x padded by ``lo`` before) are rows of x, along one
    dim: phase row m is padded row s*m + rho, i.e. x row h = s*m + rho - lo, for m < ``rows``; x has ``size`` rows.

    Returns:
        ``(first, count, data_first)``: the phase rows first..first+count-1 are x's rows data_first,
        data_first + s, ...; ``count`` is 0 when none is.

    Examples:
        >>> phase_data_rows(size=5, rows=3, s=2, rho=0, lo=1)   # padded rows 0, 2, 4 are x rows -1, 1, 3
        (1, 2, 1)
    """
    first = max(0, -((rho - lo) // s))  # the first phase row inside x: s*first + rho - lo >= 0
    data_first = s * first + rho - lo
    return first, max(0, min(rows - first, len(range(data_first, size, s)))), data_first


def subpixel_dim(rows: int, o: int, dim: tuple[PhaseTaps | None, ...]) -> tuple[int, Pair, tuple[int, ...]] | None:
    """One dim of ``ConvSpec.subpixel_taps``: (fused taps, pads of y, offset of each phase's taps), or None.

    Each phase's taps are shifted by lo - lo_rho inside a common kernel of max(lo - lo_rho + count)
    taps, and y is padded once by (lo, hi) with lo = max(lo_rho). None when some phase needs
    dilation > 1 (d does not divide s) or the dim has no phase with taps (grad_input is then zero).
    Empty phases get offset 0.
    """
    live = [p for p in dim if p is not None]
    if not live or any(p.dilation != 1 for p in live):
        return None
    lo = max(p.pads[0] for p in live)
    taps = max(lo - p.pads[0] + p.count for p in live)
    offsets = tuple(0 if p is None else lo - p.pads[0] for p in dim)
    return taps, (lo, rows + taps - 1 - o - lo), offsets


def dilation_block(k: int, d: int, o: int) -> tuple[int, int]:
    """One dim of ``ConvSpec.dilation_blocks``: (U, M) blocks of d rows of the read x and of y.

    With stride 1, grad_weight[t] = sum_j x_read[t*d + j] y[j]; splitting j = d*m + phi makes it a
    stride-1 conv of the d phases x_phi[u] = x_read[d*u + phi] (U = k - 1 + M blocks) with the
    phases of y (M = ceil(o/d) blocks), phases folded into channels. y is zero-padded to M*d rows
    and x_read to U*d rows.
    """
    m = -(-o // d)
    return k - 1 + m, m


def stride_phase(k: int, s: int, o: int, pads: Pair, size: int) -> tuple[int, int, Pair]:
    """One dim of ``ConvSpec.stride_phases``: (Q, U, pads) of x for grad_weight by the stride s (dilation 1).

    Tap t = s*q + rho meets x_read[s*(j + q) + rho], which is row j + q of phase rho (the rows rho::s):
    each of the s phases is read by a stride-1 conv with Q = ceil(k/s) taps over U = o + Q - 1 rows, so
    x is padded by ``pads``, x_read_pads (``pads``, read extent ``size``) with the high side grown to s*U rows
    (the docs' "Derivation" page).
    """
    q = -(-k // s)
    return q, o + q - 1, pad_to_rows(pads, size, s * (o + q - 1))
