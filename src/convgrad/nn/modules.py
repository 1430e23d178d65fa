"""Drop-in conv modules whose backward runs through a convgrad backend.

``convgrad.nn.Conv2d`` *is a* ``torch.nn.Conv2d`` (same constructor, parameters,
state_dict and repr) plus ``backend=``; its forward calls ``convgrad.conv``.
One mixin, ``ConvgradMixin``, holds all the behaviour; the six public classes
only combine it with their torch base (``DROP_IN``), and ``convgrad.nn.patch``
puts it into the classes of an existing model's conv modules.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor

from convgrad import scopes
from convgrad.autograd.calls import apply
from convgrad.autograd.function import SCRIPT_UNSUPPORTED, shape_of
from convgrad.autograd.shortcut import CallMemo, memo_key, torch_conv
from convgrad.backends import get_backend
from convgrad.backends.auto import dynamo_compiling
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.reach import active_capture, user_class
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import pad
from convgrad.tuning import modes as tuning_modes

__all__ = ["DROP_IN", "EVERYWHERE", "TORCH_CONVS", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
           "ConvTranspose3d", "ConvgradMixin"]

# looked up once: the memo check asks them on every call of every module. The compile check comes before the tracing
# one, so Dynamo, for which it is True, never meets torch._C._is_tracing (torch.jit.is_tracing without its two Python
# frames). Dynamo's own query (auto's, one frame): the memo must not serve while Dynamo traces (a node hook is not
# traceable); the rest of what is_compiling() counts (non-strict export, AOTAutograd's tracing) runs on tensor
# subclasses, which memo_key refuses
_is_compiling = dynamo_compiling
_is_tracing = torch._C._is_tracing
_autocast_enabled = torch._C._is_any_autocast_enabled
# a capture mode (convgrad.reach: PerSampleGrads) must see every call; routing (a patched parent's forward) and a
# user's mode see torch's convolution of the memo as they would see it anyway
_function_modes = torch._C._len_torch_function_stack
# auto's memo_state inline (a call of it costs a Python frame on every call of every auto layer): same two values
_get_num_threads = torch.get_num_threads


class ConvgradMixin:
    """What every convgrad conv module adds to its torch base: ``backend`` and a forward through convgrad.

    Sits right before the torch class in the MRO, so it overrides exactly the torch
    methods that run the convolution: ``_conv_forward`` (forward convs) and ``forward``
    (transposed convs, whose torch forward calls F.conv_transposeNd directly).
    """

    backend: str = "auto"  # class default: unpickled or freshly patched modules read it until set
    # provided by the torch base class
    transposed: bool
    stride: tuple[int, ...]
    padding: Any
    dilation: tuple[int, ...]
    output_padding: tuple[int, ...]
    groups: int
    padding_mode: str
    kernel_size: tuple[int, ...]
    weight: Tensor
    bias: Tensor | None

    def __init__(self, *args: Any, backend: str = "auto", **kwargs: Any) -> None:
        name = type(self).__name__
        get_backend(backend, name)
        torch_init = super().__init__  # type: ignore[misc]
        bound = inspect.signature(torch_init).bind(*args, **kwargs)
        padding = bound.arguments.get("padding", 0)
        same = isinstance(padding, str) and padding == "same"
        if same and issubclass(type(self), torch.nn.modules.conv._ConvTransposeNd):
            raise ConvgradValueError(f"{name}: padding='same' is not defined for a transposed convolution")
        if same:
            # torch's constructor refuses 'same' with stride > 1; ConvSpec resolves it per input size (TF/JAX rule)
            bound.arguments["padding"] = 0
        torch_init(*bound.args, **bound.kwargs)
        if same:
            self.padding = "same"
        self.backend = backend

    def _name(self) -> str:
        """The module's class as the user knows it, for error messages: ``Conv2d`` for a patched
        torch.nn.Conv2d, not the generated ``PatchedConv2d`` (nor a parametrization's class)."""
        return user_class(self).__name__  # type: ignore[arg-type]

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Forward conv through convgrad; non-zero padding modes pad explicitly by the spec's (lo, hi) pairs."""
        # The last call's validation serves this one (torch's convolution, see autograd.shortcut) where nothing it
        # depends on changed: the very hyperparameter objects, the operands' key, auto's state; never under
        # no_weight_gradients, autocast, Dynamo, a capture mode or jit's tracer. Inline (one caller) and reading the
        # module's own attributes from its __dict__: Module's __getattr__ makes each attribute read a slot wrapper's
        # call, several times a dict lookup; a missing one (None) just validates
        attrs = self.__dict__
        memo = attrs.get("_convgrad_memo")
        if (memo is not None and memo.key is not None and attrs.get("padding_mode") == "zeros"
                and not (scopes.weight_gradients_disabled or _autocast_enabled() or _is_compiling()
                         or (_function_modes() and active_capture() is not None) or _is_tracing())):
            hyper, backend = memo.hyper, attrs.get("backend")
            # transposed and output_padding (hyper[3], hyper[4]) are False and 0 on every call that fills this memo
            if (hyper[0] is attrs.get("stride") and hyper[1] is attrs.get("padding")
                    and hyper[2] is attrs.get("dilation") and hyper[5] is attrs.get("groups") and hyper[6] is backend
                    and memo_key(input, weight, bias) == memo.key
                    and (backend != "auto" or memo.auto == (tuning_modes.generation, _get_num_threads()))):
                try:
                    return torch_conv(memo.spec, input, weight, bias, memo.args)
                except RuntimeError:  # an operand memo_key leaves to torch does not fit: validate, for convgrad's error
                    pass
        name, padding = self._name(), self.padding
        if self.padding_mode != "zeros":
            # the pads of 'same' depend on the input size, so they come from the spec at call time
            spec = ConvSpec.from_shapes(shape_of(input), shape_of(weight), self.stride, self.padding, self.dilation,
                                        groups=self.groups, fn=name, memo=not _is_compiling())  # as apply's
            input = pad(input, spec.padding, mode=self.padding_mode)  # (N, C_in, *(i + p_lo + p_hi))
            padding = 0
        if memo is None:
            memo = self.__dict__["_convgrad_memo"] = CallMemo()
        return apply(name, input, weight, bias, self.stride, padding, self.dilation, False, 0, self.groups,
                     self.backend, memo if self.padding_mode == "zeros" else None,
                     everywhere=attrs.get(EVERYWHERE, True))

    def forward(self, input: Tensor, output_size: list[int] | None = None) -> Tensor:
        """torch's forward; ``output_size`` (transposed convs only) picks output_padding as torch does."""
        if not self.transposed:
            if output_size is not None:
                raise ConvgradTypeError(f"{self._name()}.forward: output_size is only for transposed convolutions")
            # torch's Conv{1,2,3}d.forward is exactly this line; calling it here saves a frame and super() per call
            return self._conv_forward(input, self.weight, self.bias)
        name = self._name()
        if self.padding_mode != "zeros":
            raise ConvgradValueError(f"{name}: padding_mode={self.padding_mode!r}; a transposed convolution "
                                     f"supports only 'zeros' (as in torch)")
        n = len(self.kernel_size)
        output_padding = self._output_padding(  # type: ignore[attr-defined]  # torch's rule and its errors
            input, output_size, self.stride, self.padding, self.kernel_size, n, self.dilation)
        return apply(name, input, self.weight, self.bias, self.stride, self.padding, self.dilation, True,
                     output_padding, self.groups, self.backend, everywhere=self.__dict__.get(EVERYWHERE, True))

    def __prepare_scriptable__(self) -> Any:
        """torch.jit.script calls this first: refuse with the ways that work (a TorchScript graph cannot hold the
        Python backward of convgrad's autograd.Function)."""
        raise ConvgradTypeError(SCRIPT_UNSUPPORTED.format(fn=f"{self._name()}: torch.jit.script"))

    def extra_repr(self) -> str:
        s: str = super().extra_repr()  # type: ignore[misc]
        return s if self.backend == "auto" else f"{s}, backend={self.backend!r}"



_SHAPE_DOC = {
    False: ("(N, C_out, *out)`` with ``out = floor((i + p_lo + p_hi - dilation*(k-1) - 1) / stride) + 1`` per "
            "dim; for ``padding='same'``, ``out = ceil(i / stride)``",
            "(out_channels, in_channels/groups, *kernel_size)"),
    True: ("(N, C_out, *out)`` with ``out = (i-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1`` "
           "per dim (output_padding chosen from ``output_size`` when given)",
           "(in_channels, out_channels/groups, *kernel_size)"),
}


def _doc(n: int, transposed: bool) -> str:
    name = f"ConvTranspose{n}d" if transposed else f"Conv{n}d"
    out, weight = _SHAPE_DOC[transposed]
    if transposed:
        args = ", ".join(["5"] * n)
        example = (f'        >>> m = cg.nn.{name}(4, 2, 3, stride=2, padding=1, backend="fwdconv")\n'
                   f"        >>> m(torch.randn(1, 4, {args}), output_size=[{', '.join(['10'] * n)}]).shape\n"
                   f"        torch.Size([1, 2, {', '.join(['10'] * n)}])\n")
        padding_doc = "int or tuple (default 0); 'same' raises ValueError"
    else:
        example = (f'        >>> m = cg.nn.{name}(2, 4, 3, stride=2, padding="same", backend="fwdconv")\n'
                   f"        >>> m(torch.randn(1, 2, {', '.join(['9'] * n)})).shape\n"
                   f"        torch.Size([1, 4, {', '.join(['5'] * n)}])\n"
                   f"        >>> torch.nn.{name}(2, 4, 3).load_state_dict(m.state_dict())\n"
                   f"        <All keys matched successfully>\n")
        padding_doc = "int, tuple, 'valid' or 'same' (default 0); 'same' also with stride > 1 (TF/JAX rule)"
    return f"""torch.nn.{name} whose backward runs through a convgrad backend.

    Same constructor, parameters and state_dict as ``torch.nn.{name}``, plus ``backend``.

    Args:
        in_channels, out_channels, kernel_size, stride, dilation, groups, bias, device, dtype: as torch.nn.{name}.
        padding: {padding_doc}.
        {"output_padding: int or tuple, each < max(stride, dilation) (default 0)." if transposed else
         "padding_mode: 'zeros' (default), 'reflect', 'replicate' or 'circular'."}
        backend: keyword only, one of ``convgrad.backends()`` (default ``"auto"``).

    Shape:
        - Input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)`` with {n} spatial dims of size ``i``.
        - Output: ``{out}.

    Attributes:
        weight: ``{weight}``, initialised exactly as torch's.
        bias: ``(out_channels,)`` or None.
        backend: the backend of the backward; may be reassigned.

    Raises:
        ValueError, TypeError: torch's constructor errors; an unknown backend; at forward time, the
            errors of ``convgrad.conv`` (or
            ``convgrad.conv_transpose`` for the transposed modules),
            named after the module (``{name}: ...``).

    Source: the docs' "Derivation" page; torch/nn/modules/conv.py for the constructor and output_size rule.

    Examples:
        >>> import torch, convgrad as cg
{example}    """


def _drop_in(n: int, transposed: bool) -> Any:
    """Class decorator: the docstring and the signature (torch's constructor + backend=) of a public class."""

    def decorate(cls: type) -> type:
        cls.__doc__ = _doc(n, transposed)
        torch_sig = inspect.signature(cls.__mro__[2].__init__)
        params = [*list(torch_sig.parameters.values())[1:],
                  inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY, default="auto", annotation="str")]
        cls.__signature__ = torch_sig.replace(parameters=params)  # type: ignore[attr-defined]
        return cls

    return decorate


@_drop_in(1, False)
class Conv1d(ConvgradMixin, torch.nn.Conv1d):
    pass


@_drop_in(2, False)
class Conv2d(ConvgradMixin, torch.nn.Conv2d):
    pass


@_drop_in(3, False)
class Conv3d(ConvgradMixin, torch.nn.Conv3d):
    pass


@_drop_in(1, True)
class ConvTranspose1d(ConvgradMixin, torch.nn.ConvTranspose1d):
    pass


@_drop_in(2, True)
class ConvTranspose2d(ConvgradMixin, torch.nn.ConvTranspose2d):
    pass


@_drop_in(3, True)
class ConvTranspose3d(ConvgradMixin, torch.nn.ConvTranspose3d):
    pass


# on a module: False where patch() set its backend model-wide without force=True (``apply``'s ``everywhere``)
EVERYWHERE = "_convgrad_everywhere"
# torch base -> its convgrad drop-in; the six torch classes are siblings, so a module derives from at most one
DROP_IN: dict[type, type] = {c.__mro__[2]: c for c in (Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d,
                                                      ConvTranspose3d)}
TORCH_CONVS = tuple(DROP_IN)
