"""The fft backend's tensor steps: transforms, the polyphase split and its inverse, tap placement, per-bin products.

Each function is one step of a plan (``plans.FftStep``) on tensors; all are differentiable torch ops, so gradients
of any order come from autograd. Spectra have their bins flattened to F for the products.
"""

from __future__ import annotations

import torch

from convgrad.spec import FftDim
from convgrad.tensor_ops import crop, pad, sliced

__all__ = ["SMALL_PRODUCT", "first_rows", "forward_transform", "from_phases", "inverse_transform", "place_taps",
           "read_taps", "reversed_spectrum", "to_phases", "w_bins", "x_bins", "y_bins"]

Shape = tuple[int, ...]
# The per-bin product of at most this many (a, b) pairs is a broadcast product; above it, a batched matmul.
SMALL_PRODUCT = 4


def forward_transform(t: torch.Tensor, sizes: Shape) -> torch.Tensor:
    """N-d transform of the trailing dims, zero-padded (or cut) to sizes: rfftn for real data, fftn for complex."""
    dims = tuple(range(-len(sizes), 0))
    return torch.fft.fftn(t, s=sizes, dim=dims) if t.is_complex() else torch.fft.rfftn(t, s=sizes, dim=dims)


def inverse_transform(t: torch.Tensor, sizes: Shape, real: bool) -> torch.Tensor:
    """The inverse of ``forward_transform``: irfftn (real result) or ifftn."""
    dims = tuple(range(-len(sizes), 0))
    return torch.fft.irfftn(t, s=sizes, dim=dims) if real else torch.fft.ifftn(t, s=sizes, dim=dims)


def reversed_spectrum(t: torch.Tensor, n: int, real: bool) -> torch.Tensor:
    """T(-f) over the trailing n dims: the transform of the reversed sequence, t[-m mod L]."""
    if real:
        return t.conj()
    dims = tuple(range(-n, 0))
    return torch.roll(torch.flip(t, dims), (1,) * n, dims)


def first_rows(t: torch.Tensor, rows: Shape) -> torch.Tensor:
    """The first rows[j] entries of each trailing dim (no alias when nothing is cropped: the legacy vmap of
    is_grads_batched cannot batch one)."""
    return sliced(t, [slice(0, r) for r in rows])


def to_phases(x: torch.Tensor, dims: tuple[FftDim, ...], stride: Shape) -> torch.Tensor:
    """x (n, C, *i) -> its live phases as channels, each L rows long (n, C*P, *L): one pad (or crop) to s*L rows."""
    n, c, nd = x.shape[0], x.shape[1], len(dims)
    x = pad(x, [d.transform_pads for d in dims])  # (n, C, *s*L)
    if all(s == 1 for s in stride):
        return x
    x = x.reshape(n, c, *(v for d, s in zip(dims, stride) for v in (d.size, s)))  # (n, C, L1, s1, L2, s2, ..)
    x = x.permute(0, 1, *range(3, 2 + 2 * nd, 2), *range(2, 2 + 2 * nd, 2))  # (n, C, s1, s2, .., L1, L2, ..)
    for j, (d, s) in enumerate(zip(dims, stride)):
        if len(d.phases) < s:
            x = x.index_select(2 + j, torch.tensor(d.phases, device=x.device))  # (n, C, .., P_j, .., *L)
    return x.reshape(n, -1, *(d.size for d in dims))  # (n, C*P, *L)


def from_phases(t: torch.Tensor, dims: tuple[FftDim, ...], stride: Shape, channels: int) -> torch.Tensor:
    """(n, C*P, *L) -> x (n, C, *i): interleave the phases (zeros where none is live), crop the pads."""
    n, nd = t.shape[0], len(dims)
    if any(s > 1 for s in stride):
        t = t.reshape(n, channels, *(len(d.phases) for d in dims), *(d.size for d in dims))  # (n, C, *P, *L)
        for j, (d, s) in enumerate(zip(dims, stride)):
            if len(d.phases) < s:  # every phase phi takes its live slot, or the zero slot appended last
                t = pad(t.movedim(2 + j, -1), [(0, 1)]).movedim(-1, 2 + j)  # (n, C, .., P_j + 1, .., *L)
                slot = [d.phases.index(phi) if phi in d.phases else len(d.phases) for phi in range(s)]
                t = t.index_select(2 + j, torch.tensor(slot, device=t.device))  # (n, C, .., s_j, .., *L)
        order = [v for j in range(nd) for v in (2 + nd + j, 2 + j)]
        t = t.permute(0, 1, *order).reshape(n, channels, *(d.size * s for d, s in zip(dims, stride)))
    return crop(t, [d.transform_pads for d in dims])  # (n, C, *i)


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
    operands runs several times slower on the CPU (2x to 5x on wav2letter's and HiFi-GAN's products, CPU time)."""
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
    if b == 1:
        return (y * x).sum(0).unsqueeze(2)  # (n, g, A, F) -> (g, A, 1, F)
    if a == 1:
        return (y * x).sum(0).unsqueeze(1)  # (n, g, B, F) -> (g, 1, B, F)
    if a * b <= SMALL_PRODUCT:
        return (y.unsqueeze(3) * x.unsqueeze(2)).sum(0)  # (n, g, A, B, F) -> (g, A, B, F)
    return torch.matmul(_bins_major(y.permute(1, 3, 2, 0)),
                        _bins_major(x.permute(1, 3, 0, 2))).permute(0, 2, 3, 1)  # (g,F,A,B) -> (g,A,B,F)
