"""Convolutions with torch's ExpandedWeight operands (torch.nn.utils._per_sample_grad, Opacus grad_sample_mode="ew"):
the forward is the main Function's, the backward adds per-sample gradients to each parameter's ``grad_sample``."""

from __future__ import annotations

from typing import Any

import torch

from convgrad.autograd.function import ConvCore
from convgrad.backends import get_backend
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec

__all__ = ["Expanded", "ExpandedConvFunction", "expanded_weight_type", "find_expanded_weight_type", "unexpand"]


class Expanded:
    """The ExpandedWeight operands of one call (torch.nn.utils._per_sample_grad, Opacus grad_sample_mode="ew"),
    held in an object the Function's apply does not look into (each is a tensor subclass that refuses every op)."""

    def __init__(self, weight: Any, bias: Any) -> None:
        self.weight, self.bias = weight, bias


class ExpandedConvFunction(torch.autograd.Function):
    """A convolution with ExpandedWeight operands: the forward as ConvFunction's; the backward gives grad_input
    through the backend and, as torch's ExpandedWeights rules do, adds each per-sample gradient to the original
    parameter's ``grad_sample`` (times the batch for loss_reduction="mean"), leaving ``.grad`` alone."""

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec, backend: str,
                expanded: Expanded) -> torch.Tensor:
        return ConvCore.forward(input, weight, bias, spec, backend)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        input, weight, _, spec, backend, expanded = inputs
        ctx.save_for_backward(input, weight)
        ctx.spec, ctx.backend, ctx.expanded = spec, backend, expanded

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        from convgrad.per_sample import per_sample_bias_grad, per_sample_weight_grad  # a layer above this one

        input, weight = ctx.saved_tensors
        spec, expanded = ctx.spec, ctx.expanded
        gi = None
        if ctx.needs_input_grad[0]:
            gi, _ = get_backend(ctx.backend, "ConvFunction.backward").gradients(spec, grad_output, input, weight,
                                                                                 True, False)
        for ew, per_sample in ((expanded.weight, lambda: per_sample_weight_grad(
                input, spec.weight_shape, grad_output, spec.stride, spec.padding, spec.dilation, spec.groups,
                spec.transposed, spec.output_padding)), (expanded.bias, lambda: per_sample_bias_grad(grad_output))):
            if ew is None:
                continue
            g = per_sample()  # (N, *param.shape)
            if ew.loss_reduction == "mean":
                g = g * ew.batch_size
            param = ew.orig_weight
            param.grad_sample = g if getattr(param, "grad_sample", None) is None else param.grad_sample + g
        return gi, None, None, None, None, None


def find_expanded_weight_type() -> Any:
    """torch's ExpandedWeight class, or None; typed Any: its orig_weight and batch_size are not in torch's stubs."""
    try:  # private to torch, and absent from some builds
        from torch.nn.utils._expanded_weights import ExpandedWeight
    except ImportError:
        return None
    return ExpandedWeight


# Looked up once, at import: an import statement inside a call is traced by Dynamo (importlib's posix.stat, with a
# warning), and after two torch._dynamo.explain calls and a reset it left 8 more captured tracebacks alive than
# torch's own conv_transpose2d (issue 25, item 8: a hang at exit in the release of a captured traceback)
_EXPANDED_WEIGHT = find_expanded_weight_type()


def expanded_weight_type() -> Any:
    """torch's ExpandedWeight class, or None."""
    return _EXPANDED_WEIGHT


def unexpand(fn: str, input: Any, weight: Any, bias: Any) -> tuple[Any, Any, Expanded | None]:
    """The original parameters behind ExpandedWeight operands, and the operands; (weight, bias, None) otherwise."""
    ew_type = expanded_weight_type()
    if ew_type is None or not (isinstance(weight, ew_type) or isinstance(bias, ew_type)):
        return weight, bias, None
    for name, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and not isinstance(t, ew_type) and t.requires_grad:
            raise ConvgradValueError(
                f"{fn}: {name} requires grad but is not an ExpandedWeight while another operand is; "
                f"ExpandedWeights needs every parameter expanded")
    expanded = Expanded(weight if isinstance(weight, ew_type) else None, bias if isinstance(bias, ew_type) else None)
    unwrap = lambda t: t.orig_weight if isinstance(t, ew_type) else t  # noqa: E731
    weight, bias = unwrap(weight), unwrap(bias)
    if (isinstance(input, ew_type) or not isinstance(input, torch.Tensor) or not isinstance(weight, torch.Tensor)
            or input.dim() != weight.dim()):
        raise ConvgradValueError(f"{fn}: ExpandedWeights needs a batched input (N, C_in, *spatial), got input.shape="
                                 f"{tuple(getattr(input, 'shape', ()))} for weight.shape={tuple(weight.shape)}")
    sizes = {ew.batch_size for ew in (expanded.weight, expanded.bias) if ew is not None}
    if sizes != {input.shape[0]}:
        raise ConvgradValueError(f"{fn}: ExpandedWeight batch size {sorted(sizes)} does not match the input's batch "
                                 f"{input.shape[0]}")
    return weight, bias, expanded

