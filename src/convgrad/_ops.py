"""Small tensor helpers shared by the backends: N-d padding/cropping and the forward conv by rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

Pair = tuple[int, int]

CONV: dict[int, Callable[..., torch.Tensor]] = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


def pad(t: torch.Tensor, pairs: Sequence[Pair], mode: str = "constant") -> torch.Tensor:
    """Pad the trailing len(pairs) dims by (lo, hi) each; a negative amount crops (constant mode)."""
    if not any(lo or hi for lo, hi in pairs):
        return t
    flat = [v for lo, hi in reversed(pairs) for v in (lo, hi)]  # F.pad wants the last dim first
    if mode == "constant" and any(v < 0 for v in flat):
        # pad first, then crop: a crop on one side may exceed the input when the other side's pad makes room
        if any(v > 0 for v in flat):
            t = pad(t, [(max(lo, 0), max(hi, 0)) for lo, hi in pairs])
        n = len(pairs)
        return sliced(t, [slice(max(-lo, 0), t.shape[j - n] - max(-hi, 0)) for j, (lo, hi) in enumerate(pairs)])
    return F.pad(t, flat, mode=mode)


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
    checks = [getattr(torch._C._functorch, name, None)  # private: when one is missing, assume wrapped
              for name in ("is_functorch_wrapped_tensor", "is_legacy_batchedtensor")]
    return all(c is not None and not c(t) for c in checks) and forward_ad.unpack_dual(t).tangent is None


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


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """grad_output (N, C_out, *spatial) summed to (C_out,), accumulating half precision in float32."""
    dims = [0, *range(2, grad_output.dim())]
    if grad_output.dtype in (torch.float16, torch.bfloat16):
        return grad_output.sum(dims, dtype=torch.float32).to(grad_output.dtype)
    return grad_output.sum(dims)
