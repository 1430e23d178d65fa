"""The native shortcut: where the main Function would run nothing but torch's convolution, torch's convolution with
its own autograd node; and ``CallMemo``, a convgrad module's memo of its last validated call (docs in each name; the
memo's check runs inline in ``convgrad.nn``'s forward, its one caller)."""

from __future__ import annotations

from typing import Any

import torch

from convgrad import scopes
from convgrad.backends.auto import fixed as auto_fixed
from convgrad.backends.auto import memo_state as auto_memo_state
from convgrad.backends.auto import settled_native as auto_settled_native
from convgrad.backends.native import HALF_DTYPES
from convgrad.spec import ConvSpec

__all__ = ["PARAMETER_TYPES", "CallMemo", "auto_state", "drop_weight_gradient", "memo_key", "native_throughout",
           "torch_conv"]


def native_throughout(spec: ConvSpec, backend: str, input: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> bool:
    """Whether ConvFunction would compute nothing but torch's own convolution here: its forward and every gradient
    native (backend="native"; "auto" when fixed, or settled on native for this call), on operands torch's own
    autograd handles the same way. Then torch's convolution runs with its own autograd node (``torch_conv``): the
    same kernels, values and layouts, without a Python Function's cost per call (a bare one costs about half a
    plain convolution's forward and backward on small layers).

    Through the Function stay: other backends; complex (aten has no complex kernels); per-side padding; layouts
    other than contiguous (native retries torch's "must be contiguous" refusals on copies); grad_weight skipped
    by ``no_weight_gradients`` in the forward's scope (a node hook honours a backward in the scope); torch.jit's
    tracer (a trace records the Function, so that no_weight_gradients still acts on the traced graph); a half
    precision weight with taps that meet only padding (torch's kernel leaves their gradient uninitialised, native's
    backward sets it to 0: ``native.HALF_DTYPES``).
    """
    if backend == "native":
        pass
    elif backend != "auto":
        return False
    if (scopes.weight_gradients_disabled or input.is_complex() or not spec.is_symmetric or not input.is_contiguous()
            or not weight.is_contiguous() or torch._C._is_tracing()):  # apply never asks it while Dynamo traces
        return False
    if weight.dtype in HALF_DTYPES and spec.reads_only_padding:  # native's test, inline: a call would add a frame
        return False  # to every call (test_a_functional_call_adds_few_python_frames_to_torchs)
    if backend == "native" or auto_fixed():
        return True
    grad = torch.is_grad_enabled()
    return auto_settled_native(spec, input, weight, grad and input.requires_grad, grad and weight.requires_grad)


def drop_weight_gradient(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Post-hook of a ``torch_conv`` node: a backward inside ``no_weight_gradients`` gives the weight nothing."""
    if not scopes.weight_gradients_disabled:
        return None
    return (grad_inputs[0], None, *grad_inputs[2:])


def torch_conv(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                args: tuple[Any, ...] | None = None) -> torch.Tensor:
    """torch's convolution with its own autograd node (see ``native_throughout``); ``args``: spec.aten_args."""
    batched = input.unsqueeze(0) if spec.unbatched else input  # (N, C_in, *i)
    out = torch.convolution(batched, weight, bias, *(spec.aten_args if args is None else args))  # (N, C_out, *o)
    if weight.requires_grad:
        node = out.grad_fn  # read once: each read builds a new Python object for the node
        if node is not None:
            node.register_hook(drop_weight_gradient)
    return out.squeeze(0) if spec.unbatched else out  # (C_out, *o) unbatched


PARAMETER_TYPES = (torch.Tensor, torch.nn.Parameter)


class CallMemo:
    """What one call site (a convgrad module) validated on its last call that took torch's own convolution: the
    next call with the same operands' shapes, dtypes and devices, the same hyperparameter objects and backend, and
    an unchanged state of auto's choices, runs torch's convolution without validating again."""

    __slots__ = ("args", "auto", "hyper", "key", "spec")
    # set together with key, when a call is memoised (annotations only: the slots hold them)
    args: tuple[Any, ...]
    auto: tuple[Any, ...] | None
    hyper: tuple[Any, ...]  # apply's (stride, padding, dilation, transposed, output_padding, groups, backend) objects
    spec: ConvSpec

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None

    def __reduce__(self) -> tuple[type, tuple[()]]:  # a copy or an unpickled module validates afresh
        return CallMemo, ()


def memo_key(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...] | None:
    """The operands' shapes, dtypes and devices; None where the memo must not serve (subclasses: ExpandedWeight,
    fake and traced tensors; layouts other than contiguous).

    Two are left to torch's convolution, which refuses every value that differs from the validated call's (a
    weight dtype other than the input's, a bias shape other than ``(C_out,)``); the module's forward then
    validates the call, so that the error is convgrad's. Each size read builds a torch.Size: about half a percent
    of a small layer's forward and backward apiece. The rest torch would take silently (a bias of another dtype, an
    operand on the meta device), so they stay in the key."""
    if (type(input) is not torch.Tensor or type(weight) not in PARAMETER_TYPES
            or (bias is not None and type(bias) not in PARAMETER_TYPES)
            or not input.is_contiguous() or not weight.is_contiguous()):
        return None
    return (input.shape, input.dtype, input.device, weight.shape, weight.device,
            None if bias is None else (bias.dtype, bias.device))


def auto_state(backend: str) -> tuple[Any, ...] | None:
    """What a memoised answer of ``settled_native`` depends on, beyond the call: None where it does not apply."""
    return auto_memo_state() if backend == "auto" else None
