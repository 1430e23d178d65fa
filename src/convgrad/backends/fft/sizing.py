"""The fft backend's transform geometry: the polyphase split of every dim, its transform lengths and bins.

Integers only, no torch, as ``convgrad.spec`` (whose ``ConvSpec`` these functions read): the per-dim arithmetic
(``fft_phase``, ``smooth_size``, ``fft_size``, ``rfft_bins``) and the functions over a ``ConvSpec`` that zip it over
its dims (``phases``, ``phase_count``, ``bins``). The chunk sizing that reads them is in ``chunking``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import NamedTuple

from convgrad.spec import ConvSpec, Pair

__all__ = ["FftDim", "bins", "fft_phase", "fft_size", "phase_count", "phases", "rfft_bins", "smooth_size"]


class FftDim(NamedTuple):
    """One dim of the FFT backend's polyphase split (``phases``).

    x padded by ``pads`` has s*``rows`` rows; its phase ``phases[p]`` (rows phi::s) is correlated, stride 1, with a
    kernel of ``taps`` slots in which tap t sits at slot ``slots[t]`` - p*taps; ``size`` is the transform length,
    and x padded by ``transform_pads`` has s*``size`` rows (rows past ``size`` per phase are zeros).
    """

    phases: tuple[int, ...]
    taps: int
    rows: int
    pads: Pair
    size: int
    slots: tuple[int, ...]
    transform_pads: Pair

    def phase_pads(self, s: int) -> tuple[Pair, Pair]:
        """``transform_pads`` split in two for the stride-``s`` phases: x padded by the first pair (a, b) has a whole
        number M of rows per phase (s*M), each phase padded by the second (c, e) has ``size`` rows. Padding x by
        (a, b), splitting it into phases and padding each by (c, e) is padding x by ``transform_pads`` then splitting:
        c = max(lo, 0) div s, e = max(hi, 0) div s, a = lo - s*c, b = hi - s*e, c at most the ``size`` rows (a conv
        that reads none of x's rows pads more zero rows than the transform holds). The phases' zero rows (c, e) are
        left to the transform, which pads one dim at a time (``transforms.forward_transform``), and cut by the
        pruned inverse (``transforms.inverse_transform``) before the phases are interleaved; with stride 1, x is not
        padded at all (a = b = 0 unless a side crops).

        Examples:
            >>> d = fft_phase(28, 31, 1, 1, 28, (15, 15), 58)   # x padded (15, 5) to 48 rows
            >>> d.transform_pads, d.phase_pads(1)
            ((15, 5), ((0, 0), (15, 5)))
            >>> fft_phase(9, 3, 2, 2, 3, (0, 0), 9).phase_pads(2)   # (0, 3) to 2*6 rows: (0, 1) to 2*5, 1 zero row
            ((0, 1), (0, 1))
        """
        lo, hi = self.transform_pads
        c = min(max(lo, 0) // s, self.size)  # more only where x lies past the transform's rows (then hi < 0: e = 0)
        e = max(hi, 0) // s  # hi >= 0: x ends within the transform's rows, so c + e <= size
        return (lo - s * c, hi - s * e), (c, e)

    def whole_rows(self, s: int) -> int:
        """M: the rows of each stride-``s`` phase of x padded by the first pair of ``phase_pads`` (to s*M rows), the
        transform length L less the phase's zero rows (c, e): x padded by ``transform_pads`` has s*L rows.

        Examples:
            >>> fft_phase(9, 3, 2, 2, 3, (0, 0), 9).whole_rows(2)   # 9 rows padded (0, 1): 2*5
            5
            >>> fft_phase(28, 31, 1, 1, 28, (15, 15), 58).whole_rows(1)   # stride 1: x as it is
            28
        """
        c, e = self.phase_pads(s)[1]
        return self.size - c - e




def smooth_size(n: int) -> int:
    """The smallest 5-smooth integer (2^a 3^b 5^c) >= n: a transform length FFT libraries compute fastest.

    Examples:
        >>> [smooth_size(n) for n in (1, 7, 11, 58, 97, 1025)]
        [1, 8, 12, 60, 100, 1080]
    """
    best, p2 = None, 1
    while True:
        p3 = p2
        while True:
            p5 = p3
            while p5 < n:
                p5 *= 5
            best = p5 if best is None else min(best, p5)
            if p3 >= n:
                break
            p3 *= 3
        if p2 >= n:
            return best
        p2 *= 2




def fft_size(n: int) -> int:
    """The FFT backend's length for at least n points along the last dim (the one a real transform halves): the
    smallest even 5-smooth integer >= n (1 for n <= 1). A real FFT of odd length costs about twice as much per
    point as one of an even length near it (benchmarks/results/fft_sizes.md, ``python benchmarks/fft_sizes.py
    --threads 1``); the other dims' complex transforms do not halve, and keep ``smooth_size``.

    Examples:
        >>> [fft_size(n) for n in (1, 2, 7, 20, 45, 81, 1025)]
        [1, 2, 8, 20, 48, 90, 1080]
    """
    size = smooth_size(n)
    while size % 2 and size > 1:
        size = smooth_size(size + 1)
    return size




def rfft_bins(sizes: Iterable[int]) -> int:
    """The complex bins of a real N-d transform of ``sizes``: prod(sizes[:-1]) * (sizes[-1] // 2 + 1), the last dim
    halved by conjugate symmetry (rfftn's output).

    Args:
        sizes: the transform lengths, one per dim (ints >= 1, at least one).

    Returns:
        The number of complex bins (int).

    Examples:
        >>> rfft_bins((10,)), rfft_bins((45, 48))
        (6, 1125)
    """
    *lead, last = sizes
    return math.prod(lead) * (last // 2 + 1)




def fft_phase(i: int, k: int, s: int, d: int, o: int, pads: Pair, size: int, last: bool = True) -> FftDim:
    """One dim of ``phases``: the polyphase split of the read x into stride-1 correlations.

    Tap t reads x_pad[j*s + t*d]; with t*d = s*q + phi it is row j + q of phase phi (the rows phi::s), so each
    phase is read by a stride-1 correlation with the taps whose t*d = phi (mod s), at offsets q = t*d div s.
    Only the phases some tap reaches take part (the multiples of gcd(s, d) below s). With dilation 1 this is
    ``spec.formulation.stride_phase`` (Q = ceil(k/s), U = o + Q - 1, the same pads); with stride 1 it is the dilated
    kernel. ``pads`` and ``size`` are x_read_pads and x_read_size of the dim, ``i`` the input extent.

    The transform length L need not reach U: a phase's first ``lead`` and last ``trail`` rows are padding zeros,
    and a circular correlation of length L >= U - min(lead, trail) (and >= o, Q) wraps only zeros onto zeros
    (reads past L land on the leading zeros, reads below 0 on the trailing ones); grad_input's adjoint is exact
    on the data rows, which all lie below L. A 31x31 kernel padded 15 on 28x28 needs 43 rows, not 58. The
    ``last`` dim, the one a real transform halves, takes an even length (``fft_size``: 48), the others a 5-smooth
    one (``smooth_size``: 45).

    Examples:
        >>> fft_phase(28, 31, 1, 1, 28, (15, 15), 58).size, fft_phase(28, 31, 1, 1, 28, (15, 15), 58, False).size
        (48, 45)
    """
    q = d * (k - 1) // s + 1
    rows = o + q - 1
    phases = tuple(sorted({t * d % s for t in range(k)}))
    slots = tuple(phases.index(t * d % s) * q + t * d // s for t in range(k))
    lo, hi = pads
    first, end = max(lo, 0), min(lo + i, s * rows)  # the data rows of the padded x
    lead, trail = (first // s, rows - 1 - (end - 1) // s) if end > first else (rows, rows)
    length = (fft_size if last else smooth_size)(max(rows - min(lead, trail), o, q, 1))
    return FftDim(phases, q, rows, (lo, hi + s * rows - size), length, slots, (lo, hi + s * length - size))


# ---- over a ConvSpec ------------------------------------------------------------------------------------------------
def phases(spec: ConvSpec) -> tuple[FftDim, ...]:
    """Per dim the polyphase split of the read x into stride-1 correlations, for the FFT backend (``fft_phase`` has
    the derivation).

    Returns:
        tuple of ``FftDim`` per spatial dim: the live phases, Q, U, the pads of x to s*U rows, the transform
        size L (5-smooth, even in the last dim: ``fft_size``; >= U less the padding rows that wrap onto zeros),
        each tap's slot p*Q + q and the pads of x to s*L rows.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1)
        >>> phases(spec)[0][1:4] == spec.stride_phases[0]
        True
        >>> phases(ConvSpec.from_shapes((1, 1, 9), (1, 1, 3), stride=2, dilation=2))[0]
        FftDim(phases=(0,), taps=3, rows=5, pads=(0, 1), size=6, slots=(0, 1, 2), transform_pads=(0, 3))
    """
    dims = zip(spec.x_size, spec.kernel_size, spec.stride, spec.dilation, spec.y_size, spec.x_read_pads,
               spec.x_read_size)
    return tuple(fft_phase(i, k, s, d, o, pads, size, last=j == spec.n - 1)
                 for j, (i, k, s, d, o, pads, size) in enumerate(dims))


def phase_count(spec: ConvSpec) -> int:
    """P: the live phases of the read x in the FFT backend's polyphase split, the product over dims of the phases
    some tap reaches (``phases``); at most prod(s/gcd(s, d)).

    Returns:
        P (int, >= 1).

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> phase_count(ConvSpec.from_shapes((1, 1, 9, 9), (1, 1, 3, 3), stride=2))
        4
        >>> phase_count(ConvSpec.from_shapes((1, 1, 9, 9), (1, 1, 3, 3), stride=2, dilation=2))
        1
    """
    return math.prod([len(f.phases) for f in phases(spec)])


def bins(spec: ConvSpec) -> int:
    """The complex bins of one spectrum of the FFT backend: a real transform of the lengths of ``phases``
    (``rfft_bins``).

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> bins(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256))
        1125
    """
    return rfft_bins(f.size for f in phases(spec))
