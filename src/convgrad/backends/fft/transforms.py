"""The fft backend's tensor steps: transforms, the polyphase split and its inverse, tap placement, per-bin products.

Each function is one step of a plan (``plans.FftStep``) on tensors; all are differentiable torch ops, so gradients
of any order come from autograd. Spectra have their bins flattened to F for the products.

The transforms are pruned: the operands are small inside the transform size L (a 7x7x7 kernel in 54^3, 14x14 data in
20x20) and only the first rows of a result are kept, so a 1-d transform of a row that is all zeros, or of a row that
is cut afterwards, is skipped where that pays (``forward_transform``, ``inverse_transform``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from convgrad.backends.fft.sizing import FftDim
from convgrad.spec import Pair, pad_then_crop, pad_to_rows
from convgrad.tensor_ops import crop, pad, sliced

__all__ = ["PRUNE_FILL", "PRUNE_MIN_POINTS", "SMALL_PRODUCT", "forward_transform", "from_phases", "inverse_transform",
           "place_taps", "read_taps", "reversed_spectrum", "to_phases", "w_bins", "x_bins", "y_bins"]

Shape = tuple[int, ...]
# The measurements behind these thresholds: benchmarks/results/fft_transform_rules.md.
# The per-bin product of at most this many (a, b) pairs is a broadcast product (one pass); above it, a batched matmul
SMALL_PRODUCT = 4
# The transforms are pruned (one dim at a time) only on a grid of at least this many points (the leading dims times
# the product of L): each dim's own FFT call has its setup, which outweighs the rows it saves on smaller grids
PRUNE_MIN_POINTS = 2**18
# The forward transform is pruned where, besides, the data fills at most this share of the rows the last dim's
# transforms run over; above it one padded copy and rfftn's single pass are faster
PRUNE_FILL = 0.5


def _pays(t: torch.Tensor, sizes: Shape) -> bool:
    """Whether transforming t's trailing dims one call per dim pays: more than one dim, and a large enough grid."""
    nd = len(sizes)
    return nd > 1 and math.prod(t.shape[:-nd]) * math.prod(sizes) >= PRUNE_MIN_POINTS


def _one_dim(pair: Pair, j: int, nd: int) -> list[Pair]:
    """``pair`` for trailing dim j of nd, (0, 0) for the dims after it: a pad or crop of that dim alone."""
    return [pair, *[(0, 0)] * (nd - 1 - j)]


def forward_transform(t: torch.Tensor, sizes: Shape, pads: Sequence[Pair] | None = None) -> torch.Tensor:
    """N-d transform of the trailing dims of t padded by ``pads`` to ``sizes``: rfftn for real data, fftn for complex.

    ``pads``: (lo, hi) per dim, a negative amount a crop; default (0, L - m), which is ``rfftn(t, s=sizes)`` (a
    data extent m above L is cut). Where the data fills at most ``PRUNE_FILL`` of the rows before the last dim (and
    the grid has ``PRUNE_MIN_POINTS``), the last dim is transformed first over the data's rows only, then each
    earlier dim over the rows still nonzero, each padded as it is reached: the same spectrum, fewer 1-d transforms
    and no full-size padded copy.
    """
    nd = len(sizes)
    if _pays(t, sizes):
        pairs = [pad_to_rows((0, 0), m, n) for m, n in zip(t.shape[-nd:], sizes)] if pads is None else pads
        grow, cut = pad_then_crop(pairs)
        data = crop(t, cut)  # (.., *m): the data's rows, a view
        if math.prod([m / n for m, n in zip(data.shape[-nd:-1], sizes[:-1])]) <= PRUNE_FILL:
            for j in reversed(range(nd)):
                data = pad(data, _one_dim(grow[j], j, nd))  # dim j padded to L_j; those before it still the data's
                data = torch.fft.fft(data, dim=j - nd) if data.is_complex() else torch.fft.rfft(data, dim=j - nd)
            return data  # (.., *bins)
    t = t if pads is None else pad(t, pads)  # (.., *L), or rfftn(s=) pads and cuts
    dims = tuple(range(-nd, 0))
    return torch.fft.fftn(t, s=sizes, dim=dims) if t.is_complex() else torch.fft.rfftn(t, s=sizes, dim=dims)


def inverse_transform(t: torch.Tensor, sizes: Shape, real: bool, cuts: Sequence[Pair] | None = None) -> torch.Tensor:
    """The inverse of ``forward_transform`` (irfftn: a real result, or ifftn), with ``cuts`` (lo, hi) rows per dim
    cut off the result (default none).

    Pruned (N-d, on a grid of ``PRUNE_MIN_POINTS`` or more): the dims before the last are inverted first, each cut
    before the next, and the last (c2r) dim runs on the rows that remain only; the same result as
    ``crop(irfftn(t, s=sizes), cuts)``.
    """
    nd = len(sizes)
    if cuts is not None and _pays(t, sizes):
        for j in range(nd - 1):
            t = _cut(torch.fft.ifft(t, dim=j - nd), _one_dim(cuts[j], j, nd))  # dim j inverted and cut: (.., r_j, ..)
        last = torch.fft.irfft(t, n=sizes[-1], dim=-1) if real else torch.fft.ifft(t, n=sizes[-1], dim=-1)
        return _cut(last, [cuts[-1]])  # (.., *r)
    dims = tuple(range(-nd, 0))
    out = torch.fft.irfftn(t, s=sizes, dim=dims) if real else torch.fft.ifftn(t, s=sizes, dim=dims)
    return out if cuts is None else _cut(out, cuts)


def _cut(t: torch.Tensor, cuts: Sequence[Pair]) -> torch.Tensor:
    """``crop`` for cuts >= 0 (all the inverse makes), without its pad-then-crop checks: it runs once per chunk."""
    nd = len(cuts)
    return sliced(t, [slice(lo, t.shape[j - nd] - hi) for j, (lo, hi) in enumerate(cuts)])


def reversed_spectrum(t: torch.Tensor, n: int, real: bool) -> torch.Tensor:
    """T(-f) over the trailing n dims: the transform of the reversed sequence, t[-m mod L]."""
    if real:
        return t.conj()
    dims = tuple(range(-n, 0))
    return torch.roll(torch.flip(t, dims), (1,) * n, dims)


def to_phases(x: torch.Tensor, dims: tuple[FftDim, ...], stride: Shape) -> torch.Tensor:
    """x (n, C, *i) -> its live phases as channels, M rows each (n, C*P, *M): x padded (or cut) by the first pair
    of ``FftDim.phase_pads`` only, to s*M rows (with stride 1 not at all); the phases' zero rows
    (``FftPlan.phase_zeros``) are left to ``forward_transform``."""
    n, c, nd = x.shape[0], x.shape[1], len(dims)
    x = pad(x, [d.phase_pads(s)[0] for d, s in zip(dims, stride)])  # (n, C, *s*M)
    if all(s == 1 for s in stride):
        return x
    rows = [d.whole_rows(s) for d, s in zip(dims, stride)]
    x = x.reshape(n, c, *(v for m, s in zip(rows, stride) for v in (m, s)))  # (n, C, M1, s1, M2, s2, ..)
    x = x.permute(0, 1, *range(3, 2 + 2 * nd, 2), *range(2, 2 + 2 * nd, 2))  # (n, C, s1, s2, .., M1, M2, ..)
    for j, (d, s) in enumerate(zip(dims, stride)):
        if len(d.phases) < s:
            x = x.index_select(2 + j, torch.tensor(d.phases, device=x.device))  # (n, C, .., P_j, .., *M)
    # C*P spelled out, not -1: a phase may hold no rows (M_j = 0), and -1 cannot be inferred from 0 elements
    return x.reshape(n, c * math.prod(x.shape[2:2 + nd]), *rows)  # (n, C*P, *M)


def from_phases(t: torch.Tensor, dims: tuple[FftDim, ...], stride: Shape, channels: int) -> torch.Tensor:
    """(n, C*P, *M) -> x (n, C, *i): interleave the phases (zeros where none is live), crop the pads. M: each
    phase's rows left by ``inverse_transform``'s cuts (``FftPlan.phase_zeros``); then the first pair of
    ``FftDim.phase_pads`` is cropped."""
    n, nd, rows = t.shape[0], len(dims), t.shape[2:]
    if any(s > 1 for s in stride):
        t = t.reshape(n, channels, *(len(d.phases) for d in dims), *rows)  # (n, C, *P, *M)
        for j, (d, s) in enumerate(zip(dims, stride)):
            if len(d.phases) < s:  # every phase phi takes its live slot, or the zero slot appended last
                t = pad(t.movedim(2 + j, -1), [(0, 1)]).movedim(-1, 2 + j)  # (n, C, .., P_j + 1, .., *M)
                slot = [d.phases.index(phi) if phi in d.phases else len(d.phases) for phi in range(s)]
                t = t.index_select(2 + j, torch.tensor(slot, device=t.device))  # (n, C, .., s_j, .., *M)
        order = [v for j in range(nd) for v in (2 + nd + j, 2 + j)]
        t = t.permute(0, 1, *order).reshape(n, channels, *(m * s for m, s in zip(rows, stride)))  # (n, C, *s*M)
    return crop(t, [d.phase_pads(s)[0] for d, s in zip(dims, stride)])  # (n, C, *i)


def place_taps(w: torch.Tensor, dims: tuple[FftDim, ...]) -> torch.Tensor:
    """w (A', B0, *k) -> the phase kernels (A', B0*P, *Q): tap t at slot (phase, q), zeros elsewhere."""
    nd = len(dims)
    if all(d.slots == tuple(range(d.taps)) for d in dims):  # stride and dilation 1: the kernel as it is
        return w
    for j, d in enumerate(dims):
        k = len(d.slots)
        where = {slot: t for t, slot in enumerate(d.slots)}
        index = [where.get(slot, k) for slot in range(len(d.phases) * d.taps)]  # k: the zero appended
        w = pad(w.movedim(2 + j, -1), [(0, 1)]).movedim(-1, 2 + j)  # (A', B0, .., k_j + 1, ..)
        w = w.index_select(2 + j, torch.tensor(index, device=w.device))  # (A', B0, .., P_j*Q_j, ..)
    a, b0 = w.shape[:2]
    w = w.reshape(a, b0, *(v for d in dims for v in (len(d.phases), d.taps)))  # (A', B0, P1, Q1, P2, Q2, ..)
    w = w.permute(0, 1, *range(2, 2 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))  # (A', B0, *P, *Q)
    return w.reshape(a, -1, *(d.taps for d in dims))  # (A', B0*P, *Q)


def read_taps(t: torch.Tensor, dims: tuple[FftDim, ...], b0: int) -> torch.Tensor:
    """(A', B0*P, *Q) -> (A', B0, *k): each tap read from its slot; the inverse of ``place_taps``."""
    if all(d.slots == tuple(range(d.taps)) for d in dims):
        return t
    a, nd = t.shape[0], len(dims)
    t = t.reshape(a, b0, *(len(d.phases) for d in dims), *(d.taps for d in dims))  # (A', B0, *P, *Q)
    order = [v for j in range(nd) for v in (2 + j, 2 + nd + j)]
    t = t.permute(0, 1, *order).reshape(a, b0, *(len(d.phases) * d.taps for d in dims))  # (A', B0, *(P*Q))
    for j, d in enumerate(dims):
        t = t.index_select(2 + j, torch.tensor(d.slots, device=t.device))  # (A', B0, .., k_j, ..)
    return t


# ---- the per-bin products (spectra with their bins flattened to F) --------------------------------------------
# A side of one channel per group (depthwise, a single-channel front end) makes the product an outer product or a
# dot product per bin: a broadcast product (and a sum) does it in one pass, where a batched matmul would run F
# matmuls with an inner or outer size of 1.
def _bins_major(t: torch.Tensor) -> torch.Tensor:
    """A per-bin matmul operand (g, F, rows, cols), contiguous: a batched matmul of permuted (strided) complex
    operands runs several times slower on the CPU (benchmarks/results/fft_transform_rules.md)."""
    return t.contiguous()


def y_bins(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (n, g, B, F), w (g, A, B, F) -> (n, g, A, F): sum over b."""
    b, a = x.shape[2], w.shape[1]
    if b == 1:
        return x * w[:, :, 0]  # (n, g, 1, F) * (g, A, F) -> (n, g, A, F)
    if a == 1:
        return (x * w[:, 0]).sum(2, keepdim=True)  # (n, g, B, F) -> (n, g, 1, F)
    if a * b <= SMALL_PRODUCT:
        return sum(sliced(x, [slice(j, j + 1)], 2) * w[:, :, j] for j in range(b))  # type: ignore[return-value]
    return torch.matmul(_bins_major(x.permute(1, 3, 0, 2)),
                        _bins_major(w.permute(0, 3, 2, 1))).permute(2, 0, 3, 1)  # (g,F,n,A) -> (n,g,A,F)


def x_bins(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """y (n, g, A, F), w (g, A, B, F) -> (n, g, B, F): sum over a."""
    a, b = w.shape[1], w.shape[2]
    if a == 1:
        return y * w[:, 0]  # (n, g, 1, F) * (g, B, F) -> (n, g, B, F)
    if b == 1:
        return (y * w[:, :, 0]).sum(2, keepdim=True)  # (n, g, A, F) -> (n, g, 1, F)
    if a * b <= SMALL_PRODUCT:
        return sum(sliced(y, [slice(j, j + 1)], 2) * w[:, j] for j in range(a))  # type: ignore[return-value]
    return torch.matmul(_bins_major(y.permute(1, 3, 0, 2)),
                        _bins_major(w.permute(0, 3, 1, 2))).permute(2, 0, 3, 1)  # (g,F,n,B) -> (n,g,B,F)


def w_bins(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x (n, g, B, F), y (n, g, A, F) -> (g, A, B, F): sum over n."""
    a, b = y.shape[2], x.shape[2]
    if a == 1 or b == 1:  # one sample (SincNet's chunks): no sum, which would copy
        term = y[0] * x[0] if x.shape[0] == 1 else (y * x).sum(0)  # (g, A or B, F)
        return term.unsqueeze(2 if b == 1 else 1)  # (g, A, B, F)
    if a * b <= SMALL_PRODUCT:
        return (y.unsqueeze(3) * x.unsqueeze(2)).sum(0)  # (n, g, A, B, F) -> (g, A, B, F)
    return torch.matmul(_bins_major(y.permute(1, 3, 2, 0)),
                        _bins_major(x.permute(1, 3, 0, 2))).permute(0, 2, 3, 1)  # (g,F,A,B) -> (g,A,B,F)
