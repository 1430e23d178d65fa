"""How convgrad reaches the convolutions a model calls as functions: ``F.conv*d`` / ``torch.conv*d`` in a forward.

A model hands convgrad a convolution in one of three ways: a ``convgrad.nn`` module or a torch.nn conv module that
``patch()`` gave a convgrad class (both call ``convgrad.autograd.calls.apply``), or a call of ``F.conv*d`` inside
some module's own forward (a conv subclass such as timm's ``StdConv2d``, a blur pool, a modulated conv). The third
is reached with torch's function modes (``torch.overrides.TorchFunctionMode``): while a mode is on the stack, every
torch function call made on this thread goes to its ``__torch_function__`` first. convgrad has two kinds of mode,
both ``ReachMode``:

    routing  (``convgrad.nn``)          around a patched module's forward: its conv calls run through convgrad,
                                        with the module's backend
    capture  (``convgrad.per_sample``)  around a model's forward inside ``PerSampleGrads``: every layer function
                                        call (conv, linear, the norms, embedding) that a trainable parameter
                                        reaches records what its per-sample gradients need

They meet in ``dispatch``: a conv call reached by routing, or by ``apply`` itself while a mode is on the stack, is
handed to the capture mode when one is active, and then runs with convgrad's modes off the stack (``hidden``), so
that the operations convgrad runs inside (pads, its own convolutions) are never taken for the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.utils.parametrize as parametrize
from torch.overrides import TorchFunctionMode

from convgrad.errors import ConvgradTypeError

__all__ = ["CONV_FUNCTIONS", "ConvCall", "ReachMode", "active_capture", "bind_arguments", "class_layers", "dispatch",
           "hidden", "top_mode", "user_class"]

# torch's conv functions (torch.nn.functional's conv*d are the same objects) -> (spatial dims, transposed)
CONV_FUNCTIONS: dict[Callable[..., Any], tuple[int, bool]] = {
    torch.conv1d: (1, False), torch.conv2d: (2, False), torch.conv3d: (3, False),
    torch.conv_transpose1d: (1, True), torch.conv_transpose2d: (2, True), torch.conv_transpose3d: (3, True),
}
# their parameters after (input, weight), in torch's order, with torch's defaults
_CONV_PARAMS = ("bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS = (None, 1, 0, 1, 1)
_TRANSPOSE_PARAMS = ("bias", "stride", "padding", "output_padding", "groups", "dilation")
_TRANSPOSE_DEFAULTS = (None, 1, 0, 0, 1, 1)


@dataclass(frozen=True)
class ConvCall:
    """One convolution call, in ``aten.convolution``'s terms whatever function made it.

    Attributes:
        fn: the name for messages (``"conv2d"``, or the module's name for a module's call).
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``.
        weight: ``(C_out, C_in/groups, *k)``; transposed: ``(C_in, C_out/groups, *k)``.
        bias: ``(C_out,)`` or None.
        stride, padding, dilation, output_padding, groups: as the function took them (padding may be a string).
        transposed: whether it is a transposed convolution.
    """

    fn: str
    input: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    stride: Any
    padding: Any
    dilation: Any
    transposed: bool
    output_padding: Any
    groups: int

    @classmethod
    def parse(cls, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> ConvCall:
        """The call ``func(*args, **kwargs)`` of one of ``CONV_FUNCTIONS``, bound to torch's parameter names.

        Raises:
            TypeError: arguments torch's function would not bind (too many, unknown or repeated names).
        """
        n, transposed = CONV_FUNCTIONS[func]
        name = f"conv_transpose{n}d" if transposed else f"conv{n}d"
        params, defaults = (_TRANSPOSE_PARAMS, _TRANSPOSE_DEFAULTS) if transposed else (_CONV_PARAMS, _CONV_DEFAULTS)
        bound = bind_arguments(name, ("input", "weight", *params), defaults, args, kwargs)
        return cls(name, bound["input"], bound["weight"], bound["bias"], bound["stride"], bound["padding"],
                   bound["dilation"], transposed, bound.get("output_padding", 0), bound["groups"])

    def torch_call(self, func: Callable[..., Any]) -> torch.Tensor:
        """``func`` (the torch conv function this call was parsed from) on this call's arguments."""
        if self.transposed:
            return func(self.input, self.weight, self.bias, self.stride, self.padding, self.output_padding,
                        self.groups, self.dilation)  # type: ignore[no-any-return]
        return func(self.input, self.weight, self.bias, self.stride, self.padding, self.dilation,  # type: ignore
                    self.groups)

    @property
    def function(self) -> str:
        """The torch function's name (``conv2d``, ``conv_transpose1d``), whatever ``fn`` says for messages."""
        n = self.weight.dim() - 2
        return f"conv_transpose{n}d" if self.transposed else f"conv{n}d"

    def with_operands(self, weight: torch.Tensor, bias: torch.Tensor | None) -> ConvCall:
        """The same call with other weight and bias tensors (a capture's detached operands)."""
        return replace(self, weight=weight, bias=bias)


def bind_arguments(fn: str, names: tuple[str, ...], defaults: tuple[Any, ...], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments by name, as torch's function binds them: ``names`` in order, the last ``len(defaults)``
    optional with those defaults (torch's builtins have no signature ``inspect`` could read).

    Raises:
        TypeError: too many arguments, an unknown or repeated name, a required one missing.
    """
    if len(args) > len(names):
        raise ConvgradTypeError(f"{fn}: takes at most {len(names)} arguments ({len(args)} given)")
    bound = dict(zip(names, args))
    for key, value in kwargs.items():
        if key not in names or key in bound:
            raise ConvgradTypeError(f"{fn}: unexpected or repeated argument {key!r}")
        bound[key] = value
    required = names[:len(names) - len(defaults)]
    missing = [k for k in required if k not in bound]
    if missing:
        raise ConvgradTypeError(f"{fn}: missing argument(s) {missing}")
    return {**dict(zip(names[len(required):], defaults)), **bound}


class ReachMode(TorchFunctionMode):
    """Base of convgrad's function modes, the ones ``hidden`` takes off the stack; a capture overrides ``conv``."""

    captures = False  # whether this mode records conv calls (``conv``)

    def conv(self, call: ConvCall, forward: Callable[[ConvCall], torch.Tensor], backend: str | None) -> torch.Tensor:
        """Run ``forward(call)`` (or an equivalent call) and return its output; a capture records what it needs.
        ``backend``: the convgrad backend ``forward`` runs the call with, or None for torch's own function."""
        return forward(call)

    def torch_conv(self, func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
        """A call of one of ``CONV_FUNCTIONS`` that reached this mode itself (no routing took it): ``conv`` with
        torch's own function."""
        call = ConvCall.parse(func, args, kwargs)
        return self.conv(call, lambda c: c.torch_call(func), None)


def top_mode() -> Any:
    """The function mode on top of this thread's stack, or None (cheap: two calls into torch's C++)."""
    n = torch._C._len_torch_function_stack()
    return torch._C._get_function_stack_at(n - 1) if n else None


def active_capture() -> ReachMode | None:
    """The capture mode on this thread's stack, if any (the innermost)."""
    for i in reversed(range(torch._C._len_torch_function_stack())):
        mode = torch._C._get_function_stack_at(i)
        if isinstance(mode, ReachMode) and mode.captures:
            return mode
    return None


@contextlib.contextmanager
def hidden() -> Iterator[None]:
    """Take convgrad's modes off this thread's stack for the scope; any other mode (a user's) stays, in order."""
    n = torch._C._len_torch_function_stack()
    if not n:
        yield
        return
    modes = [torch._C._pop_torch_function_stack() for _ in range(n)][::-1]  # bottom first
    kept = [m for m in modes if not isinstance(m, ReachMode)]
    for m in kept:
        torch._C._push_on_torch_function_stack(m)
    try:
        yield
    finally:
        for _ in kept:
            torch._C._pop_torch_function_stack()
        for m in modes:
            torch._C._push_on_torch_function_stack(m)


def dispatch(call: ConvCall, forward: Callable[[ConvCall], torch.Tensor], backend: str) -> torch.Tensor:
    """Run a conv call that convgrad reached while a function mode is on the stack.

    The capture mode, if one is active, runs it (and records it); either way the computation runs with convgrad's
    modes hidden.

    Args:
        call: the call, with the name it is known by.
        forward: computes the call's output (convgrad's ``apply`` with ``backend``).
        backend: the backend's name, for a capture that reports it.

    Returns:
        What ``forward`` returns for the call (or for the capture's equivalent call).
    """
    capture = active_capture()
    with hidden():
        return forward(call) if capture is None else capture.conv(call, forward, backend)


def class_layers(module: torch.nn.Module) -> tuple[type, type | None]:
    """(the module's class below any parametrization, the parametrization's generated class or None)."""
    cls = type(module)
    if parametrize.is_parametrized(module):
        return cls.__bases__[0], cls  # parametrize always generates a single-base subclass
    return cls, None


def user_class(module: torch.nn.Module) -> type:
    """The module's class as the user knows it: below any parametrization, and the original of a class that
    ``convgrad.patch`` generated (for messages: ``StdConv2d``, not ``PatchedStdConv2d``)."""
    cls = class_layers(module)[0]
    # getattr, not vars(cls): torch.compile refuses a class's mappingproxy once the trace mutated a dict
    # (functional_call swapping parameters); only patch()'s generated classes define the attribute
    return getattr(cls, "_convgrad_patched_from", cls)  # type: ignore[no-any-return]
