"""patch() and unpatch(): an existing model's convolutions through convgrad, in place, however its forwards call them.

``patch`` swaps the ``__class__`` of two kinds of module for a generated subclass, so that every Parameter, buffer,
hook and optimizer entry stays the very same object:

- a torch.nn conv module (``Conv{1,2,3}d``, ``ConvTranspose{1,2,3}d`` or a subclass): the mixin of the drop-in
  modules (``convgrad.nn.modules.ConvgradMixin``) right above its torch base, so torch's own forward (and a
  subclass's call of torch's conv-forward method) runs through convgrad;
- a module whose class has a forward of its own, written outside torch (a conv subclass such as timm's
  ``StdConv2d`` or ``Conv2dSame``, a block that calls ``F.conv2d`` on a blur kernel, a modulated conv, the model
  itself): its forward runs inside a routing mode (``Routing``, see ``convgrad.reach``), so every ``F.conv*d`` /
  ``torch.conv*d`` call it makes, with whatever weight it computed, runs through convgrad with the patch's backend.

Routing is one mode per thread: a routed forward inside another reuses the mode on top of the stack and only
changes the module it answers for, so an operation pays one ``__torch_function__`` call however deep the module
nesting. A parametrization's generated class (weight_norm, spectral_norm) stays the outermost class, as
``torch.nn.utils.parametrize`` requires.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch
from torch import Tensor

from convgrad.autograd.calls import apply
from convgrad.backends import get_backend
from convgrad.checks import check_module
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.nn.modules import DROP_IN, EVERYWHERE, TORCH_CONVS, ConvgradMixin
from convgrad.reach import CONV_FUNCTIONS, ConvCall, ReachMode, class_layers, dispatch, top_mode, user_class

__all__ = ["PatchedBase", "RoutedBase", "Routing", "backend_of", "patch", "patched_class", "routes_forward",
           "unpatch"]

_BACKEND = "_convgrad_backend"  # where a routed module that is no conv keeps the patch's backend


def backend_of(module: torch.nn.Module) -> str:
    """The backend of a patched module: a conv's ``backend``, or the one patch() gave a routed module."""
    if isinstance(module, ConvgradMixin):
        return module.backend
    return module.__dict__.get(_BACKEND, "auto")


def _routed(backend: str, everywhere: bool, call: ConvCall) -> Tensor:
    """A routed conv call through convgrad's entry point (``dispatch`` has hidden the modes)."""
    return apply(call.fn, call.input, call.weight, call.bias, call.stride, call.padding, call.dilation,
                 call.transposed, call.output_padding, call.groups, backend, routed=True, everywhere=everywhere)


class Routing(ReachMode):
    """The routing mode: the conv calls of the patched module whose forward runs, through convgrad with its backend.

    Args:
        module: the routed module whose forward is running (changed by nested routed forwards, see the module doc).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in CONV_FUNCTIONS:
            return func(*args, **kwargs)
        call = ConvCall.parse(func, args, kwargs)
        module = self.module
        named = ConvCall(f"{call.fn} in {user_class(module).__name__}.forward", *_operands(call))
        backend = backend_of(module)
        everywhere = module.__dict__.get(EVERYWHERE, True)
        return dispatch(named, functools.partial(_routed, backend, everywhere), backend)


def _operands(call: ConvCall) -> tuple[Any, ...]:
    return (call.input, call.weight, call.bias, call.stride, call.padding, call.dilation, call.transposed,
            call.output_padding, call.groups)


class PatchedBase:
    """First base of every class patch() generates: pickles the instance as "patched(original class)"."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        # patch()'s generated classes are not importable by name
        original = type(self).__dict__.get("_convgrad_patched_from")
        reduced = super().__reduce_ex__(protocol)
        if original is None:
            return reduced
        return (_new_patched, (original,), *reduced[2:])


class RoutedBase(PatchedBase):
    """Base of a generated class whose forward (made by ``patched_class``, with the original's signature) runs the
    original forward inside the routing mode."""

    def _get_name(self) -> str:  # torch's repr: the class the user wrote, a routed module claims no backend
        return type(self).__dict__.get("_convgrad_patched_from", type(self)).__name__


def _run_routed(module: torch.nn.Module, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``forward(*args, **kwargs)`` (the module's original forward) inside the routing mode."""
    top = top_mode()
    if isinstance(top, Routing):  # an enclosing routed forward: answer for this module while it runs
        outer, top.module = top.module, module
        try:
            return forward(*args, **kwargs)
        finally:
            top.module = outer
    with Routing(module):
        return forward(*args, **kwargs)


def routes_forward(cls: type) -> bool:
    """Whether ``cls`` has a forward of its own, written outside torch and convgrad, which patch() routes."""
    module = getattr(getattr(cls, "forward", None), "__module__", None) or ""
    return not (module == "torch" or module.startswith(("torch.", "convgrad.")))


@functools.cache
def patched_class(original: type) -> type:
    """The class patch() gives a module of class ``original``: the conv mixin right above its torch base (after any
    user subclass) for a conv, and a routed forward first where ``original`` has a forward of its own."""
    torch_base = next((c for c in original.__mro__ if c in DROP_IN), None)
    if torch_base is None:
        bases: tuple[type, ...] = (original,)
    else:
        bases = (DROP_IN[torch_base],) if original is torch_base else (original, DROP_IN[torch_base])
    routed = routes_forward(original)
    namespace: dict[str, Any] = {"_convgrad_patched_from": original, "__module__": __name__,
                                 "__doc__": original.__doc__}
    if routed and torch_base is not None:  # a conv's repr names its patched class, as before
        namespace["_get_name"] = lambda self: type(self).__name__
    cls = type(f"Patched{original.__name__}", ((RoutedBase if routed else PatchedBase), *bases), namespace)
    if routed:
        def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            return _run_routed(self, super(cls, self).forward, args, kwargs)

        # the original's name, doc and signature (torch.export binds dynamic_shapes to forward's parameters)
        cls.forward = functools.wraps(original.forward)(forward)  # type: ignore[attr-defined]
    return cls


def _new_patched(original: type) -> Any:
    """Unpickling helper: an empty instance of the patched class of ``original``."""
    return object.__new__(patched_class(original))  # Module has no __new__ of its own


def _set_class(module: torch.nn.Module, inner: type, outer: type | None) -> None:
    """Give module the class ``inner``, or, under a parametrization, a copy of ``outer`` rebuilt on ``inner``."""
    if outer is not None:
        # the copy keeps the properties parametrize injected; the name follows parametrize's "Parametrized<inner>"
        namespace = {k: v for k, v in vars(outer).items() if k not in ("__dict__", "__weakref__")}
        old_name = f"Parametrized{outer.__bases__[0].__name__}"
        name = f"Parametrized{inner.__name__}" if outer.__name__ == old_name else outer.__name__
        inner = type(name, (inner,), {**namespace, "__qualname__": name})
    module.__class__ = inner


def _patchable(module: torch.nn.Module) -> bool:
    """A torch conv (or subclass), or a module with a forward of its own; never a scripted module."""
    if isinstance(module, torch.jit.ScriptModule):
        return False
    return isinstance(module, TORCH_CONVS) or routes_forward(class_layers(module)[0])


def patch(model: torch.nn.Module, backend: str = "auto", force: bool = False) -> torch.nn.Module:
    """Make every convolution ``model`` runs compute its backward through convgrad, in place.

    Each ``torch.nn.Conv{1,2,3}d`` / ``ConvTranspose{1,2,3}d`` (or subclass) gets a generated subclass as its
    class, and so does every module whose class has a ``forward`` of its own (written outside torch): that forward
    then runs with its ``F.conv*d`` / ``torch.conv*d`` calls routed through convgrad, with the weight it passes
    (one it computed, such as a standardised weight, included). Modules, Parameters, buffers, hooks and optimizer
    state stay the very same objects. Modules that are already convgrad modules only get the new backend. Works
    under weight_norm / spectral_norm (both parametrizations and the old hook style). Other ``_ConvNd`` subclasses
    that derive from none of the six torch classes and have no forward of their own are left alone, and so are
    scripted modules; a model with nothing to patch is left as it is, with a warning.

    A backend other than ``"auto"`` runs where its cost model lets it in (``Backend.can_serve``, auto's rule for
    racing it) and torch's own convolution runs the other layers, with a warning naming each such layer once: fft
    on a 1x1 conv runs 20-90x slower than torch's kernel. ``force=True`` runs it on every layer.

    Args:
        model: any ``torch.nn.Module`` (a conv module itself included).
        backend: one of ``convgrad.backends()`` (default ``"auto"``).
        force: run ``backend`` on every layer, also where its cost model rules it out (default False).

    Returns:
        ``model`` itself.

    Raises:
        ValueError, TypeError: an unknown backend; an uninitialised lazy conv module; ``model`` not a
            ``torch.nn.Module``.

    Source: DESIGN.md, "Public API"; convgrad.reach for how functional calls are reached.

    Examples:
        >>> import torch, convgrad as cg
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, stride=2), torch.nn.ReLU())
        >>> weight = model[0].weight
        >>> cg.patch(model, backend="fwdconv")[0]
        PatchedConv2d(1, 4, kernel_size=(3, 3), stride=(2, 2), backend='fwdconv')
        >>> model[0].weight is weight, isinstance(model[0], torch.nn.Conv2d)
        (True, True)
        >>> type(cg.unpatch(model)[0]) is torch.nn.Conv2d
        True
    """
    get_backend(backend, "patch")
    check_module("patch", model)
    if not isinstance(force, bool):
        raise ConvgradTypeError(f"patch: force={force!r} must be a bool")
    patched = 0
    for name, module in model.named_modules():
        if not _patchable(module):
            continue
        patched += 1
        if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and module.has_uninitialized_params():
            raise ConvgradValueError(
                f"patch: module {name or type(module).__name__!r} is an uninitialised lazy module; "
                f"run one forward pass before patching")
        inner, outer = class_layers(module)
        if "_convgrad_patched_from" not in vars(inner) and not (isinstance(module, ConvgradMixin)
                                                                 and not routes_forward(inner)):
            _set_class(module, patched_class(inner), outer)
        if isinstance(module, ConvgradMixin):
            module.backend = backend
        else:
            module.__dict__[_BACKEND] = backend
        module.__dict__[EVERYWHERE] = force
    if not patched:
        warnings.warn(f"patch: {type(model).__name__} has no convolution module and no module with a forward of its "
                      f"own (whose F.conv*d calls patch routes), so nothing was patched", UserWarning, stacklevel=2)
    return model


def unpatch(model: torch.nn.Module) -> torch.nn.Module:
    """Undo ``patch``: give every patched module its original class back, in place.

    Modules built as ``convgrad.nn`` classes are not patches and stay as they are.

    Args:
        model: any ``torch.nn.Module``.

    Returns:
        ``model`` itself.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Source: DESIGN.md, "Public API".

    Examples:
        >>> import torch, convgrad as cg
        >>> m = cg.unpatch(cg.patch(torch.nn.ConvTranspose1d(2, 2, 3)))
        >>> type(m), hasattr(m, "backend")
        (<class 'torch.nn.modules.conv.ConvTranspose1d'>, False)
    """
    for module in check_module("unpatch", model).modules():
        inner, outer = class_layers(module)
        original = vars(inner).get("_convgrad_patched_from")
        if original is None:
            continue
        _set_class(module, original, outer)
        for attr in ("backend", _BACKEND, EVERYWHERE):
            module.__dict__.pop(attr, None)
    return model
