"""Convolutions as torch.autograd.Functions whose backward is computed by a chosen backend.

The forward is PyTorch's native convolution; with backend="auto" it is tuned like the backward (native unless a
backend's ``forward``, fft's for large kernels, beats it: ``convgrad.backends.auto.forward``). The backward calls the
backend's
explicit formulas, which are built from differentiable ops, so double and higher
backward passes come from autograd (as with JAX's transpose rules).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from convgrad.backends import Backend, backend_names, get_backend, traceable_names
from convgrad.backends.auto import changes as auto_changes
from convgrad.backends.auto import fixed as auto_fixed
from convgrad.backends.auto import forward as auto_forward
from convgrad.backends.auto import settled_native as auto_settled_native
from convgrad.backends.native import forward as native_forward
from convgrad.checks import check_tensor, check_tensors, check_untraced
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg
from convgrad.tensor_ops import bias_grad

__all__ = [
    "ConvFunction",
    "conv",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "no_weight_gradients",
]

# Every backend registered now, at import, not on the first lookup inside a compiled call: Dynamo traces the imports
# that lookup runs (pkgutil's posix.stat, with a warning), and they left captured tracebacks alive (issue 25, item 8)
backend_names()

_weight_gradients_disabled = 0

# TorchScript cannot compile a Python autograd.Function, so no convgrad convolution can be scripted
SCRIPT_UNSUPPORTED = (
    "{fn} cannot compile convgrad's convolutions: their backward is a Python autograd.Function, which TorchScript "
    "cannot hold; use torch.compile or torch.export (or torch.jit.trace, which records the Function), or "
    "convgrad.unpatch(model) before scripting to get torch's own convolutions back")


@contextlib.contextmanager
def no_weight_gradients() -> Iterator[None]:
    """Skip grad_weight of every convgrad convolution inside the scope (R1 / path-length penalties).

    Like NVIDIA's conv2d_gradfix: inside the scope, weights receive no gradient from
    convgrad convolutions, so only grad_input (and grad_bias) is computed.

    Examples:
        >>> import torch, convgrad as cg
        >>> x = torch.randn(1, 2, 5, 5, requires_grad=True)
        >>> w = torch.randn(3, 2, 3, 3, requires_grad=True)
        >>> with cg.no_weight_gradients():
        ...     gx, = torch.autograd.grad(cg.conv2d(x, w).sum(), [x])
        >>> w.grad is None
        True
    """
    global _weight_gradients_disabled
    _weight_gradients_disabled += 1
    try:
        yield
    finally:
        _weight_gradients_disabled -= 1


class _ConvCore(torch.autograd.Function):
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
        need_weight = need_weight and not _weight_gradients_disabled
        backend = get_backend(ctx.backend, "ConvFunction.backward")
        gi = gw = None
        if need_input or need_weight:
            if not backend.differentiable:
                _check_differentiation(ctx.spec.fn, backend, grad_output=grad_output, input=input, weight=weight)
            gi, gw = backend.gradients(ctx.spec, grad_output, input, weight, need_input, need_weight)
        gb = bias_grad(grad_output) if need_bias else None
        return gi, gw, gb, None, None


# torch.autograd.Function.apply binds its arguments with inspect.signature(forward) on every call (as it does for any
# Function with a setup_context); a signature stored on the function is returned as it is instead of being rebuilt
# from the code object (about 50 us of a 100 us conv of the demo's network).
_ConvCore.forward.__signature__ = inspect.signature(_ConvCore.forward)  # type: ignore[attr-defined]


class ConvFunction(_ConvCore):
    """conv / conv_transpose (per ``spec.transposed``) with a native forward and an explicit backward.

    ``apply(input, weight, bias, spec, backend)`` with batched tensors and a ``ConvSpec``.
    torch.func.vmap uses the generated rule; forward-mode AD (torch.func.jvp) uses the bilinearity
    of the convolution. Under torch.compile, ``conv`` applies the jvp-free parent instead.
    """

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
        _ConvCore.setup_context(ctx, inputs, output)
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


class _Expanded:
    """The ExpandedWeight operands of one call (torch.nn.utils._per_sample_grad, Opacus grad_sample_mode="ew"),
    held in an object the Function's apply does not look into (each is a tensor subclass that refuses every op)."""

    def __init__(self, weight: Any, bias: Any) -> None:
        self.weight, self.bias = weight, bias


class _ExpandedConvFunction(torch.autograd.Function):
    """A convolution with ExpandedWeight operands: the forward as ConvFunction's; the backward gives grad_input
    through the backend and, as torch's ExpandedWeights rules do, adds each per-sample gradient to the original
    parameter's ``grad_sample`` (times the batch for loss_reduction="mean"), leaving ``.grad`` alone."""

    @staticmethod
    def forward(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, spec: ConvSpec, backend: str,
                expanded: _Expanded) -> torch.Tensor:
        return _ConvCore.forward(input, weight, bias, spec, backend)

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


def _find_expanded_weight_type() -> Any:
    """torch's ExpandedWeight class, or None; typed Any: its orig_weight and batch_size are not in torch's stubs."""
    try:  # private to torch, and absent from some builds
        from torch.nn.utils._expanded_weights import ExpandedWeight
    except ImportError:
        return None
    return ExpandedWeight


# Looked up once, at import: an import statement inside a call is traced by Dynamo (importlib's posix.stat, with a
# warning), and after two torch._dynamo.explain calls and a reset it left 8 more captured tracebacks alive than
# torch's own conv_transpose2d (issue 25, item 8: a hang at exit in the release of a captured traceback)
_EXPANDED_WEIGHT = _find_expanded_weight_type()


def _expanded_weight_type() -> Any:
    """torch's ExpandedWeight class, or None."""
    return _EXPANDED_WEIGHT


def _unexpand(fn: str, input: Any, weight: Any, bias: Any) -> tuple[Any, Any, _Expanded | None]:
    """The original parameters behind ExpandedWeight operands, and the operands; (weight, bias, None) otherwise."""
    ew_type = _expanded_weight_type()
    if ew_type is None or not (isinstance(weight, ew_type) or isinstance(bias, ew_type)):
        return weight, bias, None
    for name, t in (("weight", weight), ("bias", bias)):
        if isinstance(t, torch.Tensor) and not isinstance(t, ew_type) and t.requires_grad:
            raise ConvgradValueError(
                f"{fn}: {name} requires grad but is not an ExpandedWeight while another operand is; "
                f"ExpandedWeights needs every parameter expanded")
    expanded = _Expanded(weight if isinstance(weight, ew_type) else None, bias if isinstance(bias, ew_type) else None)
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


def _check_differentiation(fn: str, backend: Backend, **tensors: torch.Tensor) -> None:
    """In the backward of a backend autograd cannot see through: no transform, no second derivative."""
    check_untraced(fn, backend, tensors, returns_gradients=False)
    if torch.is_grad_enabled():
        raise ConvgradValueError(f"{fn}: backend={backend.name!r} is not differentiable; a second derivative "
                                 f"(create_graph=True) needs one of {traceable_names()}")


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


def _native_throughout(spec: ConvSpec, backend: str, input: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None) -> bool:
    """Whether ConvFunction would compute nothing but torch's own convolution here: its forward and every gradient
    native (backend="native"; "auto" when fixed, or settled on native for this call), on operands torch's own
    autograd handles the same way. Then torch's convolution runs with its own autograd node (``_torch_conv``): the
    same kernels, values and layouts, without a Python Function's cost per call (a bare one costs about half a
    plain convolution's forward and backward on small layers).

    Through the Function stay: other backends; complex (aten has no complex kernels); per-side padding; layouts
    other than contiguous (native retries torch's "must be contiguous" refusals on copies); grad_weight skipped
    by ``no_weight_gradients`` in the forward's scope (a node hook honours a backward in the scope); torch.jit's
    tracer (a trace records the Function, so that no_weight_gradients still acts on the traced graph).
    """
    if backend == "native":
        pass
    elif backend != "auto":
        return False
    if (_weight_gradients_disabled or input.is_complex() or not spec.is_symmetric or not input.is_contiguous()
            or not weight.is_contiguous() or torch.jit.is_tracing()):
        return False
    if backend == "native" or auto_fixed():
        return True
    grad = torch.is_grad_enabled()
    return auto_settled_native(spec, input, weight, grad and input.requires_grad, grad and weight.requires_grad)


def _drop_weight_gradient(grad_inputs: tuple[Any, ...], grad_outputs: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Post-hook of a ``_torch_conv`` node: a backward inside ``no_weight_gradients`` gives the weight nothing."""
    if not _weight_gradients_disabled:
        return None
    return (grad_inputs[0], None, *grad_inputs[2:])


def _torch_conv(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                args: tuple[Any, ...] | None = None) -> torch.Tensor:
    """torch's convolution with its own autograd node (see ``_native_throughout``); ``args``: spec.aten_args."""
    batched = input.unsqueeze(0) if spec.unbatched else input  # (N, C_in, *i)
    out = torch.convolution(batched, weight, bias, *(spec.aten_args if args is None else args))  # (N, C_out, *o)
    if weight.requires_grad and out.grad_fn is not None:
        out.grad_fn.register_hook(_drop_weight_gradient)
    return out.squeeze(0) if spec.unbatched else out  # (C_out, *o) unbatched


_PARAMETER_TYPES = (torch.Tensor, torch.nn.Parameter)


class CallMemo:
    """What one call site (a convgrad module) validated on its last call that took torch's own convolution: the
    next call with the same operands' shapes, dtypes and devices, the same hyperparameter objects and backend, and
    an unchanged state of auto's choices, runs torch's convolution without validating again."""

    __slots__ = ("args", "auto", "hyper", "key", "spec")

    def __init__(self) -> None:
        self.key: tuple[Any, ...] | None = None

    def __reduce__(self) -> tuple[type, tuple[()]]:  # a copy or an unpickled module validates afresh
        return CallMemo, ()


def _memo_key(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> tuple[Any, ...] | None:
    """The operands' shapes, dtypes and devices; None where the memo must not serve (subclasses: ExpandedWeight,
    fake and traced tensors; layouts other than contiguous)."""
    if (type(input) is not torch.Tensor or type(weight) not in _PARAMETER_TYPES
            or (bias is not None and type(bias) not in _PARAMETER_TYPES)
            or not input.is_contiguous() or not weight.is_contiguous()):
        return None
    return (input.shape, input.dtype, input.device, weight.shape, weight.dtype, weight.device,
            None if bias is None else (bias.shape, bias.dtype, bias.device))


def _auto_state(backend: str) -> tuple[Any, ...] | None:
    """What a memoised answer of ``settled_native`` depends on, beyond the call: None where it does not apply."""
    if backend != "auto" or auto_fixed():
        return None
    return auto_changes(), torch.get_num_threads()


def _memoised(memo: CallMemo, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              hyper: tuple[Any, ...], backend: str) -> torch.Tensor | None:
    """torch's convolution when the memo serves this call, else None."""
    if (memo.key is None or _weight_gradients_disabled or torch._C._is_any_autocast_enabled()
            or torch.compiler.is_compiling() or torch.jit.is_tracing()):
        return None
    if (not all(map(operator.is_, memo.hyper, hyper)) or _memo_key(input, weight, bias) != memo.key
            or (backend == "auto" and _auto_state(backend) != memo.auto)):
        return None
    return _torch_conv(memo.spec, input, weight, bias, memo.args)


def _apply(fn: str, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: IntOrTuple,
           padding: PaddingArg, dilation: IntOrTuple, transposed: bool, output_padding: IntOrTuple, groups: int,
           backend: str, memo: CallMemo | None = None) -> torch.Tensor:
    b = get_backend(backend, fn)
    if type(weight) in _PARAMETER_TYPES and (bias is None or type(bias) in _PARAMETER_TYPES):
        expanded = None  # neither is an ExpandedWeight (a subclass)
    else:
        weight, bias, expanded = _unexpand(fn, input, weight, bias)
    tensors = {"input": input, "weight": weight} | ({} if bias is None else {"bias": bias})
    for name, t in tensors.items():  # before autocast: an error names the dtype the user passed
        b.check_operand(fn, name, check_tensor(fn, name, t))
    if torch._C._is_any_autocast_enabled():
        tensors = _autocast(fn, b, tensors)  # then the rest: autocast mixes float32 and bfloat16 operands
        input, weight, bias = tensors["input"], tensors["weight"], tensors.get("bias")
    check_tensors(fn, b, results_in_graph=True, **tensors)
    compiling = torch.compiler.is_compiling()
    transformed = compiling and torch._C._are_functorch_transforms_active()
    if transformed and _weight_gradients_disabled:
        raise ConvgradValueError(_NO_WEIGHT_GRADIENTS_UNDER_TRANSFORM.format(fn=fn))
    make = ConvSpec._validated if compiling else ConvSpec.from_shapes  # Dynamo breaks the graph on from_shapes's memo
    spec = make(shape_of(input), shape_of(weight), stride, padding, dilation, transposed, output_padding, groups,
                fn=fn)
    if bias is not None and shape_of(bias) != (spec.out_channels,):
        raise ConvgradValueError(f"{fn}: bias.shape={shape_of(bias)} must be (out_channels,)=({spec.out_channels},)")
    if transformed:
        # Dynamo differentiates the forward of a transformed Function anyway (pytorch/pytorch#193279), and cannot
        # vmap its wrapper (ApplyTemplate) where one conv feeds another: trace the forward itself
        if spec.unbatched:
            return native_forward(spec, input.unsqueeze(0), weight, bias).squeeze(0)  # (C_out, *o)
        return native_forward(spec, input, weight, bias)
    if expanded is not None:
        return _ExpandedConvFunction.apply(input, weight, bias, spec, backend, expanded)  # (N, C_out, *o)
    if not compiling and _native_throughout(spec, backend, input, weight, bias):
        args = spec.aten_args
        if memo is not None and not torch._C._is_any_autocast_enabled():
            memo.key = _memo_key(input, weight, bias)
            memo.hyper = (stride, padding, dilation, transposed, output_padding, groups, backend)
            memo.auto, memo.spec, memo.args = _auto_state(backend), spec, args
        return _torch_conv(spec, input, weight, bias, args)
    function = _ConvCore if compiling else ConvFunction
    if spec.unbatched:
        return function.apply(input.unsqueeze(0), weight, bias, spec, backend).squeeze(0)  # (C_out, *o)
    return function.apply(input, weight, bias, spec, backend)


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
    return _apply("conv", input, weight, bias, stride, padding, dilation, False, 0, groups, backend)


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
    return _apply("conv_transpose", input, weight, bias, stride, padding, dilation, True, output_padding, groups,
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
            return _apply(name, input, weight, bias, stride, padding, dilation, True, output_padding, groups, backend)
    else:
        def f(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,  # type: ignore[misc]
              stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1,
              backend: str = "auto") -> torch.Tensor:
            check(weight)
            return _apply(name, input, weight, bias, stride, padding, dilation, False, 0, groups, backend)

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
