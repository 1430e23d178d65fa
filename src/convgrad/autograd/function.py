"""The main autograd Function: a native (or auto-tuned) forward and a backward computed by the chosen backend.

The ExpandedWeights Function
(``expanded``) and the native shortcut (``shortcut``) build on this module; ``calls`` holds the public entry points.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import torch

from convgrad import scopes
from convgrad.backends import Backend, backend_names, get_backend, traceable_names
from convgrad.backends.auto import forward as auto_forward
from convgrad.backends.native import forward as native_forward
from convgrad.checks import check_untraced
from convgrad.errors import ConvgradValueError
from convgrad.scopes import no_weight_gradients
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import bias_grad

__all__ = ["SCRIPT_UNSUPPORTED", "ConvCore", "ConvFunction", "check_differentiation", "no_weight_gradients",
           "shape_of"]

# Every backend registered now, at import, not on the first lookup inside a compiled call: Dynamo traces the imports
# that lookup runs (pkgutil's posix.stat, with a warning), and they left captured tracebacks alive (issue 25, item 8)
backend_names()

# TorchScript cannot compile a Python autograd.Function, so no convgrad convolution can be scripted
SCRIPT_UNSUPPORTED = (
    "{fn} cannot compile convgrad's convolutions: their backward is a Python autograd.Function, which TorchScript "
    "cannot hold; use torch.compile or torch.export (or torch.jit.trace, which records the Function), or "
    "convgrad.unpatch(model) before scripting to get torch's own convolutions back")


class ConvCore(torch.autograd.Function):
    """The Function torch.compile traces: Dynamo refuses Functions that define ``jvp`` (see ConvFunction)."""

    generate_vmap_rule = True  # forward and backward are vmap-able torch ops

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec,
                backend: str) -> torch.Tensor:
        if backend == "auto":  # the forward is tuned too (an fft forward for large kernels)
            out = auto_forward(spec, input, weight, bias)
        else:
            out = native_forward(spec, input, weight, bias)
        # a transposed conv with asymmetric padding crops aten's result: a view, whose forward-AD tangent autograd
        # then requires to be a view of the same layout (an internal assert under jvp otherwise); return a copy
        return out.clone() if out._base is not None else out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        input, weight, _, spec, backend = inputs
        ctx.save_for_backward(input, weight)
        ctx.spec, ctx.backend = spec, backend

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        input, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        need_weight = need_weight and not scopes.weight_gradients_disabled
        backend = get_backend(ctx.backend, "ConvFunction.backward")
        gi = gw = None
        if need_input or need_weight:
            if not backend.differentiable:
                check_differentiation(ctx.spec.fn, backend, grad_output=grad_output, input=input, weight=weight)
            gi, gw = backend.gradients(ctx.spec, grad_output, input, weight, need_input, need_weight)
        gb = bias_grad(grad_output) if need_bias else None
        return gi, gw, gb, None, None


# torch.autograd.Function.apply binds its arguments with inspect.signature(forward) on every call (as it does for any
# Function with a setup_context); a signature stored on the function is returned as it is instead of being rebuilt
# from the code object (about 50 us of a 100 us conv of the demo's network).
ConvCore.forward.__signature__ = inspect.signature(ConvCore.forward)  # type: ignore[attr-defined]


class ConvFunction(ConvCore):
    """conv / conv_transpose (per ``spec.transposed``) with a native forward and an explicit backward.

    ``apply(input, weight, bias, spec, backend)`` with batched tensors and a ``ConvSpec``.
    torch.func.vmap uses the generated rule; forward-mode AD (torch.func.jvp) uses the bilinearity
    of the convolution. Under torch.compile, ``conv`` applies the jvp-free parent instead.
    """

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        ConvCore.setup_context(ctx, inputs, output)
        ctx.save_for_forward(*inputs[:2])

    @staticmethod
    def jvp(ctx: Any, input_t: torch.Tensor | None, weight_t: torch.Tensor | None, bias_t: torch.Tensor | None,
            *_: Any) -> torch.Tensor:
        # conv is bilinear in (input, weight) and affine in bias: d conv = conv(dx, w) + conv(x, dw) + db
        input, weight = ctx.saved_tensors
        input_t = torch.zeros_like(input) if input_t is None else input_t
        tangent = native_forward(ctx.spec, input_t, weight, bias_t)
        if weight_t is not None:
            tangent = tangent + native_forward(ctx.spec, input, weight_t, None)
        return tangent


def shape_of(t: torch.Tensor) -> tuple[int, ...]:
    """``t.shape`` as ints, also while torch.jit.trace records (it gives each size as a tensor there).

    A traced call records the Function with its ConvSpec as a constant, so the trace holds these shapes anyway;
    the tracer's warning about converting its sizes to ints would say nothing more.
    """
    if not torch.jit.is_tracing():
        return tuple(t.shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        return tuple(int(v) for v in t.shape)



def check_differentiation(fn: str, backend: Backend, **tensors: torch.Tensor) -> None:
    """In the backward of a backend autograd cannot see through: no transform, no second derivative."""
    check_untraced(fn, backend, tensors, returns_gradients=False)
    if torch.is_grad_enabled():
        raise ConvgradValueError(f"{fn}: backend={backend.name!r} is not differentiable; a second derivative "
                                 f"(create_graph=True) needs one of {traceable_names()}")

