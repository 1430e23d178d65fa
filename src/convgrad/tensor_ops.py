"""Small tensor helpers shared by every layer above spec: N-d padding and cropping (with F.pad's flat list), the
N-d unfold of a convolution's windows, the two channels-last predicates, the memory format of each rank, the dtypes
oneDNN runs natively, and the forward conv by rank. One copy of each; the shapes come from ``convgrad.spec``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from convgrad.spec import pad_then_crop

Pair = tuple[int, int]

__all__ = ["CHANNELS_LAST", "CONV", "ONEDNN_DTYPES", "accumulation_dtype", "add_product_", "batched_like", "bias_grad",
           "channels_innermost", "crop", "is_channels_last", "pad", "pad_flat", "placeholder", "plain", "sliced",
           "windows"]

CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
# The channels-last memory format of a 4d (NHWC) and a 5d (NDHWC) tensor; other ranks have none.
CHANNELS_LAST: dict[int, torch.memory_format] = {4: torch.channels_last, 5: torch.channels_last_3d}
# The dtypes oneDNN's CPU convolutions run natively; others (float64, float16) take slower reference kernels.
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def pad_flat(pairs: Sequence[Pair]) -> list[int]:
    """(lo, hi) per trailing dim -> F.pad's flat list, last dim first.

    Examples:
        >>> pad_flat([(1, 2), (3, 4)])
        [3, 4, 1, 2]
    """
    return [v for lo, hi in reversed(tuple(pairs)) for v in (lo, hi)]


def pad(t: torch.Tensor, pairs: Sequence[Pair], mode: str = "constant") -> torch.Tensor:
    """Pad the trailing len(pairs) dims by (lo, hi) each; a negative amount crops (constant mode)."""
    if not any(lo or hi for lo, hi in pairs):
        return t
    flat = pad_flat(pairs)
    if mode == "constant" and any(v < 0 for v in flat):
        # pad first, then crop: a crop on one side may exceed the input when the other side's pad makes room
        grow, cut = pad_then_crop(pairs)
        if any(v > 0 for v in flat):
            t = pad(t, grow)
        n = len(pairs)
        return sliced(t, [slice(lo, t.shape[j - n] - hi) for j, (lo, hi) in enumerate(cut)])
    return F.pad(t, flat, mode=mode)


def crop(t: torch.Tensor, pairs: Sequence[Pair]) -> torch.Tensor:
    """Crop (lo, hi) rows off each trailing dim (the inverse of ``pad``; a negative amount pads)."""
    return pad(t, [(-lo, -hi) for lo, hi in pairs])


def windows(x: torch.Tensor, kernel_size: Sequence[int], stride: Sequence[int],
            dilation: Sequence[int]) -> torch.Tensor:
    """The windows a convolution reads, as a view: (N, C, *x_read) -> (N, C, *o, *k), no copy.

    Element ``[n, c, *j, *t]`` is ``x[n, c, *(j*s + t*d)]``; ``x`` must be padded (or cropped) to exactly the rows
    the conv reads (``ConvSpec.x_read_pads``), so o = (x_read - d(k-1) - 1)/s + 1. The one N-d im2col view.
    """
    for j, (k, s, d) in enumerate(zip(kernel_size, stride, dilation)):
        x = x.unfold(2 + j, d * (k - 1) + 1, s)  # the window of dim j is appended last
    return sliced(x, [slice(None, None, d) for d in dilation])  # (N, C, *o, *k)


def is_channels_last(t: torch.Tensor) -> bool:
    """Whether t is laid out in the channels-last memory format of its rank (NHWC / NDHWC) and not also plainly
    contiguous: the layout torch's conv kernels are asked for."""
    fmt = CHANNELS_LAST.get(t.dim())
    return fmt is not None and not t.is_contiguous() and t.is_contiguous(memory_format=fmt)


def channels_innermost(t: torch.Tensor) -> bool:
    """Whether the channels (dim 1) are the innermost dim in memory (NHWC-like) of a non-contiguous tensor of any
    rank >= 3, strides only: the layout a result should copy to stay channels last, in 1d too."""
    return t.dim() >= 3 and t.shape[1] > 1 and t.stride(1) == 1 and not t.is_contiguous()


def sliced(t: torch.Tensor, slices: Sequence[slice], start_dim: int | None = None) -> torch.Tensor:
    """t with one slice per dim from start_dim on (default: the trailing len(slices) dims).

    A slice that keeps its whole dim is skipped: indexing that keeps everything returns an alias,
    which the legacy vmap behind ``autograd.grad(..., is_grads_batched=True)`` cannot batch.
    """
    start = t.dim() - len(slices) if start_dim is None else start_dim
    for dim, s in enumerate(slices, start):
        if s.indices(t.shape[dim]) != (0, t.shape[dim], 1):
            t = t[(slice(None),) * dim + (s,)]
    return t


def plain(t: torch.Tensor) -> bool:
    """A plain tensor: no subclass, no functorch wrapper (vmap, grad, jvp, jacrev), not batched by the legacy
    vmap of ``is_grads_batched``, no forward-AD tangent. Only such tensors may take paths that read values
    (autotuning) or write through ``out=`` (no batching or forward-AD rules). Nothing is plain while
    torch.compile traces: dynamo cannot trace the functorch queries below."""
    if torch.compiler.is_compiling() or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    for check in _FUNCTORCH_CHECKS:
        if check is None or check(t):
            return False
    # no dual level entered (forward_ad's own test in unpack_dual): no tangent, without building the namedtuple
    return forward_ad._current_level < 0 or forward_ad.unpack_dual(t).tangent is None


# private to torch: when one is missing, every tensor counts as wrapped
_FUNCTORCH_CHECKS = tuple(getattr(torch._C._functorch, name, None)
                          for name in ("is_functorch_wrapped_tensor", "is_legacy_batchedtensor"))


def batched_like(buffer: torch.Tensor, kernel: torch.Tensor | None) -> torch.Tensor:
    """buffer, batched like kernel as well when a functorch transform wraps kernel (vmap over the weight with
    grad_output shared, at any nesting, or vmap of grad): results computed from kernel are written into the buffer
    in place, which needs every batch dim they have. A no-op for a plain kernel."""
    if kernel is None or plain(kernel) or kernel.numel() == 0:
        return buffer
    zero = torch.zeros_like(kernel.reshape(-1)[:1])  # (1,), batched like kernel at every level
    return buffer + zero.reshape((1,) * buffer.dim())


def add_product_(target: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fused: bool) -> None:
    """target += a * b in place (broadcasting): one ``addcmul_`` when ``fused`` (plain tensors, see ``plain``),
    else ``add_`` of the product, because functorch has no batching rule for ``addcmul_`` and would fall back to a
    slow per-sample loop with a warning."""
    if fused:
        target.addcmul_(a, b)
    else:
        target.add_(a * b)


def placeholder(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A zero-stride tensor of the given shape: stands in for a tensor whose gradient is not wanted."""
    return like.new_zeros(()).expand(*shape)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a sum of ``dtype`` terms runs in: float32 for float16 and bfloat16, as torch's own kernels
    accumulate them (a sum rounded to half precision at every term loses a bit per few terms: docs/numerics.md,
    "Half precision"), else ``dtype`` itself.

    Examples:
        >>> accumulation_dtype(torch.bfloat16), accumulation_dtype(torch.float64)
        (torch.float32, torch.float64)
    """
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """grad_output (N, C_out, *spatial) summed to (C_out,), accumulating half precision in float32."""
    dims = [0, *range(2, grad_output.dim())]
    # accumulation_dtype's test inline: every backward calls this (test_a_functional_call_adds_few_python_frames)
    if grad_output.dtype in (torch.float16, torch.bfloat16):
        return grad_output.sum(dims, dtype=torch.float32).to(grad_output.dtype)
    return grad_output.sum(dims)
