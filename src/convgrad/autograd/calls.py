"""The public entry points: ``conv``, ``conv_transpose``, their fixed-rank forms, and ``apply``, which validates a
call and sends it through the native shortcut, the ExpandedWeights Function or the main Function."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

from convgrad import scopes
from convgrad.autograd.expanded import ExpandedConvFunction, unexpand
from convgrad.autograd.function import SCRIPT_UNSUPPORTED, ConvCore, ConvFunction, shape_of
from convgrad.autograd.shortcut import PARAMETER_TYPES, CallMemo, auto_state, memo_key, native_throughout, torch_conv
from convgrad.backends import Backend, get_backend, traceable_names
from convgrad.backends.native import forward as native_forward
from convgrad.checks import check_same_kind, check_tensor, check_untraced
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.reach import ConvCall, dispatch
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg

# a function mode on the stack (convgrad.reach) gets every call first; one C call when there is none
_function_modes = torch._C._len_torch_function_stack

__all__ = ["apply", "conv", "conv1d", "conv2d", "conv3d", "conv_transpose", "conv_transpose1d", "conv_transpose2d",
           "conv_transpose3d"]


def _autocast(fn: str, backend: Backend, tensors: dict[str, Any]) -> dict[str, Any]:
    """Inside torch.autocast, cast float32 tensors to the autocast dtype, as native convolutions do.

    aten.convolution itself is not on autocast's cast list (only F.conv*d are), so the cast is ours;
    it is differentiable, so float32 leaves still receive float32 gradients. A backend that cannot compute
    in the autocast dtype is refused here, in terms of what the user passed.
    """
    devices = [t.device.type for t in tensors.values() if isinstance(t, torch.Tensor)]
    if not devices:
        return tensors
    device_type = devices[0]
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (TypeError, RuntimeError):  # torch < 2.4 (no device_type argument), or a device without autocast (meta)
        return tensors
    if not enabled:
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    cast = {k: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t
            for k, t in tensors.items()}
    for name, t in cast.items():
        if t is not tensors[name]:
            try:
                backend.check_operand(fn, name, t)
            except TypeError:
                raise ConvgradTypeError(f"{fn}: backend={backend.name!r} cannot run inside torch.autocast("
                                        f"{device_type!r}), which casts {name} (torch.float32) to a dtype this backend "
                                        f"does not compute in; run this call with torch.autocast({device_type!r}, "
                                        f"enabled=False) or use one of {traceable_names()}") from None
    return cast


# torch.compile of a torch.func transform (grad, vjp, ...) differentiates the forward and drops the Function's own
# backward (pytorch/pytorch#193279), so no_weight_gradients would be silently ignored: refuse instead. Without
# fullgraph=True Dynamo then runs the call eagerly, where the backward is honoured.
_NO_WEIGHT_GRADIENTS_UNDER_TRANSFORM = (
    "{fn}: no_weight_gradients() cannot act under torch.compile of a torch.func transform (grad, vjp, jacrev, "
    "...): the compiled transform differentiates the forward and skips convgrad's backward (pytorch/pytorch#193279), "
    "so the weights would silently get gradients; compile without the transform (loss.backward() or "
    "torch.autograd.grad inside torch.compile honour it), or run the transform eagerly")


# torch.export keeps an aten graph: what it records for a convgrad convolution is torch's own (issue 40, item 2)
_EXPORT_NOTE = (
    "{fn}: torch.export records torch's convolution (aten.convolution) for convgrad's convolutions, as for torch.nn: "
    "the exported program runs without convgrad, its gradients are torch autograd's, and no_weight_gradients() does "
    "not act on it (docs/backends.md, 'Under torch.compile, torch.export and TorchScript')")


# torch.compiler.is_exporting is newer than the oldest torch this package allows (2.2); without it, export goes through
# the Function as before
_is_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


@torch.compiler.assume_constant_result
def _note_export(fn: str) -> bool:
    """Warn that an exported program keeps torch's convolution. Strict export (Dynamo) drops a ``warnings.warn`` it
    traces; a function marked ``assume_constant_result`` it calls itself, at trace time, and records its result."""
    warnings.warn(_EXPORT_NOTE.format(fn=fn), UserWarning, stacklevel=3)
    return True


def apply(fn: str, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: IntOrTuple,
           padding: PaddingArg, dilation: IntOrTuple, transposed: bool, output_padding: IntOrTuple, groups: int,
           backend: str, memo: CallMemo | None = None, routed: bool = False, everywhere: bool = True) -> torch.Tensor:
    """Validate one convolution call and run it: every public entry point and every convgrad module comes here.

    In order: a function mode on the stack (``convgrad.reach``: a capture records the call) gets the call first;
    ExpandedWeights are unwrapped; every operand is checked against the backend, cast under autocast, and the
    spec is built from the shapes (sizes as traced values under torch.compile and torch.jit.trace). Then the call
    takes one of four roads: under torch.compile of a torch.func transform, the forward itself (Dynamo
    differentiates it); with an ExpandedWeight, the ExpandedWeights Function; where convgrad would run nothing but
    torch's own convolution, that convolution with torch's autograd node (``autograd.shortcut``, memoised per
    module in ``memo``); otherwise the main Function (``ConvCore`` while Dynamo traces).

    Args:
        fn: the name errors start with (``"conv2d"``, ``"Conv2d"``, ``"conv2d in StdConv2d.forward"``).
        input, weight, bias: as ``conv`` / ``conv_transpose`` take them.
        stride, padding, dilation, transposed, output_padding, groups: aten.convolution's arguments (padding may
            be a string or per-side pairs).
        backend: a registered backend's name.
        memo: the calling module's memo of its last native call, or None.
        routed: whether ``convgrad.reach.dispatch`` already handed this call on (so it is not handed on again).
        everywhere: False for a backend that ``patch()`` set model-wide without ``force=True``: where the
            backend's cost model rules it out (``Backend.can_serve``), torch's own convolution runs instead.

    Returns:
        ``(N, C_out, *out)``, or ``(C_out, *out)`` for an unbatched input.

    Raises:
        ValueError, TypeError: as ``conv`` (the message starts with ``fn``).
    """
    if not routed and _function_modes():
        call = ConvCall(fn, input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
        return dispatch(call, functools.partial(_handed_on, backend, memo, everywhere), backend)
    b = get_backend(backend, fn)
    if type(weight) in PARAMETER_TYPES and (bias is None or type(bias) in PARAMETER_TYPES):
        expanded = None  # neither is an ExpandedWeight (a subclass)
    else:
        weight, bias, expanded = unexpand(fn, input, weight, bias)
    tensors = {"input": input, "weight": weight} | ({} if bias is None else {"bias": bias})
    for name, t in tensors.items():  # before autocast: an error names the dtype the user passed
        b.check_operand(fn, name, check_tensor(fn, name, t))
    if torch._C._is_any_autocast_enabled():
        tensors = _autocast(fn, b, tensors)  # then the rest: autocast mixes float32 and bfloat16 operands
        input, weight, bias = tensors["input"], tensors["weight"], tensors.get("bias")
    # what check_tensors adds to the checks of each tensor above (a cast one was checked by _autocast)
    check_same_kind(fn, tensors)
    if not b.differentiable:
        check_untraced(fn, b, tensors, returns_gradients=False)
    compiling = torch.compiler.is_compiling()
    transformed = compiling and torch._C._are_functorch_transforms_active()
    if transformed and scopes.weight_gradients_disabled:
        raise ConvgradValueError(_NO_WEIGHT_GRADIENTS_UNDER_TRANSFORM.format(fn=fn))
    # torch.jit.trace gives sizes as tensors, Dynamo traces a tuple best: shape_of there, else the sizes as they are.
    # torch._C's query, not torch.jit.is_tracing (two Python frames): Dynamo, for which compiling is True, never
    # meets it
    sized = compiling or torch._C._is_tracing()
    spec = ConvSpec.from_shapes(shape_of(input) if sized else input.shape, shape_of(weight) if sized else weight.shape,
                                stride, padding, dilation, transposed, output_padding, groups, fn=fn,
                                memo=not compiling)
    if bias is not None and (shape_of(bias) if sized else bias.shape) != (spec.out_channels,):
        raise ConvgradValueError(f"{fn}: bias.shape={shape_of(bias)} must be (out_channels,)=({spec.out_channels},)")
    if not everywhere and not b.can_serve(spec, input):
        _keep_native(b.name, spec)
        backend, b = "native", get_backend("native")
    exporting = compiling and _is_exporting()
    if exporting:
        _note_export(fn)
    if transformed or exporting:
        # Dynamo differentiates the forward of a transformed Function anyway (pytorch/pytorch#193279), and cannot
        # vmap its wrapper (ApplyTemplate) where one conv feeds another: trace the forward itself. torch.export
        # records torch's convolution, as for torch.nn: strict export traced the Function's forward under no_grad
        # (the program's weights got no gradient), and neither mode could hold a spec of symbolic sizes
        if spec.unbatched:
            return native_forward(spec, input.unsqueeze(0), weight, bias).squeeze(0)  # (C_out, *o)
        return native_forward(spec, input, weight, bias)
    if expanded is not None:
        return ExpandedConvFunction.apply(input, weight, bias, spec, backend, expanded)  # (N, C_out, *o)
    if not compiling and native_throughout(spec, backend, input, weight, bias):
        args = spec.aten_args
        if memo is not None and not torch._C._is_any_autocast_enabled():
            memo.key = memo_key(input, weight, bias)
            memo.hyper = (stride, padding, dilation, transposed, output_padding, groups, backend)
            memo.auto, memo.spec, memo.args = auto_state(backend), spec, args
        return torch_conv(spec, input, weight, bias, args)
    cls = ConvCore if compiling else ConvFunction
    if spec.unbatched:
        return cls.apply(input.unsqueeze(0), weight, bias, spec, backend).squeeze(0)  # (C_out, *o)
    return cls.apply(input, weight, bias, spec, backend)


def _handed_on(backend: str, memo: CallMemo | None, everywhere: bool, call: ConvCall) -> torch.Tensor:
    """``apply`` of a call that ``dispatch`` handed on (possibly with a capture's detached operands)."""
    return apply(call.fn, call.input, call.weight, call.bias, call.stride, call.padding, call.dilation,
                 call.transposed, call.output_padding, call.groups, backend, memo, routed=True, everywhere=everywhere)


_kept_native: set[tuple[str, str]] = set()  # (backend, layer) already warned about


def _keep_native(backend: str, spec: ConvSpec) -> None:
    """Say once per backend and layer that patch()'s model-wide backend leaves this layer to torch's own conv."""
    layer = spec.describe()
    if (backend, layer) in _kept_native:
        return
    _kept_native.add((backend, layer))
    warnings.warn(f"patch(backend={backend!r}): {backend}'s cost model rules it out on {layer} (it cannot beat "
                  f"torch's own kernel there), so torch's convolution runs this layer; patch(model, "
                  f"backend={backend!r}, force=True) runs {backend} on every layer", UserWarning, stacklevel=4)


def conv(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrTuple = 1,
         padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1, backend: str = "auto") -> torch.Tensor:
    """N-d convolution (1d/2d/3d from the weight) whose backward runs through ``backend``.

    Args:
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; floating dtype.
        weight: ``(C_out, C_in/groups, *k)``, same dtype and device.
        bias: ``(C_out,)`` or None (default).
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple, ``(lo, hi)`` pairs, ``'same'`` (any stride, TF/JAX rule) or ``'valid'`` (default 0).
        groups: int (default 1).
        backend: one of ``convgrad.backends()`` (default ``"auto"``).

    Returns:
        ``(N, C_out, *out)`` with ``out = floor((i + p_lo + p_hi - d(k-1) - 1)/s) + 1`` per dim.

    Raises:
        TypeError, ValueError: as ``convgrad.conv_backward``.

    Source: the docs' "Derivation" page; higher derivatives come from autograd through the backward.

    Examples:
        >>> import torch, convgrad as cg
        >>> x = torch.randn(2, 4, 9, 9, dtype=torch.float64, requires_grad=True)
        >>> w = torch.randn(6, 2, 3, 3, dtype=torch.float64, requires_grad=True)
        >>> y = cg.conv(x, w, stride=2, padding="same", groups=2, backend="fwdconv")
        >>> y.shape
        torch.Size([2, 6, 5, 5])
        >>> torch.autograd.gradcheck(lambda a, b: cg.conv(a, b, stride=2, groups=2, backend="fwdconv"), (x, w))
        True
    """
    return apply("conv", input, weight, bias, stride, padding, dilation, False, 0, groups, backend)


def conv_transpose(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   stride: IntOrTuple = 1, padding: PaddingArg = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                   dilation: IntOrTuple = 1, backend: str = "auto") -> torch.Tensor:
    """N-d transposed convolution whose backward runs through ``backend`` (torch.nn.functional order).

    Args:
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; floating dtype.
        weight: ``(C_in, C_out/groups, *k)``, same dtype and device.
        bias: ``(C_out,)`` or None (default).
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple or ``(lo, hi)`` pairs cropped from the output (default 0); 'same' is rejected.
        output_padding: int or N-tuple, each < max(stride, dilation) (default 0).
        groups: int (default 1).
        backend: one of ``convgrad.backends()`` (default ``"auto"``).

    Returns:
        ``(N, C_out, *out)`` with ``out = (i-1)s - p_lo - p_hi + d(k-1) + output_padding + 1`` per dim.

    Raises:
        TypeError, ValueError: as ``convgrad.conv_backward``.

    Source: the docs' "Derivation" page, "transposed convolutions".

    Examples:
        >>> import torch, convgrad as cg
        >>> x, w = torch.randn(1, 4, 5, 5), torch.randn(4, 3, 3, 3)
        >>> cg.conv_transpose(x, w, stride=2, padding=1, output_padding=1).shape
        torch.Size([1, 3, 10, 10])
    """
    return apply("conv_transpose", input, weight, bias, stride, padding, dilation, True, output_padding, groups,
                  backend)


def _fixed_rank(n: int, transposed: bool) -> Any:
    """torch.nn.functional.conv{n}d / conv_transpose{n}d signatures plus backend=, checking the rank."""
    name = f"conv_transpose{n}d" if transposed else f"conv{n}d"

    def check(weight: Any) -> None:
        if isinstance(weight, torch.Tensor) and weight.dim() != n + 2:
            raise ConvgradValueError(f"{name}: weight.shape={tuple(weight.shape)} must have {n + 2} dims")

    if transposed:
        def f(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, stride: IntOrTuple = 1,
              padding: PaddingArg = 0, output_padding: IntOrTuple = 0, groups: int = 1, dilation: IntOrTuple = 1,
              backend: str = "auto") -> torch.Tensor:
            check(weight)
            return apply(name, input, weight, bias, stride, padding, dilation, True, output_padding, groups, backend)
    else:
        def f(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,  # type: ignore[misc]
              stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1,
              backend: str = "auto") -> torch.Tensor:
            check(weight)
            return apply(name, input, weight, bias, stride, padding, dilation, False, 0, groups, backend)

    f.__name__ = f.__qualname__ = name
    base = "conv_transpose" if transposed else "conv"
    f.__doc__ = (f"torch.nn.functional.{name} with backend=; see ``convgrad.{base}`` "
                 f"for shapes, errors and the source.")
    return f


conv1d, conv2d, conv3d = (_fixed_rank(n, False) for n in (1, 2, 3))
conv_transpose1d, conv_transpose2d, conv_transpose3d = (_fixed_rank(n, True) for n in (1, 2, 3))

# torch.jit.script(f) raises "TorchScript error: <this>" for a function carrying it (as torch.autocast's decorator
# does), and so does scripting code that calls one
for _f in (conv, conv_transpose, conv1d, conv2d, conv3d, conv_transpose1d, conv_transpose2d, conv_transpose3d):
    setattr(_f, "__script_unsupported", SCRIPT_UNSUPPORTED.format(fn=f"{_f.__name__}: torch.jit.script"))
del _f
