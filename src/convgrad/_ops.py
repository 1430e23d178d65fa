"""Small tensor helpers shared by the backends: N-d padding/cropping and the forward conv by rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

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
        return t[(..., *(slice(max(-lo, 0), t.shape[j - n] - max(-hi, 0)) for j, (lo, hi) in enumerate(pairs)))]
    return F.pad(t, flat, mode=mode)


def placeholder(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A zero-stride tensor of the given shape: stands in for a tensor whose gradient is not wanted."""
    return like.new_zeros(()).expand(*shape)


def bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """grad_output (N, C_out, *spatial) summed to (C_out,), accumulating half precision in float32."""
    dims = [0, *range(2, grad_output.dim())]
    if grad_output.dtype in (torch.float16, torch.bfloat16):
        return grad_output.sum(dims, dtype=torch.float32).to(grad_output.dtype)
    return grad_output.sum(dims)
