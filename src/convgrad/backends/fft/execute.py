"""The fft backend's execution: run a plan (``plans.plan``) chunk by chunk over groups, samples and kernel rows.

Per chunk: the phases of x (or y) transformed, the kernel spectra of the chunk's groups, the per-bin product,
the inverse transform and the crop, written into the result. A dense layer's kernel spectra are held a slice of
rows (y channels) at a time (``FftPlan.row_chunk``): y's rows computed per slice, x's sums accumulated over them
(from the spectra of y's rows in the slice alone), the weight's rows inverted per slice. A slice's or a sample
chunk's spectra are locals of ``_x_term``/``_w_term``: none outlives its term into the next one's transforms.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from convgrad.backends.fft import transforms as tf
from convgrad.backends.fft.plans import FftPlan
from convgrad.spec.chunks import chunk_ranges
from convgrad.tensor_ops import batched_like, sliced

__all__ = ["execute"]

Shape = tuple[int, ...]


def execute(p: FftPlan, data: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Run a plan: ``data`` is x (y_from_x, w_from_xy) or y (x_from_y); ``other`` the weight, or y for w_from_xy.

    Half precision runs in float32 (FFT libraries lack it on most sizes) and comes back in its dtype.
    """
    dtype, spec = data.dtype, p.spec
    if spec.batch == 0:  # nothing to transform: an empty result, or grad_weight's empty sum
        shapes = {"y_from_x": spec.y_shape, "x_from_y": spec.x_shape, "w_from_xy": spec.weight_shape}
        return data.new_zeros(shapes[p.kind])
    if dtype in (torch.float16, torch.bfloat16):
        data, other = data.float(), other.float()
    run = {"y_from_x": _y_from_x, "x_from_y": _x_from_y, "w_from_xy": _w_from_xy}[p.kind]
    return run(p, data, other, not (data.is_complex() or other.is_complex())).to(dtype)


class _Output:
    """The result, assembled chunk by chunk: written into one tensor when there are several chunks (a list and a
    cat would hold it twice), a compact copy of the one chunk otherwise (a crop of the inverse transform is a view
    that would keep the whole transform alive)."""

    def __init__(self, shape: Shape, several: bool, data: torch.Tensor, kernel: torch.Tensor) -> None:
        self.shape, self.several = shape, several
        self.data, self.kernel = data, kernel
        self.tensor = batched_like(batched_like(data.new_empty(shape), kernel), data) if self.several else data

    def put(self, n0: int, n1: int, c0: int, c1: int, part: torch.Tensor) -> None:
        if self.several:
            self.tensor[n0:n1, c0:c1] = part
        else:
            self.tensor = part.contiguous()


def _several(p: FftPlan) -> bool:
    """Whether the plan runs in more than one chunk (of groups, samples or kernel rows)."""
    a = p.group_channels[0]
    return p.chunks[0] < p.spec.groups or p.chunks[1] < p.spec.batch or p.row_chunk < a


def _rows(wp: torch.Tensor, a: int, g0: int, g1: int, r0: int, r1: int) -> torch.Tensor:
    """Kernel rows r0:r1 of each of the groups g0:g1: (g'*r', *rest) of wp (C_y, *rest)."""
    if r1 - r0 == a:
        return sliced(wp, [slice(g0 * a, g1 * a)], 0)  # (g'*A, *rest)
    wg = wp.reshape(-1, a, *wp.shape[1:])  # (g, A, *rest)
    return wg[g0:g1, r0:r1].reshape(-1, *wp.shape[1:])  # (g'*r', *rest)


def _kernel(p: FftPlan, w: torch.Tensor) -> torch.Tensor:
    """The phase kernels (C_y, B, *Q) placed once when a group's rows are one chunk; else w itself (C_y, B0, *k),
    each row slice placed as it is transformed (the placed whole is the weight's size again)."""
    return tf.place_taps(w, p.dims) if p.row_chunk == p.group_channels[0] else w


def _kernel_bins(p: FftPlan, kernel: torch.Tensor, g0: int, g1: int, r0: int, r1: int, reverse: bool,
                 real: bool) -> torch.Tensor:
    """The spectra of kernel rows r0:r1 of groups g0:g1 (of ``_kernel``), reversed (W(-f), for y from x) or not:
    (g', r', B, F)."""
    (a, _, b), sizes = p.group_channels, p.sizes
    rows = _rows(kernel, a, g0, g1, r0, r1)  # (g'*r', B or B0, *Q or *k)
    if p.row_chunk < a:
        rows = tf.place_taps(rows, p.dims)  # (g'*r', B, *Q)
    wf = tf.forward_transform(rows, sizes)  # (g'*r', B, *bins)
    if reverse:
        wf = tf.reversed_spectrum(wf, len(sizes), real)
    return wf.reshape(g1 - g0, r1 - r0, b, -1)  # (g', r', B, F)


def _group_chunks(p: FftPlan, kernel: torch.Tensor, reverse: bool, real: bool
                  ) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """The chunks (g0, g1) of groups, each with its kernel spectra (``_kernel_bins``) when the kernel rows are one
    chunk (then its sample chunks share them), else None (each row chunk transforms its own rows)."""
    a = p.group_channels[0]
    for g0, g1 in chunk_ranges(p.spec.groups, p.chunks[0]):
        yield g0, g1, _kernel_bins(p, kernel, g0, g1, 0, a, reverse, real) if p.row_chunk >= a > 0 else None


def _y_from_x(p: FftPlan, x: torch.Tensor, w: torch.Tensor, real: bool) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    a, b0, b = p.group_channels
    kernel = _kernel(p, w)  # (C_y, B, *Q), or w when sliced
    out = _Output(spec.y_shape, _several(p), x, w)
    row_ranges = chunk_ranges(a, p.row_chunk)
    sample_ranges = chunk_ranges(spec.batch, p.chunks[1])
    for g0, g1, whole in _group_chunks(p, kernel, True, real):
        if whole is not None and len(sample_ranges) > 1 and b == 1:  # W(-f) of real data is a lazy conj, which
            whole = whole.resolve_conj()  # the broadcast product resolves per sample chunk (SincNet: 8 copies, not 1)
        for n0, n1 in sample_ranges:
            part = sliced(x, [slice(n0, n1), slice(g0 * b0, g1 * b0)], 0)  # (n', g'*B0, *i)
            xf = tf.forward_transform(tf.to_phases(part, dims, spec.stride), sizes)  # (n', g'*B, *bins)
            bins = xf.shape[2:]
            xf = xf.reshape(n1 - n0, g1 - g0, b, -1)  # (n', g', B, F)
            if whole is None and b > 1:  # laid out (g', F, n', B) once: the per-bin matmul of every row chunk reads it
                xf = xf.permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)  # (n', g', B, F)
            for r0, r1 in row_ranges:
                wf = _kernel_bins(p, kernel, g0, g1, r0, r1, True, real) if whole is None else whole
                yf = tf.y_bins(xf, wf).reshape(n1 - n0, (g1 - g0) * (r1 - r0), *bins)  # (n', g'*r', *bins)
                part = tf.first_rows(tf.inverse_transform(yf, sizes, real), spec.y_size)  # (n', g'*r', *o)
                out.put(n0, n1, g0 * a + r0, g1 * a - (a - r1), part)  # rows < A only with one group per chunk
    return out.tensor  # (N, C_y, *o)


def _x_term(p: FftPlan, y: torch.Tensor, kernel: torch.Tensor, whole: torch.Tensor | None,
            at: tuple[int, int, int, int, int, int], real: bool) -> torch.Tensor:
    """One slice's term of x's spectra, sum_a Y[n, a] W[a, b] over kernel rows r0:r1 of groups g0:g1, samples n0:n1
    (``at``): (n', g', B, F). Only the slice's rows of y are transformed, and its spectra die with the call: a sliced
    plan holds one slice of y's and of the kernel's spectra at a time (issue 28's memory target)."""
    n0, n1, g0, g1, r0, r1 = at
    a = p.group_channels[0]
    part = sliced(y, [slice(n0, n1), slice(g0 * a + r0, g1 * a - (a - r1))], 0)  # (n', g'*r', *o)
    yf = tf.forward_transform(part, p.sizes).reshape(n1 - n0, g1 - g0, r1 - r0, -1)  # (n', g', r', F)
    wf = _kernel_bins(p, kernel, g0, g1, r0, r1, False, real) if whole is None else whole  # (g', r', B, F)
    return tf.x_bins(yf, wf)  # (n', g', B, F)


def _x_from_y(p: FftPlan, y: torch.Tensor, w: torch.Tensor, real: bool) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    a, b0, b = p.group_channels
    kernel = _kernel(p, w)  # (C_y, B, *Q), or w when sliced
    out = _Output(spec.x_shape, _several(p), y, w)
    for g0, g1, whole in _group_chunks(p, kernel, False, real):
        for n0, n1 in chunk_ranges(spec.batch, p.chunks[1]):
            xf: torch.Tensor | None = None
            for r0, r1 in chunk_ranges(a, p.row_chunk):  # X[n, b] = sum over the row chunks of sum_a Y[n, a] W[a, b]
                term = _x_term(p, y, kernel, whole, (n0, n1, g0, g1, r0, r1), real)  # (n', g', B, F)
                xf = term if xf is None else xf + term
                del term  # not held while the next slice's spectra are made
            xs = tf.inverse_transform(xf.reshape(n1 - n0, (g1 - g0) * b, *p.bins(real)), sizes, real)  # type: ignore[union-attr]  # (n', g'*B, *L)
            out.put(n0, n1, g0 * b0, g1 * b0, tf.from_phases(xs, dims, spec.stride, (g1 - g0) * b0))  # (n', g'*B0, *i)
    return out.tensor  # (N, C_x, *i)


def _x_bins(p: FftPlan, x: torch.Tensor, n0: int, n1: int, g0: int, g1: int) -> torch.Tensor:
    """The spectra of x's live phases, samples n0:n1 of groups g0:g1: (n', g', B, F)."""
    part = sliced(x, [slice(n0, n1), slice(g0 * p.group_channels[1], g1 * p.group_channels[1])], 0)  # (n', g'*B0, *i)
    xf = tf.forward_transform(tf.to_phases(part, p.dims, p.spec.stride), p.sizes)  # (n', g'*B, *bins)
    return xf.reshape(n1 - n0, g1 - g0, p.group_channels[2], -1)  # (n', g', B, F)


def _w_term(p: FftPlan, x: torch.Tensor, y: torch.Tensor, whole: torch.Tensor | None,
            at: tuple[int, int, int, int, int, int], real: bool) -> torch.Tensor:
    """One sample chunk's term of the weight's spectra, sum_n ~Y[n, a] X[n, b] over samples n0:n1 of kernel rows
    r0:r1 of groups g0:g1 (``at``): (g', r', B, F). x's (unless ``whole``) and y's spectra die with the call."""
    n0, n1, g0, g1, r0, r1 = at
    a = p.group_channels[0]
    xf = _x_bins(p, x, n0, n1, g0, g1) if whole is None else whole  # (n', g', B, F)
    part = sliced(y, [slice(n0, n1), slice(g0 * a + r0, g1 * a - (a - r1))], 0)  # (n', g'*r', *o)
    yf = tf.reversed_spectrum(tf.forward_transform(part, p.sizes), p.spec.n, real)  # (n', g'*r', *bins)
    return tf.w_bins(xf, yf.reshape(n1 - n0, g1 - g0, r1 - r0, -1))  # (g', r', B, F)


def _w_from_xy(p: FftPlan, x: torch.Tensor, y: torch.Tensor, real: bool) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    a, b0, b = p.group_channels
    q = tuple(d.taps for d in dims)
    parts = []
    sample_ranges = chunk_ranges(spec.batch, p.chunks[1])
    for g0, g1 in chunk_ranges(spec.groups, p.chunks[0]):
        # one sample chunk: x's spectra, shared by every row chunk; else per row chunk
        whole = _x_bins(p, x, 0, spec.batch, g0, g1) if len(sample_ranges) == 1 else None
        row_ranges = chunk_ranges(a, p.row_chunk)
        if whole is not None and len(row_ranges) > 1 and b > 1:  # laid out (g', F, n, B) once for every row chunk
            whole = whole.permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)  # (n, g', B, F)
        for r0, r1 in row_ranges:
            acc: torch.Tensor | None = None
            for n0, n1 in sample_ranges:
                term = _w_term(p, x, y, whole, (n0, n1, g0, g1, r0, r1), real)  # (g', r', B, F)
                acc = term if acc is None else acc + term
                del term  # not held while the next sample chunk's spectra are made
            wf = acc.reshape((g1 - g0) * (r1 - r0), b, *p.bins(real))  # type: ignore[union-attr]  # (g'*r', B, *bins)
            parts.append(tf.first_rows(tf.inverse_transform(wf, sizes, real), q).contiguous())  # (g'*r', B, *Q)
    wp = torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # (C_y, B, *Q)
    return tf.read_taps(wp, dims, b0)  # (C_y, C_x/g, *k)
