"""Tensor validation shared by every entry point (functional, autograd's conv, per_sample): one message per failure.

Each error names the function (``fn``), the parameter and its value, as the argument checks of
``convgrad.spec.arguments`` do for the integers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from convgrad.backends import traceable_names
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec, ntuple
from convgrad.spec.arguments import value_text

if TYPE_CHECKING:
    from convgrad.backends import Backend

__all__ = ["check_grad_output", "check_module", "check_same_kind", "check_size", "check_tensor", "check_tensors",
           "check_untraced", "transformed"]


def check_tensor(fn: str, name: str, t: Any, *, complex_ok: bool = True) -> torch.Tensor:
    """``t`` itself when it is a floating tensor (or complex, with ``complex_ok``).

    Raises:
        TypeError: ``t`` is None, not a tensor, or of another dtype.
    """
    if t is None:
        raise ConvgradTypeError(f"{fn}: {name} is None, but a tensor is required")
    if not isinstance(t, torch.Tensor):
        raise ConvgradTypeError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if complex_ok and not (t.is_floating_point() or t.is_complex()):
        raise ConvgradTypeError(
            f"{fn}: {name}.dtype={t.dtype} is not supported; use a floating point (or complex) dtype")
    if not complex_ok and not t.is_floating_point():
        raise ConvgradTypeError(f"{fn}: {name}.dtype={t.dtype} is not supported; use a real floating dtype")
    return t


def check_same_kind(fn: str, tensors: dict[str, torch.Tensor]) -> None:
    """Every tensor has the dtype and the device of the first one.

    Raises:
        TypeError: another dtype. ValueError: another device.
    """
    (first, ref), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != ref.dtype:
            raise ConvgradTypeError(f"{fn}: {name}.dtype={t.dtype} does not match {first}.dtype={ref.dtype}")
        if t.device != ref.device:
            raise ConvgradValueError(f"{fn}: {name}.device={t.device} does not match {first}.device={ref.device}")


def check_tensors(fn: str, backend: Backend, *, results_in_graph: bool = False, **tensors: Any) -> None:
    """Type, dtype and device checks of the functional entry points, and what the backend accepts.

    ``results_in_graph``: the gradients reach the user through autograd (the backward of
    ``conv``), not as the return value of a function.
    """
    checked = {name: check_tensor(fn, name, t) for name, t in tensors.items()}
    check_same_kind(fn, checked)
    first, ref = next(iter(checked.items()))
    backend.check_operand(fn, first, ref)
    if not backend.differentiable:
        check_untraced(fn, backend, checked, returns_gradients=not results_in_graph)


def transformed(t: torch.Tensor) -> bool:
    """t belongs to a torch.func transform (grad, vjp, jacrev, vmap, ...) or to is_grads_batched's vmap."""
    if torch.compiler.is_compiling():  # dynamo cannot trace the functorch queries; it runs no transform here
        return False
    functorch = torch._C._functorch
    return functorch.is_functorch_wrapped_tensor(t) or functorch.is_legacy_batchedtensor(t)


def check_untraced(fn: str, backend: Backend, tensors: dict[str, torch.Tensor], returns_gradients: bool) -> None:
    """For a backend autograd cannot see through: refuse torch.func transforms, and (``returns_gradients``)
    tensors that require grad, whose gradients would come back silently detached from the graph."""
    for name, t in tensors.items():
        if transformed(t):
            raise ConvgradValueError(
                f"{fn}: backend={backend.name!r} does not support torch.func transforms (grad, vjp, "
                f"jacrev, vmap, ...) nor is_grads_batched, but {name} comes from one; use one of "
                f"{traceable_names()}")
    tracked = [name for name, t in tensors.items() if t.requires_grad]
    if returns_gradients and tracked and torch.is_grad_enabled():
        raise ConvgradValueError(
            f"{fn}: backend={backend.name!r} computes outside autograd, but "
            f"{tracked[0]}.requires_grad=True: the gradients would come back silently detached from "
            f"the graph; pass detached tensors, call it under torch.no_grad(), or use one of "
            f"{traceable_names()}")


def check_module(fn: str, model: Any) -> torch.nn.Module:
    """``model`` itself when it is a ``torch.nn.Module``.

    Raises:
        TypeError: anything else (None, a function, a list of layers), named with its type.
    """
    if not isinstance(model, torch.nn.Module):
        raise ConvgradTypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def check_size(fn: str, name: str, size: Any) -> tuple[int, ...]:
    """A size argument (``input_size``, ``weight_size``) as a tuple of ints >= 0; errors name ``name``.

    Raises:
        TypeError: not a sequence of ints (a tensor or a str is not one).
        ValueError: a negative entry.
    """
    if isinstance(size, torch.Tensor) or not isinstance(size, Sequence) or isinstance(size, str):
        hint = " (pass its .shape)" if hasattr(size, "shape") else ""
        raise ConvgradTypeError(f"{fn}: {name}={value_text(size)} must be a sequence of ints such as torch.Size{hint}")
    return ntuple(fn, name, tuple(size), len(size), 0)  # errors name `name`, not the spec's "input.shape"


def check_grad_output(fn: str, spec: ConvSpec, grad_output: torch.Tensor) -> None:
    """grad_output has the convolution's output shape (unbatched: without the batch dim).

    Raises:
        ValueError: another shape.
    """
    expected = spec.output_shape[1:] if spec.unbatched else spec.output_shape
    if tuple(grad_output.shape) != expected:
        raise ConvgradValueError(f"{fn}: grad_output.shape={tuple(grad_output.shape)} does not match the output shape "
                                 f"{expected} of {spec.describe()}")
