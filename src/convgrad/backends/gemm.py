"""The gemm backend: im2col (an N-d unfold) and batched matrix products, the Caffe / THNN way.

Contractions, per group g (forward geometry of spec/geometry.py; x: big side, y: small side;
A = C_y/g, B = (C_x/g)*T with T = prod(k) taps, M = N*P with P = prod(o) positions):
    columns     x_pad [N, C_x, *x_read] -> cols [g, B, M]   (dilated windows, stride s; a copy)
    grad of w   y [g, A, M] x cols^T [g, M, B]     -> [g, A, B] = (C_y, C_x/g, *k)
    grad of x   w^T [g, B, A] x y [g, A, M]        -> [g, B, M], then fold (col2im) into x
    grad of y   w [g, A, B] x cols [g, B, M]       -> [g, A, M]  (transposed convs: y is their input)
Groups are the batch dim of torch.bmm, so there is no Python loop over groups.

The fold (col2im) adds the columns of each of the T kernel taps into a strided slice
of the padded x (``ConvSpec.tap_window``), one slice-add per tap. Measured against one
``index_add_`` over a precomputed flat index (1 thread, float32, one chunk): 0.68 vs
1.47 ms (ResNet 3x3, C=64, 56x56, 1 sample), 2.5 vs 5.6 ms (4 samples), 4.4 vs 8.0 ms
(3d, C=32, 16x28x28), but 0.28 vs 0.14 ms for a strided 3x3 (C=128, 28x28, stride 2),
where the fold is a small part of the backward. The slice-adds are what runs.

With C_y/g = 1 (depthwise), grad_x's GEMM has inner size 1: it is an outer product, and its
columns are a T-fold copy of y that the fold reads once. There the fold adds w[tap] * y into
each tap's slice directly (``addcmul_``). Measured with ``convgrad bench --backends gemm``,
grad_input of MobileNetV2's depthwise 3x3 went from 3.3-3.8x native to 1.1-1.2x in float32, and
from 2.1x to 0.6x in float64.

Workspace and chunks. The columns of the whole batch hold ``N * C_x * T * P``
elements. They are built chunk by chunk, over samples and, when one sample is too
big, over blocks of channels within each group (B splits into blocks of whole
channels: grad_weight is assembled block by block, grad_x folds block by block).
Two sizes bound a chunk's columns:

* ``max_workspace_bytes`` (default 256 MiB), the user's memory cap. Set it on the
  registered instance, ``convgrad.backends.get_backend("gemm").max_workspace_bytes
  = 64 * 2**20``, or on ``GemmBackend`` for every instance. The smallest chunk
  is one channel per group of one sample (``g * T * P`` elements); a cap below that
  is exceeded by that much.
* ``CHUNK_TARGET_BYTES`` (4 MiB), a speed setting: a fresh buffer of more than
  32 MiB is mmap-ed by glibc and page-faulted on every call, which cost more than
  the GEMM itself in measurements here; chunks of a few MiB reuse heap memory and
  stay in the L3 cache.

Half precision. float16 and bfloat16 sum in float32 and round once, as native's kernels do: the fold adds the
T taps into a float32 buffer, and the chunks' grad_weight (and a transposed conv's channel blocks' grad_input) add
up in float32. Each tap's term had been added into a half-precision buffer, rounding the sum T times: bfloat16
grad_input erred 3.4x native's on a 3x3 layer and 25x on a 31x31 depthwise one (issue 40, item 3;
``tests/test_numerics.py`` bounds every backend at twice native's error).

Every op is differentiable (pad, unfold, permute, bmm, slice-add), so second
derivatives come from autograd.
"""

from __future__ import annotations

import itertools

import torch

from convgrad.backends import FusedBackend, Grads, register
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import CHUNK_BYTES, equal_chunk
from convgrad.tensor_ops import accumulation_dtype, add_product_, batched_like, crop, pad, plain, sliced, windows

__all__ = ["CHUNK_TARGET_BYTES", "DEFAULT_MAX_WORKSPACE_BYTES", "GemmBackend", "chunking"]

DEFAULT_MAX_WORKSPACE_BYTES = 256 * 2**20
CHUNK_TARGET_BYTES = CHUNK_BYTES  # the speed target (module docstring)


def chunking(spec: ConvSpec, itemsize: int, max_workspace_bytes: int) -> tuple[int, int]:
    """How the gemm backend splits a backward: (samples, channels per group) of one chunk.

    Whole samples while one sample's columns fit; otherwise one sample and as many whole
    channels (per group) as fit. Never less than one channel of one sample.

    Args:
        spec: the convolution.
        itemsize: bytes per element of the dtype (4 for float32).
        max_workspace_bytes: the cap on one chunk's columns; the speed target
            ``CHUNK_TARGET_BYTES`` applies too, whichever is smaller.

    Returns:
        ``(samples, channels)`` with ``1 <= samples <= max(N, 1)`` and ``1 <= channels <= C_x/groups``.

    Source: the module docstring ("Workspace and chunks").

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((8, 64, 56, 56), (64, 64, 3, 3), padding=1)
        >>> chunking(spec, 4, 256 * 2**20)   # a sample's columns, 64*9*3136*4 B = 6.9 MiB, exceed 4 MiB
        (1, 32)
        >>> chunking(spec, 4, 2**20)         # 1 MiB cap, 9*3136*4 B = 110 KiB per channel: 8 blocks of 8
        (1, 8)
    """
    limit = min(max_workspace_bytes, CHUNK_TARGET_BYTES)
    per_channel = spec.groups * spec.taps * spec.positions * itemsize
    channels, batch = spec.x_group_channels, max(spec.batch, 1)
    samples = limit // (per_channel * channels)
    if samples >= 1:
        return equal_chunk(batch, samples), channels
    return 1, equal_chunk(channels, max(1, limit // per_channel))


def _windows(spec: ConvSpec, x: torch.Tensor) -> torch.Tensor:
    """The dilated windows of x (Nc, C_x, *i) as a view (g, C_x/g, *k, Nc, *o); no copy yet."""
    n, g = spec.n, spec.groups
    xr = windows(pad(x, spec.x_read_pads), spec.kernel_size, spec.stride, spec.dilation)  # (Nc, C_x, *o, *k)
    xr = xr.view(xr.shape[0], g, spec.x_group_channels, *xr.shape[2:])  # (Nc, g, C_x/g, *o, *k)
    return xr.permute(1, 2, *range(3 + n, 3 + 2 * n), 0, *range(3, 3 + n))  # (g, C_x/g, *k, Nc, *o)


def _columns(spec: ConvSpec, win: torch.Tensor, block: slice) -> torch.Tensor:
    """im2col of one channel block: windows (g, C_x/g, *k, Nc, *o) -> (g, Cb*T, Nc*P), a copy."""
    return sliced(win, [block], 1).reshape(spec.groups, -1, win.shape[2 + spec.n] * spec.positions)  # (g, Cb*T, Nc*P)


def _fold_into(spec: ConvSpec, xr: torch.Tensor, cols: torch.Tensor, block: slice) -> None:
    """col2im of one channel block: add cols (g, Cb*T, Nc*P) into xr[:, block], xr (g, C_x/g, Nc, *x_read), which
    may be of a wider dtype (``accumulation_dtype``)."""
    k, o = spec.kernel_size, spec.y_size
    dst = sliced(xr, [block], 1)  # (g, Cb, Nc, *x_read_size)
    cols = cols.view(*dst.shape[:2], *k, dst.shape[2], *o)  # (g, Cb, *k, Nc, *o)
    for tap in itertools.product(*(range(kj) for kj in k)):
        dst[(..., *spec.tap_window(tap))] += cols[(slice(None), slice(None), *tap)]  # (g, Cb, Nc, *o)


def _fold_outer(spec: ConvSpec, xr: torch.Tensor, wcols: torch.Tensor, ymat: torch.Tensor, block: slice) -> None:
    """col2im of an outer product, without its columns: with C_y/g = 1 (depthwise), grad_x's GEMM has inner size 1,
    w^T [g, Cb*T, 1] x y [g, 1, Nc*P]. Each tap adds w[tap] * y into its window of xr (g, C_x/g, Nc, *x_read) directly;
    the columns would be written once and read once more (measurements: the module docstring). xr may be of a
    wider dtype (``accumulation_dtype``)."""
    k, o = spec.kernel_size, spec.y_size
    dst = sliced(xr, [block], 1)  # (g, Cb, Nc, *x_read_size)
    y = ymat.view(spec.groups, 1, dst.shape[2], *o)  # (g, 1, Nc, *o)
    w = wcols.reshape(spec.groups, dst.shape[1], *k)  # (g, Cb, *k)
    fused = plain(y) and plain(w)
    for tap in itertools.product(*(range(kj) for kj in k)):
        scale = w[(slice(None), slice(None), *tap)].view(*w.shape[:2], *(1,) * (1 + spec.n))  # (g, Cb, 1, ..)
        add_product_(dst[(..., *spec.tap_window(tap))], y, scale, fused)  # (g, Cb, Nc, *o) += (g, 1, Nc, *o) * ..


def _x_tensor(spec: ConvSpec, xr: torch.Tensor) -> torch.Tensor:
    """(g, C_x/g, Nc, *x_read_size) -> x (Nc, C_x, *i): crop the padding, zero the rows no output read."""
    xr = xr.reshape(-1, *xr.shape[2:]).transpose(0, 1)  # (Nc, C_x, *x_read_size)
    return crop(xr, spec.x_read_pads)  # (Nc, C_x, *i)


def _y_matrix(spec: ConvSpec, y: torch.Tensor) -> torch.Tensor:
    """y (Nc, C_y, *o) -> (g, C_y/g, Nc * P)."""
    g = spec.groups
    y = y.reshape(y.shape[0], g, spec.y_group_channels, -1)  # (Nc, g, C_y/g, P)
    return y.permute(1, 2, 0, 3).reshape(g, spec.y_group_channels, -1)  # (g, C_y/g, Nc*P)


def _y_tensor(spec: ConvSpec, ymat: torch.Tensor, nc: int) -> torch.Tensor:
    """(g, C_y/g, Nc * P) -> y (Nc, C_y, *o); the inverse of ``_y_matrix``."""
    y = ymat.reshape(spec.y_channels, nc, *spec.y_size)  # (C_y, Nc, *o)
    return y.transpose(0, 1)  # (Nc, C_y, *o)


def _add(acc: torch.Tensor | None, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """acc + t in ``dtype`` (the accumulator's, ``accumulation_dtype``: a running half-precision sum rounds at each
    term)."""
    t = t.to(dtype)
    return t if acc is None else acc + t


@register
class GemmBackend(FusedBackend):
    """im2col + batched GEMM + col2im, chunked so that the column buffer stays under max_workspace_bytes.

    Attributes:
        max_workspace_bytes: cap on the columns of one chunk, in bytes (default 256 MiB); set it on
            the registered instance or on the class (module docstring, "Workspace and chunks").

    Examples:
        >>> import torch, convgrad as cg
        >>> backend = cg.backends.get_backend("gemm")
        >>> backend.max_workspace_bytes = 2**20   # 1 MiB of columns at a time
        >>> x, w = torch.randn(4, 8, 32, 32), torch.randn(16, 8, 3, 3)
        >>> gy = torch.randn(4, 16, 32, 32)
        >>> gi, gw, _ = cg.conv_backward(gy, x, w, padding=1, backend="gemm")
        >>> del backend.max_workspace_bytes      # back to the class default, 256 MiB
        >>> ref = cg.conv_backward(gy, x, w, padding=1, backend="native")
        >>> torch.allclose(gi, ref[0], atol=1e-4), torch.allclose(gw, ref[1], atol=1e-3)
        (True, True)
    """

    name = "gemm"
    bench_by_default = True
    max_workspace_bytes: int = DEFAULT_MAX_WORKSPACE_BYTES

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        like = grad_output
        if spec.batch == 0:
            return (like.new_zeros(spec.input_shape) if need_input else None,
                    like.new_zeros(spec.weight_shape) if need_weight else None)
        samples, channels = chunking(spec, like.element_size(), self.max_workspace_bytes)
        cg, taps = spec.x_group_channels, spec.taps
        blocks = [slice(c, min(c + channels, cg)) for c in range(0, cg, channels)]
        # (g, C_y/g, C_x/g*T), and its column ranges per channel block
        wmat = None if weight is None else weight.reshape(spec.groups, spec.y_group_channels, -1)
        wcols = [slice(b.start * taps, b.stop * taps) for b in blocks]
        starts = range(0, spec.batch, samples)
        # several chunks write their part of grad_input into one tensor (a fresh big buffer per call is costly)
        gi = batched_like(like.new_empty(spec.input_shape), weight) if need_input and len(starts) > 1 else None
        gws: list[torch.Tensor | None] = [None] * len(blocks)
        acc = accumulation_dtype(like.dtype)
        run = self._transposed_chunk if spec.transposed else self._chunk
        for start in starts:
            part = slice(start, start + samples)
            gi_part, gw_parts = run(spec, grad_output[part], None if input is None else input[part], wmat, blocks,
                                    wcols, need_input, need_weight)
            if gi_part is not None and gi is None:
                gi = gi_part.contiguous()
            elif gi_part is not None:
                gi[part] = gi_part
            for j, gw_part in enumerate(gw_parts):  # the sample chunks' sum, in float32 for half precision
                gws[j] = _add(gws[j], gw_part, acc if len(starts) > 1 else gw_part.dtype)
        if not need_weight:
            return gi, None
        gw = gws[0] if len(gws) == 1 else torch.cat(gws, dim=2)  # type: ignore[arg-type]  # (g, C_y/g, C_x/g*T)
        return gi, gw.reshape(spec.weight_shape).to(like.dtype)  # type: ignore[union-attr]  # (C_y, C_x/g, *k)

    @staticmethod
    def _chunk(spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None, wmat: torch.Tensor | None,
               blocks: list[slice], wcols: list[slice], need_input: bool, need_weight: bool
               ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Forward conv, x = input, y = grad_output: grad_x by fold, grad_weight per channel block."""
        ymat = _y_matrix(spec, grad_output)  # (g, A, Nc*P)
        win = _windows(spec, input) if need_weight else None  # type: ignore[arg-type]
        xr_shape = (spec.groups, spec.x_group_channels, grad_output.shape[0], *spec.x_read_size)
        # a 1x1 kernel with stride 1 reads every position once: the fold is the identity
        identity = len(blocks) == 1 and spec.taps == 1 and spec.x_read_size == spec.y_size
        # the fold's sum over taps, in float32 for half precision (rounded once, by _x_tensor's caller)
        acc = accumulation_dtype(grad_output.dtype)
        xr = batched_like(grad_output.new_zeros(xr_shape, dtype=acc), wmat) if need_input and not identity else None
        gws = []
        for block, wc in zip(blocks, wcols):
            if need_weight:
                gws.append(torch.bmm(ymat, _columns(spec, win, block).transpose(1, 2)))  # (g, A, Cb*T)
            if need_input and ymat.shape[1] == 1 and not identity:
                _fold_outer(spec, xr, wmat[:, 0, wc], ymat, block)  # type: ignore[arg-type, index]
            elif need_input:
                dcols = torch.bmm(wmat[:, :, wc].transpose(1, 2), ymat)  # type: ignore[index]  # (g, Cb*T, Nc*P)
                if identity:
                    xr = dcols.view(xr_shape)  # (g, C_x/g, Nc, *x_read_size)
                else:
                    _fold_into(spec, xr, dcols, block)  # type: ignore[arg-type]
        return (None if xr is None else _x_tensor(spec, xr).to(grad_output.dtype)), gws

    @staticmethod
    def _transposed_chunk(spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                          wmat: torch.Tensor | None, blocks: list[slice], wcols: list[slice], need_input: bool,
                          need_weight: bool) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """Transposed conv, x = grad_output, y = input: both gradients read the columns of grad_output."""
        win = _windows(spec, grad_output)
        ymat = _y_matrix(spec, input) if need_weight else None  # type: ignore[arg-type]  # (g, A, Nc*P)
        gi, gws = None, []
        # the channel blocks' sum of grad_y, in float32 for half precision
        acc = accumulation_dtype(grad_output.dtype) if len(blocks) > 1 else grad_output.dtype
        for block, wc in zip(blocks, wcols):
            cols = _columns(spec, win, block)  # (g, Cb*T, Nc*P)
            if need_weight:
                gws.append(torch.bmm(ymat, cols.transpose(1, 2)))  # type: ignore[arg-type]  # (g, A, Cb*T)
            if need_input:
                gi = _add(gi, torch.bmm(wmat[:, :, wc], cols), acc)  # type: ignore[index]  # (g, A, Nc*P)
        if gi is None:
            return None, gws
        return _y_tensor(spec, gi, grad_output.shape[0]).to(grad_output.dtype), gws
