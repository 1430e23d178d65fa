"""The memory format of each gradient: the one torch's own convolution backward returns for the same tensors.

torch picks a kernel (oneDNN, cuDNN, THNN's im2col, ...) from the input and the weight, and each kernel
has its layout: channels_last (channels_last_3d) when the input *or* the weight suggests it and the kernel
supports it, contiguous otherwise; with an empty input (the "Empty" kernel) each gradient is
``zeros_like`` its own tensor. torch exposes that choice as ``torch._C._select_conv_backend`` and
``torch._C._conv_determine_backend_memory_format``; its FakeTensor rule for convolutions uses the same two
calls. Where they are missing, and while torch.compile traces (dynamo cannot trace them), the rule of
torch's meta kernel stands in: channels_last when the input or the weight suggests it.

Only strides change here, never values: a gradient already laid out as torch's is returned as it is, any
other is copied once, by a differentiable permute and ``contiguous`` (so second derivatives still flow).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from convgrad.spec import ConvSpec, padded_sizes
from convgrad.tensor_ops import CHANNELS_LAST, placeholder

_select = getattr(torch._C, "_select_conv_backend", None)  # private; absent: the meta rule
_determine = getattr(torch._C, "_conv_determine_backend_memory_format", None)
_EMPTY = {getattr(getattr(torch._C, "_ConvBackend", None), name, None) for name in ("Empty", "MkldnnEmpty")}

# A gradient's target: a memory format, or a tensor whose zeros_like layout it takes (the Empty kernel).
Target = torch.memory_format | torch.Tensor


def _vmapped(t: torch.Tensor) -> bool:
    """t is batched by a vmap at some level: functorch cannot query or set channels_last layouts there."""
    functorch = torch._C._functorch
    if functorch.is_legacy_batchedtensor(t):
        return True
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return True
        t = functorch.get_unwrapped(t)
    return False


def _suggested(t: torch.Tensor | None) -> torch.memory_format:
    """c10's suggest_memory_format: channels_last(_3d) when t's strides are ordered as in that format.

    A port, as plain Python on sizes and strides so that torch.compile can trace it: the channels go
    innermost, then the spatial dims from the last, then the batch; ambiguous cases are contiguous.
    """
    if t is None or t.dim() not in (4, 5) or t.stride(1) == 0:
        return torch.contiguous_format
    sizes, strides, least = t.shape, t.stride(), 0
    for d in (1, *range(t.dim() - 1, 1, -1), 0):
        if sizes[d] == 0 or strides[d] < least or (d == 0 and least == strides[1]):
            return torch.contiguous_format
        least = strides[d] * max(sizes[d], 1)
    return CHANNELS_LAST[t.dim()]


def _seen_input(spec: ConvSpec, input: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The input tensor torch's backward would see: a zero-stride stand-in for a missing one (as in
    torch.nn.grad), and, for the excess of an asymmetric padding, an unfilled tensor of the padded shape
    in the layout F.pad gives it."""
    input = placeholder(spec.input_shape, like) if input is None else input
    excess = spec.padding_excess
    if spec.transposed or not any(lo or hi for lo, hi in excess):
        return input
    size = padded_sizes(input.shape[2:], excess)
    return torch.empty((*input.shape[:2], *size), dtype=input.dtype, device=input.device,
                       memory_format=_suggested(input))  # (N, C_in, *(i + excess))


def _targets(spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
             weight: torch.Tensor | None) -> tuple[Target, Target]:
    """(grad_input's target, grad_weight's target): the layouts torch's backward gives for these tensors."""
    operands = ((input, spec.input_shape), (weight, spec.weight_shape))
    if grad_output.is_complex() or all(_plainly_contiguous(t, shape) for t, shape in operands):
        # what every kernel gives (Empty's zeros_like too); torch builds complex convolutions from real ones,
        # and their gradients come out contiguous whatever the layouts
        return torch.contiguous_format, torch.contiguous_format
    meta_rule = next((f for f in (_suggested(input), _suggested(weight)) if f != torch.contiguous_format),
                     torch.contiguous_format)
    if _select is None or _determine is None or torch.compiler.is_compiling():  # dynamo cannot trace them
        return meta_rule, meta_rule
    input = _seen_input(spec, input, grad_output)
    weight = placeholder(spec.weight_shape, grad_output) if weight is None else weight
    try:
        kernel = _select(input, weight, None, list(spec.stride), list(spec.symmetric_padding),
                         list(spec.dilation), spec.transposed, list(spec.output_padding), spec.groups, None)
    except RuntimeError:  # tensors torch's own convolution refuses (our backends need not): no layout to copy
        return meta_rule, meta_rule
    if kernel in _EMPTY:
        return input, weight
    if weight.dim() == 3:  # 1d runs as 2d with a unit height, on a contiguous input (as torch does)
        input, weight = placeholder(input.shape, input).unsqueeze(2), weight.unsqueeze(2)  # (N, C, 1, L)
    fmt = _determine(input, weight, kernel)
    return fmt, fmt


def _dense_strides(shape: Sequence[int], order: Sequence[int] | None = None) -> tuple[int, ...]:
    """The strides of a dense tensor of this shape whose dims lie in memory in ``order`` (outermost first;
    default: contiguous)."""
    order = range(len(shape)) if order is None else order
    strides, step = [0] * len(shape), 1
    for d in reversed(order):
        strides[d], step = step, step * max(shape[d], 1)
    return tuple(strides)


def _plainly_contiguous(t: torch.Tensor | None, shape: Sequence[int]) -> bool:
    """Not empty (zeros_like keeps an empty tensor's strides), and contiguous strides on every dim, size-1 dims
    too (a depthwise (C, 1, k, k) weight can be contiguous and yet suggest channels_last by the stride of its
    size-1 dim); a missing tensor has no layout of its own."""
    if t is None:
        return 0 not in shape
    return t.is_contiguous() and t.numel() > 0 and (1 not in t.shape or t.stride() == _dense_strides(t.shape))


def _target_strides(shape: torch.Size, target: Target) -> tuple[int, ...]:
    """The strides target gives a dense tensor of this shape."""
    if isinstance(target, torch.Tensor):
        return torch.empty_like(target, device="meta").stride()  # zeros_like's layout, nothing allocated
    channels_last = [0, *range(2, len(shape)), 1]  # (N, *spatial, C) in memory; for 1d too
    return _dense_strides(shape, None if target == torch.contiguous_format else channels_last)


def _laid_out(grad: torch.Tensor | None, target: Target) -> torch.Tensor | None:
    """grad with the strides of target (size-1 dims, whose strides nothing reads, aside): itself if it has them."""
    if grad is None:
        return None
    if grad.numel() and not isinstance(target, torch.Tensor) and (grad.dim() > 3 or target == torch.contiguous_format):
        if grad.is_contiguous(memory_format=target):  # the common case, one flag torch keeps: nothing to copy
            return grad
    strides = _target_strides(grad.shape, target)
    if all(n == 1 or a == b for n, a, b in zip(grad.shape, grad.stride(), strides)):
        return grad
    if grad.numel() == 0:  # contiguous() keeps an empty tensor's strides (it counts as contiguous)
        return grad.as_strided(grad.shape, strides)
    order = sorted(range(grad.dim()), key=lambda d: -strides[d])  # outermost dim first; stable on ties
    inverse = sorted(range(grad.dim()), key=order.__getitem__)
    return grad.permute(order).contiguous().permute(inverse)  # dense, in target's dim order


def like_torch(spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
               grad_input: torch.Tensor | None, grad_weight: torch.Tensor | None
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(grad_input, grad_weight) in the memory format torch's convolution backward returns for these tensors.

    Tensors are batched; input or weight may be None when its gradient alone was asked for. Under vmap the
    layout of a batched tensor is not the user's to see, and the gradients pass unchanged.
    """
    if grad_input is None and grad_weight is None:
        return grad_input, grad_weight
    tensors = [t for t in (grad_output, input, weight) if t is not None]
    if not torch.compiler.is_compiling() and any(_vmapped(t) for t in tensors):
        return grad_input, grad_weight
    for_input, for_weight = _targets(spec, grad_output, input, weight)
    return _laid_out(grad_input, for_input), _laid_out(grad_weight, for_weight)


def output_like_torch(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """A convolution's output (``spec.output_shape``, computed by another backend's forward) in the memory format
    torch's own convolution gives it for these tensors: the one its kernel gives grad_input too (``like_torch``).

    An empty output, and one under vmap, pass unchanged.
    """
    if output.numel() == 0 or (not torch.compiler.is_compiling() and any(_vmapped(t) for t in (input, weight))):
        return output
    # a real stand-in for grad_output: torch's complex forward keeps the channels-last layout its gradients do not
    target = _targets(spec, input.real if input.is_complex() else input, input, weight)[0]
    return output if isinstance(target, torch.Tensor) else _laid_out(output, target)  # type: ignore[return-value]
