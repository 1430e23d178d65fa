"""The fft backend's execution: run a plan (``plans.plan``) chunk by chunk over groups and samples.

Per chunk: the phases of x (or y) transformed, the kernel spectra of the chunk's groups, the per-bin product,
the inverse transform and the crop, written into the result.
"""

from __future__ import annotations

import torch

from convgrad.backends.fft import transforms as tf
from convgrad.backends.fft.plans import FftPlan
from convgrad.tensor_ops import batched_like, sliced

__all__ = ["execute"]

Shape = tuple[int, ...]


def execute(p: FftPlan, data: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Run a plan: ``data`` is x (y_from_x, w_from_xy) or y (x_from_y); ``other`` the weight, or y for w_from_xy.

    Half precision runs in float32 (FFT libraries lack it on most sizes) and comes back in its dtype.
    """
    dtype = data.dtype
    if dtype in (torch.float16, torch.bfloat16):
        data, other = data.float(), other.float()
    run = {"y_from_x": _y_from_x, "x_from_y": _x_from_y, "w_from_xy": _w_from_xy}[p.kind]
    return run(p, data, other).to(dtype)


def _ranges(total: int, step: int) -> list[tuple[int, int]]:
    return [(j, min(j + step, total)) for j in range(0, total, step)]


class _Output:
    """The result, assembled chunk by chunk: written into one tensor when there are several chunks (a list and a
    cat would hold it twice), a compact copy of the one chunk otherwise (a crop of the inverse transform is a view
    that would keep the whole transform alive)."""

    def __init__(self, shape: Shape, chunks: tuple[int, int], data: torch.Tensor, kernel: torch.Tensor) -> None:
        self.shape, self.several = shape, chunks[0] < shape[1] or chunks[1] < shape[0]
        self.data, self.kernel = data, kernel
        self.tensor = batched_like(batched_like(data.new_empty(shape), kernel), data) if self.several else data

    def put(self, n0: int, n1: int, c0: int, c1: int, part: torch.Tensor) -> None:
        if self.several:
            self.tensor[n0:n1, c0:c1] = part
        else:
            self.tensor = part.contiguous()


def _y_from_x(p: FftPlan, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    real = not (x.is_complex() or w.is_complex())
    (a, b0, b), nd = p.group_channels, spec.n
    if spec.batch == 0:
        return x.new_zeros(spec.y_shape)
    wp = tf.place_taps(w, dims)  # (C_y, B, *Q)
    out = _Output(spec.y_shape, p.chunks, x, w)
    for g0, g1 in _ranges(spec.groups, p.chunks[0]):
        wf = tf.reversed_spectrum(tf.forward_transform(sliced(wp, [slice(g0 * a, g1 * a)], 0), sizes), nd, real)
        wf = wf.reshape(g1 - g0, a, b, -1)  # (g', A, B, F)
        for n0, n1 in _ranges(spec.batch, p.chunks[1]):
            part = sliced(x, [slice(n0, n1), slice(g0 * b0, g1 * b0)], 0)  # (n', g'*B0, *i)
            xf = tf.forward_transform(tf.to_phases(part, dims, spec.stride), sizes)  # (n', g'*B, *bins)
            bins = xf.shape[2:]
            xf = xf.reshape(n1 - n0, g1 - g0, b, -1)  # (n', g', B, F)
            yf = tf.y_bins(xf, wf).reshape(n1 - n0, (g1 - g0) * a, *bins)  # (n', g'*A, *bins)
            part = tf.first_rows(tf.inverse_transform(yf, sizes, real), spec.y_size)  # (n', g'*A, *o)
            out.put(n0, n1, g0 * a, g1 * a, part)
    return out.tensor  # (N, C_y, *o)


def _x_from_y(p: FftPlan, y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    real = not (y.is_complex() or w.is_complex())
    a, b0, b = p.group_channels
    if spec.batch == 0:
        return y.new_zeros(spec.x_shape)
    wp = tf.place_taps(w, dims)  # (C_y, B, *Q)
    out = _Output(spec.x_shape, p.chunks, y, w)
    for g0, g1 in _ranges(spec.groups, p.chunks[0]):
        wf = tf.forward_transform(sliced(wp, [slice(g0 * a, g1 * a)], 0), sizes).reshape(g1 - g0, a, b, -1)
        for n0, n1 in _ranges(spec.batch, p.chunks[1]):
            yf = tf.forward_transform(sliced(y, [slice(n0, n1), slice(g0 * a, g1 * a)], 0), sizes)  # (n', g'*A, *bins)
            bins = yf.shape[2:]
            xf = tf.x_bins(yf.reshape(n1 - n0, g1 - g0, a, -1), wf)  # (n', g', B, F)
            xs = tf.inverse_transform(xf.reshape(n1 - n0, (g1 - g0) * b, *bins), sizes, real)  # (n', g'*B, *L)
            out.put(n0, n1, g0 * b0, g1 * b0, tf.from_phases(xs, dims, spec.stride, (g1 - g0) * b0))  # (n', g'*B0, *i)
    return out.tensor  # (N, C_x, *i)


def _w_from_xy(p: FftPlan, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    real = not (x.is_complex() or y.is_complex())
    (a, b0, b), nd = p.group_channels, spec.n
    if spec.batch == 0:
        return x.new_zeros(spec.weight_shape)
    q = tuple(d.taps for d in dims)
    parts = []
    for g0, g1 in _ranges(spec.groups, p.chunks[0]):
        acc: torch.Tensor | None = None
        bins: tuple[int, ...] = ()
        for n0, n1 in _ranges(spec.batch, p.chunks[1]):
            part = sliced(x, [slice(n0, n1), slice(g0 * b0, g1 * b0)], 0)  # (n', g'*B0, *i)
            xf = tf.forward_transform(tf.to_phases(part, dims, spec.stride), sizes)  # (n', g'*B, *bins)
            bins = tuple(xf.shape[2:])
            part = sliced(y, [slice(n0, n1), slice(g0 * a, g1 * a)], 0)  # (n', g'*A, *o)
            yf = tf.reversed_spectrum(tf.forward_transform(part, sizes), nd, real)  # (n', g'*A, *bins)
            term = tf.w_bins(xf.reshape(n1 - n0, g1 - g0, b, -1), yf.reshape(n1 - n0, g1 - g0, a, -1))  # (g',A,B,F)
            acc = term if acc is None else acc + term
        wf = acc.reshape((g1 - g0) * a, b, *bins)  # type: ignore[union-attr]  # (g'*A, B, *bins)
        parts.append(tf.first_rows(tf.inverse_transform(wf, sizes, real), q).contiguous())  # (g'*A, B, *Q)
    wp = torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # (C_y, B, *Q)
    return tf.read_taps(wp, dims, b0)  # (C_y, C_x/g, *k)
