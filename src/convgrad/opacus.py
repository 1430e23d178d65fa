"""convgrad's per-sample rules inside Opacus: every convolution as a grad sampler and as an exact norm sampler.

Opacus (``pip install convgrad[opacus]``) computes per-sample gradients with one function per
module type, looked up by the exact ``type(module)`` in two registries:

    GRAD_SAMPLERS  fn(module, activations, backprops) -> {param: (N, *param.shape)}   grad_sample_mode="hooks"
    NORM_SAMPLERS  fn(module, activations, backprops) -> {param: (N,) unsquared norm} "ghost" (fast clipping)

``activations`` is the list of the module's forward inputs and ``backprops`` its grad_output,
already multiplied by N when the loss is a mean. A norm sampler must give an entry for every
trainable parameter, bias included. A module type without a norm sampler falls back to its grad
sampler (or to functorch) and materialises its per-sample gradients even in ghost mode.

Opacus 1.6 has no norm sampler for any convolution, no rule for ConvTranspose (functorch runs
instead), and its conv rule ignores ``padding_mode``. ``register()`` installs, for the six
torch.nn convolutions, their convgrad.nn drop-ins and the classes ``convgrad.patch`` gives them,
the rules of ``PerSampleGrads`` (``convgrad.per_sample.rules``): any padding string or mode,
groups, dilation, transposed convolutions with output_padding or ``output_size=``. The norm
sampler takes each weight's norm by the ghost formula where that costs fewer operations, and
chunk by chunk from materialised gradients where it does not; the norms are exact either way.

A convolution called several times in one forward (its parameters tied to themselves): Opacus's
ghost-clipping forward hook refuses any module whose type has a norm sampler on its second call
("Parameter tying is not supported with Ghost Clipping"), because a norm sampler is called once per
call and the last call's norm would stand for the whole. Without a norm sampler, Opacus adds up
the calls' per-sample gradients and takes the norm of the sum, exactly. ``register()`` therefore
also wraps that hook: for our convolutions it skips the refusal, and ``norm_sampler`` then adds up
the calls itself, materialising their per-sample gradients, while Opacus's per-parameter
``_forward_counter`` says that more calls are to come; a conv called once keeps the ghost norm.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from convgrad.per_sample.methods import one_layer, sq_norms
from convgrad.per_sample.rules import ConvLayer

__all__ = ["grad_sampler", "norm_sampler", "register", "unregister"]

_ABSENT = object()  # the registry had no entry for the type
_saved: dict[str, dict[type, Any]] = {}  # registry name -> type -> entry before register()
_hook: dict[str, Any] = {}  # "original": Opacus's ghost-clipping forward hook, which ours wraps
_CALLS_SUM = "_convgrad_calls_sum"  # on a parameter: its per-sample gradients summed over the calls seen so far


def _module_types() -> list[type]:
    """Every class whose forward is a plain convolution: torch.nn's, convgrad.nn's and the patched ones."""
    from convgrad import nn as cgnn

    torch_convs = [nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d]
    ours = [cgnn.Conv1d, cgnn.Conv2d, cgnn.Conv3d, cgnn.ConvTranspose1d, cgnn.ConvTranspose2d, cgnn.ConvTranspose3d]
    return torch_convs + ours + [cgnn.patched_class(t) for t in torch_convs]


def _rule(module: nn.Module, activations: list[torch.Tensor], backprops: torch.Tensor) -> ConvLayer:
    x = activations[0].to(backprops.dtype)  # autocast: the input may be in lower precision than grad_output
    return ConvLayer.for_module(module, x, backprops, 1.0)  # Opacus has already scaled backprops for a mean loss


def grad_sampler(module: nn.Module, activations: list[torch.Tensor],
                 backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus grad sampler: the per-sample gradient of every trainable parameter of one convolution.

    Args:
        module: a Conv1d/2d/3d or ConvTranspose1d/2d/3d (torch.nn or convgrad.nn).
        activations: ``[input]``, the module's forward input ``(N, C_in, *spatial)``.
        backprops: grad_output ``(N, C_out, *out_spatial)``, as Opacus passes it (times N for a mean loss).

    Returns:
        ``{param: (N, *param.shape)}`` for the trainable weight and bias.

    Source: the docs' "Per-sample gradients and DP-SGD" guide ("Opacus"); Opacus's ``register_grad_sampler`` contract.

    Examples:
        >>> import torch, convgrad.opacus
        >>> conv = torch.nn.Conv1d(2, 4, 3, padding=1, padding_mode="reflect")
        >>> x, gy = torch.randn(5, 2, 7), torch.randn(5, 4, 7)
        >>> grads = convgrad.opacus.grad_sampler(conv, [x], gy)
        >>> grads[conv.weight].shape, grads[conv.bias].shape
        (torch.Size([5, 4, 2, 3]), torch.Size([5, 4]))
    """
    with one_layer():
        return {getattr(module, k): g for k, g in _rule(module, activations, backprops).grads().items()}


def norm_sampler(module: nn.Module, activations: list[torch.Tensor],
                 backprops: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Opacus norm sampler (ghost clipping): each trainable parameter's per-sample gradient norm, not squared.

    Args:
        module, activations, backprops: as for ``grad_sampler``.

    Returns:
        ``{param: (N,)}`` for the trainable weight and bias; the norm over both is the layer's norm.

    Source: the docs' "Per-sample gradients and DP-SGD" guide ("ghost norms");
    Opacus's ``register_norm_sampler`` contract.

    Examples:
        >>> import torch, convgrad.opacus
        >>> conv = torch.nn.Conv2d(8, 8, 3, groups=2)
        >>> x, gy = torch.randn(5, 8, 4, 4), torch.randn(5, 8, 2, 2)
        >>> norms = convgrad.opacus.norm_sampler(conv, [x], gy)
        >>> grads = convgrad.opacus.grad_sampler(conv, [x], gy)
        >>> all(torch.allclose(norms[p], g.flatten(1).norm(dim=1), rtol=1e-4) for p, g in grads.items())
        True
    """
    layer = _rule(module, activations, backprops)
    with one_layer():
        if any(_more_calls(p) or hasattr(p, _CALLS_SUM) for p in (getattr(module, k) for k in layer.shapes)):
            sq = {k: sq_norms(_add_call(getattr(module, k), g)) for k, g in layer.grads().items()}
        else:
            sq = layer.param_sq_norms()  # float32 for half precision: squares overflow
    # rounding can take a ghost norm below 0; the norm itself fits backprops' dtype wherever the true one does
    return {getattr(module, k): s.clamp(min=0).sqrt().to(backprops.dtype) for k, s in sq.items()}


def _more_calls(p: nn.Parameter) -> bool:
    """Whether a call of p's module other than this one is still to be back-propagated: Opacus counts a
    parameter's calls up in the forward hook and down after each norm sampler call."""
    return getattr(p, "_forward_counter", 1) > 1


def _add_call(p: nn.Parameter, grad_sample: torch.Tensor) -> torch.Tensor:
    """p's per-sample gradients summed over its calls so far, this one included; kept on p until the last call."""
    total = getattr(p, _CALLS_SUM, None)
    total = grad_sample if total is None else total + grad_sample  # (N, *p.shape)
    if _more_calls(p):
        setattr(p, _CALLS_SUM, total)
    elif hasattr(p, _CALLS_SUM):
        delattr(p, _CALLS_SUM)
    return total


def _ghost_forward_hook(self: Any, module: nn.Module, forward_input: Any, output: Any) -> None:
    """Opacus's ghost-clipping forward hook, without its refusal of a second call for the types whose norm sampler
    is ours (see the module doc): its one read of ``use_ghost_clipping`` is that refusal."""
    original = _hook["original"]
    if self.NORM_SAMPLERS.get(type(module)) is not norm_sampler:
        return original(self, module, forward_input, output)
    ghost, self.use_ghost_clipping = self.use_ghost_clipping, False
    try:
        return original(self, module, forward_input, output)
    finally:
        self.use_ghost_clipping = ghost


def _ghost_hooks() -> Any:
    """Opacus's ghost-clipping hooks class, whose forward hook ``register()`` wraps (Any: Opacus has no types)."""
    try:
        from opacus.grad_sample import GradSampleHooksFastGradientClipping
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError("convgrad.opacus: Opacus is not installed; pip install convgrad[opacus] "
                                  "(with -c constraints.txt to keep the pinned torch)") from err
    return GradSampleHooksFastGradientClipping


def _registries() -> dict[str, dict[type, Any]]:
    from opacus.grad_sample import GradSampleHooks

    return {"grad": GradSampleHooks.GRAD_SAMPLERS, "norm": _ghost_hooks().NORM_SAMPLERS}


_OURS = {"grad": grad_sampler, "norm": norm_sampler}


def register() -> None:
    """Install convgrad's conv rules in Opacus, for ``grad_sample_mode="hooks"`` and ``"ghost"``.

    Registers ``grad_sampler`` and ``norm_sampler``
    for Conv1d/2d/3d and ConvTranspose1d/2d/3d of torch.nn, of convgrad.nn, and the classes
    ``convgrad.patch`` gives them, and wraps Opacus's ghost-clipping forward hook so that a conv
    called several times in one forward is clipped exactly (see the module doc). Call it before
    Opacus wraps the model (``make_private``, ``GradSampleModule``): the wrapper decides at that
    moment which layers run through functorch, and binds its hooks.
    The entries found before the first call are kept for
    ``unregister``; calling it again changes nothing else.

    Raises:
        ModuleNotFoundError: Opacus is not installed.

    Source: the docs' "Per-sample gradients and DP-SGD" guide ("Opacus").

    Examples:
        >>> import torch, convgrad.opacus
        >>> from opacus import GradSampleModule
        >>> convgrad.opacus.register()
        >>> model = torch.nn.Sequential(torch.nn.ConvTranspose2d(2, 3, 3, stride=2, output_padding=1),
        ...                             torch.nn.Conv2d(3, 2, 4, padding="same", padding_mode="circular"))
        >>> gsm = GradSampleModule(model, loss_reduction="sum")
        >>> gsm(torch.randn(4, 2, 5, 5)).square().sum().backward()
        >>> model[0].weight.grad_sample.shape, model[1].bias.grad_sample.shape
        (torch.Size([4, 2, 3, 3, 3]), torch.Size([4, 2]))
        >>> convgrad.opacus.unregister()
    """
    cls, registries, types = _ghost_hooks(), _registries(), _module_types()
    if cls.capture_activations_hook is not _ghost_forward_hook:
        _hook["original"] = cls.capture_activations_hook  # kept after unregister(): hooks bound now call it
        cls.capture_activations_hook = _ghost_forward_hook
    for name, registry in registries.items():
        saved = _saved.setdefault(name, {})
        for t in types:
            if t not in saved:
                saved[t] = registry.get(t, _ABSENT)
            registry[t] = _OURS[name]


def unregister() -> None:
    """Put back the Opacus entries that ``register`` replaced.

    Types that had an entry get it back; types that had none lose ours; Opacus's ghost-clipping
    forward hook is its own again. An entry that someone replaced after ``register()`` is left as it
    is. Models Opacus wrapped while the rules were registered look their layers up again at each
    backward (their bound forward hook then finds no norm sampler of ours and is Opacus's). Without
    a prior ``register()`` it does nothing.

    Raises:
        ModuleNotFoundError: Opacus is not installed.

    Source: the docs' "Per-sample gradients and DP-SGD" guide ("Opacus").

    Examples:
        >>> import torch, convgrad.opacus
        >>> from opacus.grad_sample import GradSampleHooks
        >>> before = GradSampleHooks.GRAD_SAMPLERS[torch.nn.Conv2d]
        >>> convgrad.opacus.register()
        >>> GradSampleHooks.GRAD_SAMPLERS[torch.nn.Conv2d] is convgrad.opacus.grad_sampler
        True
        >>> convgrad.opacus.unregister()
        >>> GradSampleHooks.GRAD_SAMPLERS[torch.nn.Conv2d] is before
        True
    """
    cls, registries = _ghost_hooks(), _registries()
    if cls.capture_activations_hook is _ghost_forward_hook:
        cls.capture_activations_hook = _hook["original"]
    for name, saved in _saved.items():
        registry = registries[name]
        for t, entry in saved.items():
            if registry.get(t) is not _OURS[name]:
                continue
            if entry is _ABSENT:
                del registry[t]
            else:
                registry[t] = entry
    _saved.clear()
