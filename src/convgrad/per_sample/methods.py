"""The three ways to compute one layer's per-sample weight gradients or their norms, and the cost model.

Contractions, per sample n and group g (x: big side, y: small side, in the forward
geometry of ConvSpec; P = prod(o) positions of y, T = prod(k) taps, U = im2col(x)):
    "unfold"  gw[n] [C_y/g, C_x/g·T] = y[n] [C_y/g, P] · U[n]ᵀ [P, C_x/g·T]      one batched GEMM per chunk
    "conv"    gw    [C_x/g, N·C_y, T] = x [C_x/g, N·g, x] ⋆ y [N·C_y, 1, P]       groups = N·g, stride d, dilation s
    "ghost"   |gw[n]|² = Σ_g ⟨y[n]ᵀy[n], U[n]ᵀU[n]⟩ over [P, P] Gram matrices   norms only, never gw itself
    "native"  gw [N·C_y, C_x/g, T] = aten weight gradient of the batch folded into the groups (N·g), one call
    "fft"     gw[n] [C_y/g, C_x/g, T] = crop(IFFT(conj(FFT y[n]) · FFT x[n])): an outer product per sample and
              frequency bin, no im2col of T columns, no sum over the batch (``convgrad.backends.fft.per_sample``);
              its norms reduce each chunk as it comes. Large kernels only: the cost model considers it from
              ``fft.MIN_TAPS`` taps
A forward conv has x = input, y = grad_output; a transposed conv the reverse. Only
the diagonal (same-group) blocks are ever formed: U is laid out per group, so the
GEMM never multiplies channels of one group with those of another.

Temporaries are bounded by processing the batch in chunks (``layer_chunks``): at most
``CHUNK_ELEMENTS`` elements and at most the layer's own input and grad_output; the
native kernel's copies at most twice those.

"native" runs PyTorch's own weight-gradient kernel (oneDNN on the CPU, cuDNN on CUDA) once per chunk, on the batch
folded into the groups (``ConvSpec.with_batch_in_groups``: the input as (1, N·C_x, *i), grad_output as (1, N·C_y,
*o), groups N·g), with no im2col copy: sample n's gradient is group block n (copied into place where the batch takes
more than one chunk). This is how torch.func's vmap computes a convolution's per-sample gradients. On the CPU wheel
(MKL) that kernel runs near PyTorch's one summed weight gradient and beats "unfold" where a sample has many
positions, but not with few, which the cost model's ``NATIVE_POSITIONS`` prices in
(``convgrad.per_sample.tuning.estimates``); benchmarks/results/per_sample_methods.md has the figures
(``benchmarks/per_sample_methods.py``).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import sys
from collections.abc import Iterator

import torch

from convgrad.backends import get_backend
from convgrad.backends.fft import per_sample as fft
from convgrad.backends.fwdconv import execute, plan_per_sample_weight_grad
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import pad, plain, windows

__all__ = [
    "CHUNK_ELEMENTS",
    "MIN_TILE",
    "NATIVE_POSITIONS",
    "choose_method",
    "ghost_sq_norms",
    "im2col",
    "layer_chunks",
    "materialised_sq_norms",
    "norm_dtype",
    "one_layer",
    "release_scratch",
    "sample_chunks",
    "scratch",
    "sq_norms",
    "weight_grad",
]

# Scratch elements per chunk of the batch (4 MiB in float32): against 16 MiB, a lower peak and the same time
# (benchmarks/results/per_sample_chunk.md).
CHUNK_ELEMENTS = 1 << 20
MIN_TILE = 64  # below this many entries per group's gradient, a GEMM per (sample, group) runs inefficiently
# below this many positions P per sample, the folded native weight gradient runs inefficiently (module doc); the
# cost model counts "native" as NATIVE_POSITIONS / P times its multiply-adds there
NATIVE_POSITIONS = 128


def choose_method(spec: ConvSpec, norms: bool) -> str:
    """The cheaper method for this layer; the formulas are those of ``convgrad.per_sample_grad_norms``.

    With P positions, T taps, g groups (N cancels everywhere):
        materialise  time  P·C_y·C_x·T/g MACs          memory  C_y·C_x·T/g (the gradients)
        ghost        time  P²·(C_y + C_x·T) MACs        memory  g·P² (two Gram matrices per group)
        fft          time  fft.estimate_flops / 2 / N      memory  a chunk (``fft.sq_norms``)
    "fft" iff the kernel has at least ``fft.MIN_TAPS`` taps and its multiply-adds are fewer than the others'.
    norms: "ghost" iff its MACs are fewer; its memory is then smaller too, since
    P·g < C_y·C_x·T/(C_y + C_x·T) implies g²P² < C_y·C_x·T.
    Otherwise "unfold" (an im2col copy of C_x·T·P elements, then GEMMs whose output tile per
    (sample, group) is (C_y/g)×(C_x·T/g)), unless that tile has fewer than MIN_TILE entries
    (depthwise-like layers): then "conv", one grouped convolution with no im2col at all.
    """
    p, t, g, cx, cy = spec.positions, spec.taps, spec.groups, spec.x_channels, spec.y_channels
    direct, ghost = p * cy * spec.x_group_channels * t, p * p * (cy + cx * t)
    if fft.worth_trying(spec) and fft.estimate_flops(spec) / 2 / spec.batch < min(direct, ghost if norms else direct):
        return "fft"
    if norms and ghost < direct:
        return "ghost"
    return "conv" if cy * cx * t < MIN_TILE * g * g else "unfold"


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def empty(shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
    """torch.empty with like's dtype and device; a big CPU buffer is advised to use transparent huge pages.

    Per-sample gradients are written exactly once into fresh memory, so with 4 KiB pages
    the page faults cost more than the GEMM that fills them (measured: 300 MiB take 135 ms
    of faults against 51 ms of GEMM). madvise(MADV_HUGEPAGE) is advisory and only touches
    the 2 MiB-aligned interior of the buffer; where it is unavailable nothing changes.
    """
    t = like.new_empty(shape)
    huge = 1 << 21
    advise = _madvise() if t.device.type == "cpu" and t.nbytes >= 4 * huge else None
    if advise is not None:
        lo = (t.data_ptr() + huge - 1) & ~(huge - 1)
        hi = (t.data_ptr() + t.nbytes) & ~(huge - 1)
        advise(lo, hi - lo, 14)  # MADV_HUGEPAGE; a failure leaves ordinary pages
    return t


_SCRATCH: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def scratch(shape: tuple[int, ...], like: torch.Tensor, slot: str = "columns") -> torch.Tensor:
    """A reused buffer of the given shape for a temporary that dies before the next call (im2col columns, one
    chunk's gradients when only their norms are kept), of like's dtype and device; grown when too small.

    Fresh memory of this size is page-faulted on first touch: on the small CNN of benchmarks/per_sample.py the
    im2col copy of its second conv (9 MiB) took 28 ms in a training step against 0.9 ms into reused memory
    (torch.profiler, 2 busy shared cores). A buffer stays alive between calls (the chunks of one layer:
    ``one_layer`` releases it after); chunks bound it (``layer_chunks``, unless one sample alone is
    bigger). Plain tensors only (see ``tensor_ops.plain``): a transform's wrapper or autograd would see the buffer
    reused. One buffer per ``slot``.
    """
    numel = math.prod(shape)
    key = (slot, like.dtype, like.device)
    buf = _SCRATCH.get(key)
    if buf is None or buf.numel() < numel:
        buf = _SCRATCH[key] = empty((numel,), like)
    return buf[:numel].view(shape)


def release_scratch() -> None:
    """Drop the reused buffers of ``scratch`` (see ``one_layer``)."""
    _SCRATCH.clear()


@contextlib.contextmanager
def one_layer() -> Iterator[None]:
    """The work of one layer: ``scratch``'s buffers serve its chunks, then go (also when it raises). Kept to the
    next layer, they sat beside its transients and the activations a backward still holds: WRN-16-4's clipped step
    peaked with 4 MiB of im2col columns left by a layer already done (steady peak 161 -> 156 MiB, plain 126).
    PerSampleGrads, the functional calls and the Opacus samplers each run a layer in one."""
    try:
        yield
    finally:
        release_scratch()


def sample_chunks(n: int, per_sample: int, elements: int) -> list[slice]:
    """Slices of n samples, each holding about ``elements`` elements, at least one sample, of per_sample each."""
    size = max(1, elements // max(per_sample, 1))
    return [slice(a, min(a + size, n)) for a in range(0, n, size)]


def layer_chunks(spec: ConvSpec, per_sample: int, sides: float = 1.0) -> list[slice]:
    """``sample_chunks`` of a layer's batch, each holding at most ``CHUNK_ELEMENTS`` and at most ``sides`` times
    the layer's own input and grad_output together (``spec``'s x and y), so that its working memory stays within
    what its plain backward holds. On the small CNN's 32->64 at 16x16 (x and y: 3 MiB, batch 32) a 4 MiB im2col
    chunk beside the stored gradients set the clipped step's peak. With ``sides`` > 1 (the native kernel, whose
    copies grow with its call) the bound is ``sides`` times x and y, and never below ``CHUNK_ELEMENTS``."""
    state = spec.side_elements
    bound = min(CHUNK_ELEMENTS, state) if sides <= 1 else max(CHUNK_ELEMENTS, int(sides * state))
    return sample_chunks(spec.batch, per_sample, bound)


def im2col(spec: ConvSpec, x: torch.Tensor, reuse: bool = False) -> torch.Tensor:
    """(n, C_x, *i) -> (n, g, C_x/g·T, P): every tap of every position of y, laid out per group.

    Rows are ordered (channel, *taps) like the weight, columns like y's positions. ``reuse``: into the
    ``scratch`` buffer (valid until the next reuse).
    """
    n, g = x.shape[0], spec.groups
    x = pad(x, spec.x_read_pads)  # (n, C_x, *x_read_size): exactly the rows the conv reads
    x = windows(x, spec.kernel_size, spec.stride, spec.dilation)  # (n, C_x, *o, *k)
    nd = spec.n
    x = x.permute(0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))  # (n, C_x, *k, *o)
    if reuse or _writable(x):
        buf = (scratch if reuse else empty)(tuple(x.shape), x).copy_(x)  # (n, C_x, *k, *o), contiguous
    else:  # in a graph or under a transform: an ordinary copy, which autograd and vmap follow
        buf = x.contiguous()  # (n, C_x, *k, *o)
    return buf.view(n, g, spec.x_group_channels * spec.taps, spec.positions)  # (n, g, C_x/g·T, P)


def _writable(*tensors: torch.Tensor) -> bool:
    """Whether results may be written into fresh buffers (``out=``, ``copy_``): plain tensors outside autograd's
    graph. A tensor that requires grad (with grad enabled) or a transform's wrapper (vmap) takes ordinary ops."""
    graph = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    return not graph and all(plain(t) for t in tensors)


def _y_rows(spec: ConvSpec, y: torch.Tensor) -> torch.Tensor:
    return y.reshape(y.shape[0], spec.groups, spec.y_group_channels, spec.positions)  # (n, g, C_y/g, P)


def _unfold(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    n, g = spec.batch, spec.groups
    cyg, cxt = spec.y_group_channels, spec.x_group_channels * spec.taps
    writable = _writable(x, y)
    if out is None and writable:
        out = empty((n, spec.y_channels, cxt), x)  # (N, C_y, C_x/g·T), the weight's layout per sample
    reuse = writable and plain(x) and not torch.is_grad_enabled()
    parts = []
    for c in layer_chunks(spec, spec.x_channels * spec.taps * spec.positions):
        u = im2col(spec, x[c], reuse)  # (n', g, C_x/g·T, P)
        m = u.shape[0]
        a, b = _y_rows(spec, y[c]).reshape(m * g, cyg, -1), u.reshape(m * g, cxt, -1).transpose(1, 2)
        if out is None:  # in a graph or under vmap: bmm without out=, which neither supports
            parts.append(torch.bmm(a, b).reshape(m, spec.y_channels, cxt))  # (n', C_y, C_x/g·T)
        else:
            torch.bmm(a, b, out=out.view(n, spec.y_channels, cxt)[c].view(m * g, cyg, cxt))  # (n'·g, C_y/g, ..)
    gw = torch.cat(parts) if out is None else out
    return gw.view(n, *spec.weight_shape)


def _conv(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The fwdconv per-sample plan: the grad-of-w conv with the batch folded into the groups instead of summed."""
    out = execute(plan_per_sample_weight_grad(spec), x, y)  # (N·C_y, C_x/g, *k), a transposed view
    out = out.view(spec.batch, *spec.weight_shape)  # (N, C_y, C_x/g, *k)
    return empty(tuple(out.shape), out).copy_(out)


def _native(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """PyTorch's weight gradient of the batch folded into the groups: (N, *weight_shape), one call per chunk of the
    batch. The kernel's working memory grows with its call: oneDNN copies both sides and the result into its
    blocked layout (peak of one call, batch 32, torch.profiler: x + y + 2 x result; 7.5 MiB on the small CNN's
    32->64 at 16x16, where it set the clipped step's peak). A chunk holds at most twice the layer's x and y, which
    costs little time (benchmarks/results/per_sample_methods.md)."""
    ws = spec.with_batch(1).side_elements + 2 * math.prod(spec.weight_shape)  # one sample's sides, twice its result
    parts = layer_chunks(spec, ws, sides=2.0)
    if len(parts) == 1:
        return _native_call(spec, x, y)
    out = empty((spec.batch, *spec.weight_shape), x) if _writable(x, y) else None
    if out is None:  # in a graph or under vmap: no writes into a buffer
        return torch.cat([_native_call(_batch(spec, c, spec.batch), x[c], y[c]) for c in parts])
    for c in parts:
        out[c] = _native_call(_batch(spec, c, spec.batch), x[c], y[c])  # (n', *weight_shape)
    return out


def _native_call(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One call of PyTorch's weight gradient on the batch folded into the groups (``_native`` chunks the batch)."""
    return _folded("native", spec, x, y)


def _folded(backend: str, spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A backend's weight gradient of the batch folded into the groups (``ConvSpec.with_batch_in_groups``):
    (N, *weight_shape), sample n's gradient its group block n."""
    inp, gy = (y, x) if spec.transposed else (x, y)  # the conv's input and grad_output
    folded_input = inp.reshape(1, -1, *inp.shape[2:])  # (1, N·C_in, *i)
    folded_grad = gy.reshape(1, -1, *gy.shape[2:])  # (1, N·C_out, *o)
    gw = get_backend(backend).weight_grad(spec.with_batch_in_groups(), folded_input, folded_grad)  # (N·w0, *w[1:])
    return gw.view(spec.batch, *spec.weight_shape)  # (N, *weight_shape): sample n's block


def weight_grad(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
    """Per-sample weight gradients (N, *spec.weight_shape) by "unfold", "conv", "native" or "fft" (x, y: the two
    sides)."""
    if spec.batch == 0:
        return x.new_zeros(0, *spec.weight_shape)
    if method == "native":
        return _native(spec, x, y)
    if method == "fft":  # in a graph or under vmap: the backend's differentiable grad_weight of the folded conv
        return fft.weight_grads(spec, x, y) if _writable(x, y) else _folded("fft", spec, x, y)
    return _conv(spec, x, y) if method == "conv" else _unfold(spec, x, y)


def norm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype squared norms accumulate in: float32 for float16 and bfloat16, whose squares overflow (float16
    holds 65504: a norm of 360 fits, its square does not) or round coarsely; float32 and float64 themselves."""
    return torch.promote_types(dtype, torch.float32)


def materialised_sq_norms(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
    """Squared per-sample weight-gradient norms (N,) in ``norm_dtype``, materialising a chunk of the batch at a
    time ("fft": a chunk of samples, groups and channels, ``fft.sq_norms``)."""
    if method == "fft" and spec.batch and _writable(x, y):
        return fft.sq_norms(spec, x, y).to(norm_dtype(x.dtype))
    out = x.new_zeros(spec.batch, dtype=norm_dtype(x.dtype))
    per_sample = spec.y_channels * spec.x_group_channels * spec.taps
    if method == "unfold":
        per_sample += spec.x_channels * spec.taps * spec.positions
    reuse = plain(x) and not torch.is_grad_enabled()
    for c in layer_chunks(spec, per_sample):
        sub = _batch(spec, c, spec.batch)
        if method == "unfold" and reuse:  # the columns go to scratch, so this chunk's gradients go to a buffer
            gw = _unfold(sub, x[c], y[c], scratch((sub.batch, *spec.weight_shape), x, "grads"))  # (n', *w)
        else:
            gw = weight_grad(sub, x[c], y[c], method)  # (n', *weight_shape)
        out[c] = sq_norms(gw)
    return out


def sq_norms(g: torch.Tensor) -> torch.Tensor:
    """(N,) squared norms of (N, ...) per-sample values, in ``norm_dtype``: one reduction, without a squared copy
    of g (which ``g.square().sum()`` makes: aten::pow took 7% of a clipped step of the small CNN). The norm
    reduction accumulates half precision in float32 already; only its square would overflow."""
    return torch.linalg.vector_norm(g.flatten(1), dim=1).to(norm_dtype(g.dtype)).square()


def ghost_sq_norms(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared per-sample weight-gradient norms (N,) in ``norm_dtype``, from per-group Gram matrices, never forming
    gw. Half precision is widened per chunk first: its Gram entries, sums of squares, overflow float16."""
    acc = norm_dtype(x.dtype)
    out = x.new_zeros(spec.batch, dtype=acc)
    g, p = spec.groups, spec.positions
    reuse = plain(x) and not torch.is_grad_enabled()
    for c in layer_chunks(spec, spec.x_channels * spec.taps * p + 2 * g * p * p):
        u = im2col(spec, x[c], reuse).to(acc)  # (n', g, C_x/g·T, P)
        gram_x = u.transpose(-1, -2) @ u  # (n', g, P, P)
        yr = _y_rows(spec, y[c]).to(acc)  # (n', g, C_y/g, P)
        gram_y = yr.transpose(-1, -2) @ yr  # (n', g, P, P)
        out[c] = torch.linalg.vecdot(gram_x.flatten(1), gram_y.flatten(1))
    return out


def _batch(spec: ConvSpec, c: slice, n: int) -> ConvSpec:
    """The spec of a chunk of the batch."""
    size = len(range(*c.indices(n)))
    return spec.with_batch(size)
