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
from convgrad.errors import ConvgradValueError
from convgrad.spec.chunks import chunk_ranges
from convgrad.tensor_ops import batched_like, sliced

__all__ = ["execute", "execute_backward", "shares_spectra"]

Shape = tuple[int, ...]


def execute(p: FftPlan, data: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Run a plan chunk by chunk: the result of ``p.kind`` (y from x, x from y, or w from x and y).

    Args:
        p: the plan, ``plan(spec, gradient)``.
        data: x ``spec.x_shape`` ``(N, C_x, *i)`` for y_from_x and w_from_xy, y ``spec.y_shape`` ``(N, C_y, *o)``
            for x_from_y; real or complex floating (half precision is computed in float32).
        other: the weight ``spec.weight_shape`` ``(C_y, C_x/g, *k)`` for y_from_x and x_from_y (conjugated by a
            gradient's caller: torch's complex convention), y ``spec.y_shape`` for w_from_xy; ``data``'s dtype.

    Returns:
        y_from_x: ``spec.y_shape``; x_from_y: ``spec.x_shape``; w_from_xy: ``spec.weight_shape``; in ``data``'s
        dtype.

    Raises:
        ValueError: ``data`` or ``other`` not of the plan's shape.

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> x, w = torch.randn(2, 4, 30, dtype=torch.float64), torch.randn(4, 1, 9, dtype=torch.float64)
        >>> spec = ConvSpec.from_shapes(x.shape, w.shape, stride=2, padding=4, groups=4)
        >>> y = execute(plan(spec, "output"), x, w)
        >>> y.shape, bool(torch.allclose(y, torch.nn.functional.conv1d(x, w, stride=2, padding=4, groups=4)))
        (torch.Size([2, 4, 15]), True)

    Source: the convolution theorem, per bin and group (the package docstring's contractions; the docs' "Derivation"
    page, "The convolution theorem").
    """
    spec = p.spec
    _check_shapes("execute", p, {"data": (data, spec.y_shape if p.kind == "x_from_y" else spec.x_shape),
                                 "other": (other, spec.y_shape if p.kind == "w_from_xy" else spec.weight_shape)})
    dtype = data.dtype
    if spec.batch == 0:  # nothing to transform: an empty result, or grad_weight's empty sum
        shapes = {"y_from_x": spec.y_shape, "x_from_y": spec.x_shape, "w_from_xy": spec.weight_shape}
        return data.new_zeros(shapes[p.kind])
    if dtype in (torch.float16, torch.bfloat16):
        data, other = data.float(), other.float()
    run = {"y_from_x": _y_from_x, "x_from_y": _x_from_y, "w_from_xy": _w_from_xy}[p.kind]
    return run(p, data, other, not (data.is_complex() or other.is_complex())).to(dtype)


def _check_shapes(fn: str, p: FftPlan, tensors: dict[str, tuple[torch.Tensor, Shape]]) -> None:
    """Each tensor has the shape the plan reads (name: (tensor, shape)): another would fail deep in a reshape."""
    for name, (t, shape) in tensors.items():
        if tuple(t.shape) != shape:
            raise ConvgradValueError(f"fft.{fn}: {name}.shape={tuple(t.shape)} does not match {shape}, its shape in "
                                     f"{p.spec.describe()}")


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


def _group_chunks(p: FftPlan, kernel: torch.Tensor, reverse: bool, real: bool, samples: int = 1
                  ) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """The chunks (g0, g1) of groups, each with its kernel spectra (``_kernel_bins``) when the kernel rows are one
    chunk (then its ``samples`` sample chunks share them), else None (each row chunk transforms its own rows)."""
    a, _, b = p.group_channels
    for g0, g1 in chunk_ranges(p.spec.groups, p.chunks[0]):
        whole = _kernel_bins(p, kernel, g0, g1, 0, a, reverse, real) if p.row_chunk >= a > 0 else None
        if whole is not None and reverse and samples > 1 and b == 1:  # W(-f) of real data is a lazy conj, which
            whole = whole.resolve_conj()  # the broadcast product resolves per sample chunk (SincNet: 8 copies, not 1)
        yield g0, g1, whole


def _y_from_x(p: FftPlan, x: torch.Tensor, w: torch.Tensor, real: bool) -> torch.Tensor:
    spec, dims, sizes = p.spec, p.dims, p.sizes
    a, b0, b = p.group_channels
    kernel = _kernel(p, w)  # (C_y, B, *Q), or w when sliced
    out = _Output(spec.y_shape, _several(p), x, w)
    row_ranges = chunk_ranges(a, p.row_chunk)
    sample_ranges = chunk_ranges(spec.batch, p.chunks[1])
    cuts = p.cuts_to(spec.y_size)  # the inverse keeps the first o rows
    for g0, g1, whole in _group_chunks(p, kernel, True, real, len(sample_ranges)):
        for n0, n1 in sample_ranges:
            part = sliced(x, [slice(n0, n1), slice(g0 * b0, g1 * b0)], 0)  # (n', g'*B0, *i)
            xf = tf.forward_transform(tf.to_phases(part, dims, spec.stride), sizes, p.phase_zeros)  # (n', g'*B, *bins)
            bins = xf.shape[2:]
            xf = xf.reshape(n1 - n0, g1 - g0, b, -1)  # (n', g', B, F)
            if whole is None and b > 1:  # laid out (g', F, n', B) once: the per-bin matmul of every row chunk reads it
                xf = xf.permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)  # (n', g', B, F)
            for r0, r1 in row_ranges:
                wf = _kernel_bins(p, kernel, g0, g1, r0, r1, True, real) if whole is None else whole
                yf = tf.y_bins(xf, wf).reshape(n1 - n0, (g1 - g0) * (r1 - r0), *bins)  # (n', g'*r', *bins)
                part = tf.inverse_transform(yf, sizes, real, cuts)  # (n', g'*r', *o)
                out.put(n0, n1, g0 * a + r0, g1 * a - (a - r1), part)  # rows < A only with one group per chunk
    return out.tensor  # (N, C_y, *o)


def _y_spectra(p: FftPlan, y: torch.Tensor, n0: int, n1: int, g0: int, g1: int, r0: int, r1: int) -> torch.Tensor:
    """The spectra of y's rows r0:r1 of groups g0:g1, samples n0:n1: (n', g'*r', *bins)."""
    a = p.group_channels[0]
    part = sliced(y, [slice(n0, n1), slice(g0 * a + r0, g1 * a - (a - r1))], 0)  # (n', g'*r', *o)
    return tf.forward_transform(part, p.sizes)  # (n', g'*r', *bins)


def _x_term(p: FftPlan, y: torch.Tensor, kernel: torch.Tensor, whole: torch.Tensor | None,
            at: tuple[int, int, int, int, int, int], real: bool) -> torch.Tensor:
    """One slice's term of x's spectra, sum_a Y[n, a] W[a, b] over kernel rows r0:r1 of groups g0:g1, samples n0:n1
    (``at``): (n', g', B, F). Only the slice's rows of y are transformed, and its spectra die with the call: a sliced
    plan holds one slice of y's and of the kernel's spectra at a time (issue 28's memory target)."""
    n0, n1, g0, g1, r0, r1 = at
    yf = _y_spectra(p, y, n0, n1, g0, g1, r0, r1).reshape(n1 - n0, g1 - g0, r1 - r0, -1)  # (n', g', r', F)
    wf = _kernel_bins(p, kernel, g0, g1, r0, r1, False, real) if whole is None else whole  # (g', r', B, F)
    return tf.x_bins(yf, wf)  # (n', g', B, F)


def _x_side(p: FftPlan, xf: torch.Tensor, real: bool) -> torch.Tensor:
    """x's spectra (n', g', B, F) -> x (n', g'*B0, *i): the inverse transform, the phases interleaved and cropped."""
    n, g = xf.shape[:2]
    _, b0, b = p.group_channels
    xs = tf.inverse_transform(xf.reshape(n, g * b, *p.bins(real)), p.sizes, real, p.phase_zeros)  # (n', g'*B, *M)
    return tf.from_phases(xs, p.dims, p.spec.stride, g * b0)  # (n', g'*B0, *i)


def _x_from_y(p: FftPlan, y: torch.Tensor, w: torch.Tensor, real: bool) -> torch.Tensor:
    spec, (a, b0, _) = p.spec, p.group_channels
    kernel = _kernel(p, w)  # (C_y, B, *Q), or w when sliced
    out = _Output(spec.x_shape, _several(p), y, w)
    for g0, g1, whole in _group_chunks(p, kernel, False, real):
        for n0, n1 in chunk_ranges(spec.batch, p.chunks[1]):
            xf: torch.Tensor | None = None
            for r0, r1 in chunk_ranges(a, p.row_chunk):  # X[n, b] = sum over the row chunks of sum_a Y[n, a] W[a, b]
                term = _x_term(p, y, kernel, whole, (n0, n1, g0, g1, r0, r1), real)  # (n', g', B, F)
                xf = term if xf is None else xf + term
                del term  # not held while the next slice's spectra are made
            out.put(n0, n1, g0 * b0, g1 * b0, _x_side(p, xf, real))  # type: ignore[arg-type]  # (n', g'*B0, *i)
    return out.tensor  # (N, C_x, *i)


def _x_bins(p: FftPlan, x: torch.Tensor, n0: int, n1: int, g0: int, g1: int) -> torch.Tensor:
    """The spectra of x's live phases, samples n0:n1 of groups g0:g1: (n', g', B, F)."""
    part = sliced(x, [slice(n0, n1), slice(g0 * p.group_channels[1], g1 * p.group_channels[1])], 0)  # (n', g'*B0, *i)
    xf = tf.forward_transform(tf.to_phases(part, p.dims, p.spec.stride), p.sizes, p.phase_zeros)  # (n', g'*B, *bins)
    return xf.reshape(n1 - n0, g1 - g0, p.group_channels[2], -1)  # (n', g', B, F)


def _w_term(p: FftPlan, x: torch.Tensor, y: torch.Tensor, whole: torch.Tensor | None,
            at: tuple[int, int, int, int, int, int], real: bool) -> torch.Tensor:
    """One sample chunk's term of the weight's spectra, sum_n ~Y[n, a] X[n, b] over samples n0:n1 of kernel rows
    r0:r1 of groups g0:g1 (``at``): (g', r', B, F). x's (unless ``whole``) and y's spectra die with the call."""
    n0, n1, g0, g1, r0, r1 = at
    xf = _x_bins(p, x, n0, n1, g0, g1) if whole is None else whole  # (n', g', B, F)
    yf = tf.reversed_spectrum(_y_spectra(p, y, n0, n1, g0, g1, r0, r1), p.spec.n, real)  # (n', g'*r', *bins)
    return tf.w_bins(xf, yf.reshape(n1 - n0, g1 - g0, r1 - r0, -1))  # (g', r', B, F)


def _w_from_xy(p: FftPlan, x: torch.Tensor, y: torch.Tensor, real: bool) -> torch.Tensor:
    spec, (a, _, b) = p.spec, p.group_channels
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
            parts.append(_w_rows(p, acc, real))  # type: ignore[arg-type]  # (g'*r', B, *Q)
    return _w_taps(p, parts)  # (C_y, C_x/g, *k)


def _w_rows(p: FftPlan, wf: torch.Tensor, real: bool) -> torch.Tensor:
    """The weight's spectra (g', r', B, F) -> its rows' phase kernels (g'*r', B, *Q): inverse transform, the first Q
    slots (a compact copy: the crop of the inverse would keep it alive)."""
    g, r = wf.shape[:2]
    wf = wf.reshape(g * r, p.group_channels[2], *p.bins(real))  # (g'*r', B, *bins)
    return tf.inverse_transform(wf, p.sizes, real, p.cuts_to(tuple(d.taps for d in p.dims))).contiguous()


def _w_taps(p: FftPlan, parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows' phase kernels (``_w_rows``), in order -> the weight (C_y, C_x/g, *k): each tap read from its slot."""
    wp = torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # (C_y, B, *Q)
    return tf.read_taps(wp, p.dims, p.group_channels[1])  # (C_y, C_x/g, *k)


# ---- both gradients in one pass: grad_output's spectrum made once per chunk, read by both products ----------------
def shares_spectra(pi: FftPlan, pw: FftPlan) -> bool:
    """Whether grad_input's plan ``pi`` and grad_weight's ``pw`` can run as one pass (``execute_backward``).

    They can with the same sample chunks and transform sizes, and each group's kernel rows one chunk. A dense layer
    sliced by kernel rows (``FftPlan.row_chunk`` < A) cannot: x's spectra summed over the row slices for grad_input,
    the weight's over the sample chunks for grad_weight, one of them would be held whole beside the other's slices.
    The pass runs ``pi``'s chunks: ``pw``'s may hold fewer groups (``chunking.WEIGHT_SCRATCH_RATIO``, for grad_weight
    alone, whose native peak is a scratch), whereas native's backward of both holds grad_input's result too.

    Args:
        pi: grad_input's plan, ``plan(spec, "grad_input")``.
        pw: grad_weight's plan of the same spec, ``plan(spec, "grad_weight")``.

    Returns:
        bool; False for a batch of 0 (nothing to transform).

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> def shared(spec): return shares_spectra(plan(spec, "grad_input"), plan(spec, "grad_weight"))
        >>> depthwise = ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256)
        >>> dense = ConvSpec.from_shapes((2, 64, 28, 28), (64, 64, 31, 31), padding=15)
        >>> shared(depthwise), plan(dense, "grad_input").row_chunk, shared(dense)   # dense: one kernel row a slice
        (True, 1, False)
    """
    a = pi.group_channels[0]
    return (pi.chunks[1] == pw.chunks[1] and pi.sizes == pw.sizes and pi.row_chunk == pw.row_chunk == a > 0
            and pi.spec.batch > 0)


def execute_backward(pi: FftPlan, pw: FftPlan, grad_output: torch.Tensor, input: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_input and grad_weight in one chunked pass, grad_output's spectrum made once per chunk for both.

    Per chunk of groups and samples: a forward conv's grad_output is y, its Y feeds X' = sum_a Y W (grad_input)
    and W' = sum_n ~Y X (grad_weight, ~Y a lazy conj for real data); a transposed conv's is x, its X feeds
    Y = sum_b X ~W (grad_input) and W'.

    Args:
        pi: grad_input's plan, ``plan(spec, "grad_input")``.
        pw: grad_weight's plan of the same spec, ``plan(spec, "grad_weight")``; ``shares_spectra(pi, pw)`` must
            hold.
        grad_output: ``spec.output_shape`` ``(N, C_out, *out)``, real or complex floating (half precision is
            computed in float32).
        input: ``spec.input_shape`` ``(N, C_in, *in)``, conjugated by the caller (torch's complex convention; a
            no-op for real data); grad_output's dtype.
        weight: ``spec.weight_shape`` ``(C_out, C_in/g, *k)`` (transposed: ``(C_in, C_out/g, *k)``), conjugated
            by the caller likewise; grad_output's dtype.

    Returns:
        (grad_input ``spec.input_shape``, grad_weight ``spec.weight_shape``), in grad_output's dtype.

    Raises:
        ValueError: ``pi`` not a grad_input plan, ``pw`` not a grad_weight plan of the same spec, plans that do not
            share their spectra (``shares_spectra``: run each with ``execute``), or a tensor not of the spec's
            shape.

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((2, 4, 30), (4, 1, 9), padding=4, groups=4)
        >>> pi, pw = plan(spec, "grad_input"), plan(spec, "grad_weight")
        >>> gy, x, w = torch.randn(2, 4, 30), torch.randn(2, 4, 30), torch.randn(4, 1, 9)
        >>> gi, gw = execute_backward(pi, pw, gy, x, w)
        >>> ref = torch.ops.aten.convolution_backward(gy, x, w, None, [1], [4], [1], False, [0], 4,
        ...                                           [True, True, False])
        >>> bool(torch.allclose(gi, ref[0], atol=1e-4) and torch.allclose(gw, ref[1], atol=1e-4))
        True

    Source: the package docstring's contractions; the docs' "Derivation" page, "The convolution theorem".
    """
    spec = pi.spec
    if pi.gradient != "grad_input" or pw.gradient != "grad_weight" or pw.spec != spec or not shares_spectra(pi, pw):
        raise ConvgradValueError(f"fft.execute_backward: pi={pi.gradient}'s plan of {spec.describe()} and "
                                 f"pw={pw.gradient}'s plan of {pw.spec.describe()} must be grad_input's and "
                                 "grad_weight's plans of one spec that share their spectra (shares_spectra)")
    _check_shapes("execute_backward", pi, {"grad_output": (grad_output, spec.output_shape),
                                           "input": (input, spec.input_shape), "weight": (weight, spec.weight_shape)})
    dtype = grad_output.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad_output, input, weight = grad_output.float(), input.float(), weight.float()
    real = not (grad_output.is_complex() or input.is_complex() or weight.is_complex())
    run = _both_from_x if pi.kind == "y_from_x" else _both_from_y
    gi, gw = run(pi, pw, grad_output, input, weight, real)
    return gi.to(dtype), gw.to(dtype)


def _both_from_y(pi: FftPlan, pw: FftPlan, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, real: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A forward conv's backward: y = grad_output shared, x = input, w = the weight."""
    spec, (a, b0, _) = pi.spec, pi.group_channels
    kernel = _kernel(pi, w)  # (C_y, B, *Q)
    gi, parts = _Output(spec.x_shape, _several(pi), y, w), []
    for g0, g1, whole in _group_chunks(pi, kernel, False, real):
        acc: torch.Tensor | None = None
        for n0, n1 in chunk_ranges(spec.batch, pi.chunks[1]):
            yf = _y_spectra(pi, y, n0, n1, g0, g1, 0, a)  # (n', g'*A, *bins), the one transform of y
            xf = tf.x_bins(yf.reshape(n1 - n0, g1 - g0, a, -1), whole)  # type: ignore[arg-type]  # (n', g', B, F)
            gi.put(n0, n1, g0 * b0, g1 * b0, _x_side(pi, xf, real))  # (n', g'*B0, *i)
            del xf  # not held while x's spectra are made
            xs = _x_bins(pw, x, n0, n1, g0, g1)  # (n', g', B, F)
            if real:  # sum_n ~Y X = conj(sum_n Y ~X): the conj on x's spectra, A times smaller than y's where B = 1
                yr, xs = yf.reshape(n1 - n0, g1 - g0, a, -1), xs.conj()  # (n', g', A, F)
            else:
                yr = tf.reversed_spectrum(yf, spec.n, real).reshape(n1 - n0, g1 - g0, a, -1)  # (n', g', A, F)
            term = tf.w_bins(xs, yr)  # (g', A, B, F), a fresh tensor: summed into in place
            del yf, yr, xs
            acc = term if acc is None else acc.add_(term)
            del term
        parts.append(_w_rows(pw, acc.conj() if real else acc, real))  # type: ignore[union-attr, arg-type]  # (g'*A, B, *Q)
    return gi.tensor, _w_taps(pw, parts)  # (N, C_x, *i), (C_y, C_x/g, *k)


def _both_from_x(pi: FftPlan, pw: FftPlan, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor, real: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A transposed conv's backward: x = grad_output shared, y = input, w = the weight."""
    spec, a = pi.spec, pi.group_channels[0]
    kernel = _kernel(pi, w)  # (C_y, B, *Q)
    gi, parts = _Output(spec.y_shape, _several(pi), x, w), []
    sample_ranges = chunk_ranges(spec.batch, pi.chunks[1])
    for g0, g1, whole in _group_chunks(pi, kernel, True, real, len(sample_ranges)):
        acc: torch.Tensor | None = None
        for n0, n1 in sample_ranges:
            xf = _x_bins(pi, x, n0, n1, g0, g1)  # (n', g', B, F), the one transform of x
            yf = tf.y_bins(xf, whole).reshape(n1 - n0, (g1 - g0) * a, *pi.bins(real))  # type: ignore[arg-type]  # (n', g'*A, *bins)
            gi.put(n0, n1, g0 * a, g1 * a, tf.inverse_transform(yf, pi.sizes, real, pi.cuts_to(spec.y_size)))
            del yf  # not held while y's spectra are made
            term = _w_term(pw, x, y, xf, (n0, n1, g0, g1, 0, a), real)  # (g', A, B, F)
            del xf
            acc = term if acc is None else acc + term
            del term
        parts.append(_w_rows(pw, acc, real))  # type: ignore[arg-type]  # (g'*A, B, *Q)
    return gi.tensor, _w_taps(pw, parts)  # (N, C_y, *o), (C_y, C_x/g, *k)
