"""Registry of the ways to compute a convolution's backward.

A backend is a class with ``input_grad`` and ``weight_grad`` (and optionally a
fused ``backward``) that receives a validated ``ConvSpec``
and batched tensors, never raw user arguments. Adding a backend means adding one
file here that defines a subclass of ``Backend`` decorated with ``register``: the
modules of this package are discovered on first use, and "auto" races every
registered backend whose ``can_serve`` says it may. Callers go through
``Backend.gradients``, which returns each gradient in the memory format
torch's own backward gives it (``memory_format.py``), so that no backend has to get layouts right by itself.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, TypeAlias, TypeVar

from convgrad.errors import ConvgradTypeError, ConvgradValueError

if TYPE_CHECKING:
    import torch

    from convgrad.spec import ConvSpec

__all__ = ["Backend", "FusedBackend", "backend_names", "get_backend", "register", "traceable_names"]

_REGISTRY: dict[str, Backend] = {}
_loaded = False  # not `not _REGISTRY`: importing one backend module directly registers it alone
_B = TypeVar("_B", bound="type[Backend]")
# (grad_input, grad_weight), None where not asked for; a string so that this module need not import torch
Grads: TypeAlias = "tuple[torch.Tensor | None, torch.Tensor | None]"


class Backend(ABC):
    """One formulation of the convolution backward.

    Tensors are batched, ``(N, C, *spatial)``, with dtype and device already checked (by
    ``check_operand`` among others). ``input_grad`` returns ``spec.input_shape``; ``weight_grad`` returns
    ``spec.weight_shape``, in any layout: callers go through ``gradients``, which lays them out as torch does.
    """

    name: ClassVar[str]
    # built from torch ops: autograd sees through it (second derivatives) and so do torch.func's transforms
    differentiable: ClassVar[bool] = True
    supports_complex: ClassVar[bool] = False
    # timed by `convgrad bench` when no --backends is given; off by default, so a backend meant for some layers
    # only (numpy, fft: the `large` suite) is not timed on every layer of the suite
    bench_by_default: ClassVar[bool] = False

    def can_serve(self, spec: ConvSpec, like: torch.Tensor) -> bool:
        """Whether "auto" should race this backend for this layer on tensors like ``like`` (grad_output, or the
        input of a forward): a cheap rule saying where it can differ from native. Default: everywhere; auto still
        times it and checks its result against native's."""
        return True

    def can_serve_forward(self, spec: ConvSpec, like: torch.Tensor) -> bool:
        """Whether "auto" should race this backend's ``forward`` (a backend that has one) for this layer: its
        ``can_serve`` unless a backend's forward has a rule of its own (fwdconv's padded forward)."""
        return self.can_serve(spec, like)

    def check_operand(self, fn: str, name: str, t: torch.Tensor) -> None:
        """Raise TypeError (a dtype) or ValueError (a device) where this backend cannot compute with ``t``,
        naming ``fn``, the tensor's ``name`` and the value; called on every tensor a user passes."""
        if t.is_complex() and not self.supports_complex:
            raise ConvgradTypeError(f"{fn}: backend={self.name!r} does not support complex dtypes ({t.dtype}); "
                                    f"use backend='native' or 'fwdconv'")

    @abstractmethod
    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """grad_input of shape spec.input_shape."""

    @abstractmethod
    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        """grad_weight of shape spec.weight_shape."""

    def backward(
        self,
        spec: ConvSpec,
        grad_output: torch.Tensor,
        input: torch.Tensor | None,
        weight: torch.Tensor | None,
        need_input: bool,
        need_weight: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both gradients; a backend that can share work between them overrides this."""
        gi = self.input_grad(spec, weight, grad_output) if need_input else None  # type: ignore[arg-type]
        gw = self.weight_grad(spec, input, grad_output) if need_weight else None  # type: ignore[arg-type]
        return gi, gw

    def gradients(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                  weight: torch.Tensor | None, need_input: bool, need_weight: bool
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``backward``, with each gradient in the memory format torch's own backward returns for these tensors.

        The one entry point of every caller, so that no backend has to get layouts right by itself; a
        gradient already in torch's layout is not copied. ``input`` or ``weight`` is None when its gradient
        alone is asked for (then, as in torch.nn.grad, the missing tensor has no layout of its own).
        """
        from convgrad.backends.memory_format import like_torch  # here: this package must import without torch

        gi, gw = self.backward(spec, grad_output, input, weight, need_input, need_weight)
        return like_torch(spec, grad_output, input, weight, gi, gw)


class FusedBackend(Backend):
    """A backend that computes both gradients in one ``backward``; each gradient alone is that backward with the
    other not asked for (the tensor it would need passed as None)."""

    @abstractmethod
    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both gradients (None where not needed); ``input`` or ``weight`` is None when only the other's is."""

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self.backward(spec, grad_output, None, weight, True, False)[0]  # type: ignore[return-value]

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self.backward(spec, grad_output, input, None, False, True)[1]  # type: ignore[return-value]


def register(cls: _B) -> _B:
    """Class decorator: instantiate the backend and register it under ``cls.name``."""
    _REGISTRY[cls.name] = cls()
    return cls


def _load_builtin() -> None:
    """Import every module of this package, so that each ``@register`` runs: no list of backends to keep.

    Here, not at module top, so that ``convgrad.spec`` and the NumPy path never need torch."""
    global _loaded
    _loaded = True
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def backend_names() -> list[str]:
    """Names of every registered backend, 'auto' first."""
    if not _loaded:
        _load_builtin()
    return sorted(_REGISTRY, key=lambda n: (n != "auto", n))


def traceable_names() -> list[str]:
    """Names of the backends made of torch ops (``differentiable``): those autograd and torch.func see through."""
    return [n for n in backend_names() if _REGISTRY[n].differentiable]


def get_backend(name: str, fn: str = "convgrad") -> Backend:
    """Look a backend up by name; raise ValueError naming the valid choices otherwise."""
    if not _loaded:
        _load_builtin()
    if not isinstance(name, str):
        raise ConvgradTypeError(f"{fn}: backend={name!r} must be a string, one of {backend_names()}")
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ConvgradValueError(f"{fn}: backend={name!r} is not registered; choose one of {backend_names()}") from None


class _CallableModule(types.ModuleType):
    """Lets ``convgrad.backends()`` list the names while ``convgrad.backends`` stays this package."""

    def __call__(self) -> list[str]:
        return backend_names()


sys.modules[__name__].__class__ = _CallableModule
