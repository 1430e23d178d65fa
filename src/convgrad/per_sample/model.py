"""PerSampleGrads: per-sample gradients, norms and clipped sums for a whole model, with module hooks.

How it hooks in, per supported module and forward call:
    pre-hook      swap the trainable parameters for detached aliases, so that the
                  module's own backward computes grad_input only (no batch-summed
                  weight gradient that would be thrown away or recomputed);
    forward hook  put the parameters back and pass the output through tap.Tap, an
                  identity marked as in-place (so later in-place ops such as
                  ReLU(inplace=True) stay legal) whose inputs are the output and
                  the parameters;
    Tap backward  receives grad_output, hands it with the saved input to the
                  module's rule (``convgrad.per_sample.rules``) and returns, as
                  the parameters' ordinary gradients, the sum of the per-sample
                  ones (norms_only or DDP: none; clip_and_accumulate adds to .grad).

Under DistributedDataParallel the context runs the model under ``no_sync()``, so that
DDP's buckets, which fire during the backward before any per-sample norm exists, never
all-reduce an unclipped gradient; ``clip_and_accumulate`` makes one all-reduce of the
clipped sums instead (as Opacus's DistributedDPOptimizer does after its clipping).
"""

from __future__ import annotations

import contextlib
import functools
from types import TracebackType
from typing import Any

import torch
from torch import nn

from convgrad.checks import check_module
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.per_sample import distributed
from convgrad.per_sample.methods import one_layer, sq_norms
from convgrad.per_sample.rules import SAMPLE_MIXING, Grads, Layer, mixes_samples, rule_for
from convgrad.per_sample.tap import BatchGuard, Record, Tap

__all__ = ["PerSampleGrads"]


_SUPPORTED = ("Conv1d/2d/3d, ConvTranspose1d/2d/3d (torch.nn or convgrad.nn), Linear, GroupNorm, LayerNorm, "
              "BatchNorm in eval mode")


class PerSampleGrads:
    """Context manager: per-sample gradients (``.grad_sample``), per-sample norms and clipped sums for DP-SGD.

    Inside the ``with`` block, run the forward pass and ``loss.backward()``. Afterwards
    every trainable parameter of every supported module has ``.grad_sample`` of shape
    ``(N, *param.shape)``, as Opacus defines it: the gradient of each sample's own loss. The
    default ``loss_reduction="mean"`` fits a loss that is a mean over the batch, as PyTorch's
    losses and Opacus default to (``F.cross_entropy(model(x), y)``): each per-sample gradient is
    then N times its share of ``.grad``. For a summed loss (``reduction="sum"``) pass
    ``loss_reduction="sum"``; a mismatch scales every per-sample gradient and norm by N or 1/N.
    A module called several times in one forward sums its calls, like ``.grad``.

    The backward also adds to the ordinary ``.grad`` the sum of the per-sample gradients
    (divided by N for "mean") instead of a separate batch-summed weight gradient: during the
    forward the supported parameters are swapped for detached aliases (see the module doc).

    With ``norms_only=True`` nothing is stored in ``.grad_sample`` and backward leaves the
    ``.grad`` of the supported parameters untouched (DP-SGD replaces it anyway): each layer
    keeps only its per-sample squared norms, computed by a ghost norm wherever that costs
    fewer operations (see
    ``convgrad.per_sample_grad_norms``), plus the smaller of its
    materialised per-sample gradients or its (input, grad_output) for clipping; then
    ``clip_and_accumulate`` adds to ``.grad``. Double
    backward (create_graph=True) through a supported module is refused.

    Micro-batches: ``clip_and_accumulate`` adds the clipped sum to ``.grad`` as it was before the context's
    backward, so one context and one call per micro-batch accumulate a logical batch, as Opacus's virtual steps
    do. Reset ``.grad`` (``optimizer.zero_grad()``) before each logical batch. One context holds one batch: a
    backward through a forward that its first backward did not reach (the next micro-batch) is refused, since
    its samples would land on the rows of the first batch's; a second backward through a retained graph, the
    same samples again, adds to them, like ``.grad``. Call ``clear()`` to start another batch in the same context.

    DistributedDataParallel: pass the DDP module itself, ``PerSampleGrads(ddp_model)``, and run the forward inside
    the context. The context runs it under ``ddp_model.no_sync()``, so that DDP never all-reduces an unclipped
    gradient; the backward leaves ``.grad`` untouched, ``.grad_sample`` and ``norms()`` cover this rank's samples,
    and ``clip_and_accumulate`` makes one all-reduce (a sum) of the clipped sums: every rank then holds
    ``Σ_n clip(g_n)`` over the global batch. Add the noise once (the same draw on every rank, from generators
    seeded alike) and divide by the global batch size, the sum of the ranks' batch sizes.

    BatchNorm is accepted in eval mode (running statistics: each sample is normalised alone) and its affine
    parameters get per-sample gradients. In training mode, or with ``track_running_stats=False``, it mixes the
    samples of a batch, so no sample has a gradient of its own: a forward through it inside the context is
    refused, whether or not its parameters are trainable. The mode is checked at every forward.

    Args:
        model: an ``nn.Module``, or a ``DistributedDataParallel`` wrapping one, whose modules with trainable
            parameters are all supported: Conv1d/2d/3d, ConvTranspose1d/2d/3d (torch.nn or convgrad.nn; any
            padding string, padding_mode, groups, dilation, output_size), Linear, GroupNorm, LayerNorm and
            BatchNorm1d/2d/3d (eval mode). Inputs are batch-first, batch 0 included.
        loss_reduction: ``"mean"`` (default, as PyTorch's losses and Opacus) or ``"sum"``, how the loss combines
            the samples' losses.
        norms_only: compute norms (and clipped sums) only (default False).

    Raises:
        TypeError: model is not an nn.Module, norms_only not a bool; the model contains a DataParallel, an FSDP
            module or a DistributedDataParallel other than the model itself; the model is a DistributedDataParallel
            built with static_graph=True.
        ValueError: an unknown loss_reduction; a module with trainable parameters and no rule (its name and
            type are in the message), or a trainable parameter its rule does not know (spectral_norm's
            weight_orig). At a forward inside the context: a BatchNorm that normalises with the
            batch's statistics; the forward runs inside a DistributedDataParallel that synchronises gradients
            (the model given was its inner module). During the backward: a gradient that reaches a parameter
            from outside its module's forward (``F.conv2d(x, conv.weight)``, a weight penalty in the loss); a
            module called on another number of samples than the first one (part of the batch); a backward of
            another batch (see Micro-batches).

    Source: the docs' "Per-sample gradients and DP-SGD" guide;
    Opacus's GradSampleModule (grad_sample's definition) and DistributedDPOptimizer
    (clipping before the all-reduce); Abadi et al., "Deep learning with differential privacy" (2016) for clipping.

    Examples:
        >>> import torch, convgrad as cg
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding="same", padding_mode="circular"),
        ...                             torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
        >>> x = torch.randn(5, 1, 6, 6)
        >>> with cg.PerSampleGrads(model) as psg:  # loss_reduction="mean", as the loss below
        ...     model(x).square().sum(1).mean().backward()
        >>> model[0].weight.grad_sample.shape
        torch.Size([5, 4, 1, 3, 3])
        >>> psg.norms().shape
        torch.Size([5])
        >>> _ = psg.clip_and_accumulate(max_norm=1.0)  # .grad = (.grad before the backward) + Σ_n clipped
        >>> bool(model[2].weight.grad.norm() <= 5.0)
        True
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", norms_only: bool = False) -> None:
        fn = "PerSampleGrads"
        check_module(fn, model)
        if loss_reduction not in ("sum", "mean"):
            raise ConvgradValueError(f"{fn}: loss_reduction={loss_reduction!r} must be 'sum' or 'mean'")
        if not isinstance(norms_only, bool):
            raise ConvgradTypeError(f"{fn}: norms_only={norms_only!r} must be a bool")
        distributed.refuse_wrappers(fn, model)
        self._ddp = distributed.as_ddp(model)
        self.model, self.loss_reduction, self.norms_only = model, loss_reduction, norms_only
        self._names = {m: name or "(the model itself)" for name, m in model.named_modules()}
        self._rules: dict[nn.Module, type[Layer]] = {}
        self._trainable: dict[nn.Module, dict[str, nn.Parameter]] = {}
        for module, name in self._names.items():
            trainable = [k for k, p in module.named_parameters(recurse=False) if p.requires_grad]
            if not trainable:
                continue
            rule = rule_for(module)
            if rule is None:
                raise ConvgradValueError(f"{fn}: module {name!r} ({type(module).__name__}) has trainable parameters "
                                         f"{trainable} but no per-sample rule; supported: {_SUPPORTED}. Freeze it with "
                                         f"requires_grad_(False) or replace it")
            unknown = [k for k in trainable if k not in rule.PARAMS]
            if unknown:
                raise ConvgradValueError(
                    f"{fn}: module {name!r} ({type(module).__name__}) has trainable parameters "
                    f"{unknown} that its per-sample rule does not know (rule parameters: "
                    f"{list(rule.PARAMS)}); a reparametrisation such as spectral_norm or weight_norm "
                    f"computes the weight from them, which the rule cannot follow")
            self._rules[module] = rule
            self._trainable[module] = {k: p for k, p in module.named_parameters(recurse=False) if p.requires_grad}
        self._mixing = [m for m in self._names if isinstance(m, SAMPLE_MIXING)]
        self._check_tied(fn)
        self._handles: list[Any] = []
        self._swapped: set[nn.Module] = set()
        self._records: dict[nn.Module, Record] = {}
        self._before: dict[int, torch.Tensor | None] = {}  # id(param) -> .grad before this context's backward
        self._no_sync = contextlib.ExitStack()
        self._guard = BatchGuard(self._names)
        self._calls = 0  # forward calls of supported modules so far, numbering each call's Tap

    def _check_tied(self, fn: str) -> None:
        """norms_only keeps one squared norm per module, which cannot add up a parameter shared by two."""
        owner: dict[int, nn.Module] = {}
        for m, params in self._trainable.items():
            for p in params.values():
                other = owner.setdefault(id(p), m)
                if other is not m and self.norms_only:
                    raise ConvgradValueError(f"{fn}: modules {self._names[other]!r} and {self._names[m]!r} share a "
                                             f"parameter; norms_only=True needs each parameter in one module (use "
                                             f"norms_only=False)")

    # ---- context --------------------------------------------------------------------------------
    def __enter__(self) -> PerSampleGrads:
        self.clear()
        # the sample-mixing checks are registered first, so they run before any parameter is swapped
        self._handles = [m.register_forward_pre_hook(self._check_mixing) for m in self._mixing]
        self._handles += [h for m in self._rules for h in (m.register_forward_pre_hook(self._pre_hook),
                                                              m.register_forward_hook(self._forward_hook,
                                                                                      with_kwargs=True))]
        # a gradient that reaches a Parameter through autograd did not come through its module's forward
        self._handles += [p.register_hook(functools.partial(self._direct_use, p)) for p in self._params()
                          if p.requires_grad]  # frozen since __init__: no gradient to watch
        if self._ddp is not None:
            self._no_sync.enter_context(self._ddp.no_sync())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        for m in list(self._swapped):  # a forward that raised between the two hooks
            self._restore(m)
        self._no_sync.close()

    def clear(self) -> None:
        """Forget every per-sample result: ``.grad_sample = None`` and no norms (called on entering)."""
        self._records, self._before = {}, {}
        self._guard.clear()
        for p in self._params():
            p.grad_sample = None  # type: ignore[attr-defined]

    def _params(self) -> list[nn.Parameter]:
        """Every trainable parameter of a supported module, once each (a tied parameter is in two modules)."""
        return list({id(p): p for params in self._trainable.values() for p in params.values()}.values())

    # ---- hooks ----------------------------------------------------------------------------------
    def _check_mixing(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        why = mixes_samples(module) if torch.is_grad_enabled() else None
        if why:
            raise ConvgradValueError(f"PerSampleGrads: module {self._names[module]!r} ({type(module).__name__}) {why}")

    def _pre_hook(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled():
            distributed.check_no_outer_sync()
            for k, p in self._trainable[module].items():
                module._parameters[k] = p.detach()  # type: ignore[assignment]
            self._swapped.add(module)

    def _restore(self, module: nn.Module) -> dict[str, nn.Parameter]:
        if module not in self._swapped:
            return {}
        self._swapped.discard(module)
        module._parameters.update(self._trainable[module])
        return self._trainable[module]

    def _forward_hook(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        params = self._restore(module)
        if not params:
            return None
        x = args[0] if args else kwargs.get("input")  # module(input=x) passes it as a keyword
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor):
            raise ConvgradValueError(
                f"PerSampleGrads: module {self._names[module]!r} ({type(module).__name__}) was called "
                f"without a tensor input (args {len(args)}, keywords {sorted(kwargs)}) or returned "
                f"{type(output).__name__}; its per-sample gradients need module(input) -> Tensor")
        self._calls += 1
        callback = functools.partial(self._backward, module, list(params), self._calls)
        return Tap.apply(callback, x.detach(), output, *params.values())

    def _direct_use(self, param: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Hook on every trainable parameter: inside its module's forward it is swapped for a detached alias and Tap
        hands autograd no gradient for it, so any gradient autograd brings comes from a use outside that forward."""
        if grad is None:
            return
        name = next(f"{'' if m is self.model else self._names[m] + '.'}{k}" for m, ps in self._trainable.items()
                    for k, p in ps.items() if p is param)
        raise ConvgradValueError(
            f"PerSampleGrads: parameter {name!r} received a gradient from outside its module's forward "
            f"(used directly, as in F.conv2d(x, conv.weight), or in a loss term such as a weight "
            f"penalty); no per-sample gradient can include that use, so its norms and clipped sum would "
            f"be wrong. Call the module itself, and apply weight decay through the optimizer")

    def _remember_grads(self, params: list[nn.Parameter]) -> None:
        """Keep .grad as it was before this context's backward, for clip_and_accumulate to add to."""
        adds = not self.norms_only and self._ddp is None  # the backward then adds to .grad, possibly in place
        for p in params:
            if id(p) not in self._before:
                self._before[id(p)] = None if p.grad is None else p.grad.clone() if adds else p.grad

    def _backward(self, module: nn.Module, names: list[str], call: int, x: torch.Tensor,
                  grad_output: torch.Tensor) -> list[torch.Tensor | None]:
        """One layer's part of the backward (see ``Tap``), as ``methods.one_layer``: its scratch buffers go after."""
        self._guard.check_call(module, call)
        with one_layer():
            return self._layer_backward(module, names, x, grad_output)

    def _layer_backward(self, module: nn.Module, names: list[str], x: torch.Tensor,
                        grad_output: torch.Tensor) -> list[torch.Tensor | None]:
        self._remember_grads([self._trainable[module][k] for k in names])
        scale = float(x.shape[0]) if self.loss_reduction == "mean" else 1.0
        x = x if x.dtype == grad_output.dtype else x.to(grad_output.dtype)  # autocast: the input's own dtype
        layer = self._rules[module](module, x, grad_output.detach(), scale)
        self._guard.check_size(module, layer.x.shape[0])
        if not self.norms_only:
            grads = layer.grads()
            for k, g in grads.items():
                p = self._trainable[module][k]
                p.grad_sample = g if getattr(p, "grad_sample", None) is None else p.grad_sample + g  # type: ignore
            if self._ddp is None:  # under DDP this rank's sum alone would be a wrong .grad: clip_and_accumulate
                sums = layer.summed({k: grads[k] for k in names if k in grads})  # {k: (*param.shape)}
                for k, g in sums.items():  # added here as autograd would (autograd gets none, see _direct_use)
                    p = self._trainable[module][k]
                    g = g.to(p.dtype)
                    p.grad = g if p.grad is None else p.grad.add_(g)
            return [None] * len(names)
        rec = self._records.setdefault(module, Record())
        rec.calls += 1
        if rec.calls > 1:  # a second call (or backward): norms do not add, gradients do
            first = rec.grads if rec.grads is not None else rec.layer.grads()  # type: ignore[union-attr]
            rec.grads = {k: first[k] + g for k, g in layer.grads().items()}
            rec.layer, rec.sq = None, None
        else:  # the layer's clipping plan: keep its per-sample gradients, or its state for one more pass
            how, store = layer.clip_plan()
            if store:
                rec.grads = layer.grads()
            else:
                rec.sq = layer.ghost_sq_norms() if how == "ghost" else layer.materialised_sq_norms()
                rec.layer = layer
        return [None] * len(names)

    # ---- results --------------------------------------------------------------------------------
    def _per_sample(self) -> list[tuple[nn.Module, Grads | None, Layer | None, torch.Tensor | None]]:
        """(module, gradients, layer, squared norm) for every module that received a gradient; a parameter shared
        by two modules (its .grad_sample holds both) is listed under the first only."""
        if not self.norms_only:
            out, seen = [], set()
            for m, params in self._trainable.items():
                gs = {k: p.grad_sample for k, p in params.items()
                      if getattr(p, "grad_sample", None) is not None and id(p) not in seen}
                seen.update(id(params[k]) for k in gs)
                if gs:
                    out.append((m, gs, None, None))
            return out
        return [(m, r.grads, r.layer, r.sq) for m, r in self._records.items()]

    def norms(self) -> torch.Tensor:
        """Per-sample L2 norms over the gradients of every supported parameter.

        Returns:
            ``(N,)``, the norm of each sample's whole gradient (every layer, weight and bias); under
            DistributedDataParallel, of this rank's N samples. float32 for float16 and bfloat16 parameters: the
            squares accumulate in float32 (in float16 a norm of 360 would square to inf).

        Raises:
            RuntimeError: no per-sample gradient was recorded (no backward ran inside the context).
        """
        total = None
        for _, grads, _, sq in self._per_sample():
            if sq is None:
                sq = sum(sq_norms(g) for g in grads.values())  # type: ignore[union-attr]
            total = sq if total is None else total + sq
        if total is None:
            raise RuntimeError("PerSampleGrads.norms: no per-sample gradient was recorded; run the forward pass "
                               "and loss.backward() inside the `with PerSampleGrads(model)` block")
        return total.clamp(min=0).sqrt()  # a ghost norm near 0 can round below it

    def clip_and_accumulate(self, max_norm: float) -> torch.Tensor:
        """Add to each parameter's ``.grad`` the sum over samples of its per-sample gradient clipped to max_norm.

        Sample n is scaled by ``min(1, max_norm / (norm[n] + 1e-6))`` (Opacus's factor), with norm[n]
        taken over the whole model. Where the gradients were not materialised (norms_only), each
        layer makes one ordinary weight-gradient call (convgrad.conv_weight_grad, ...) on its
        grad_output scaled per sample. The sum is added to ``.grad`` as it was before the context's
        backward (the unclipped sum that backward put there is not kept), so that micro-batches of
        one logical batch accumulate; calling it twice gives the same ``.grad``. Parameters that
        received no gradient get zeros added. Under DistributedDataParallel the clipped sums of all
        ranks are all-reduced (one call per dtype) before they are added, so every rank holds the
        sum over the global batch. Add the noise and divide by the (global) batch size yourself.

        Args:
            max_norm: the clipping bound C > 0.

        Returns:
            ``(N,)``, the per-sample norms before clipping (this rank's samples under DDP).

        Raises:
            ValueError: max_norm is not positive. RuntimeError: as
                ``norms``.
        """
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ConvgradValueError(
                f"PerSampleGrads.clip_and_accumulate: max_norm={max_norm!r} must be a positive number")
        norms = self.norms()
        factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # (N,)
        clipped: dict[int, torch.Tensor] = {}
        for m, grads, layer, _ in self._per_sample():
            summed = layer.clipped(factors) if grads is None else {  # type: ignore[union-attr]
                k: torch.tensordot(factors.to(g.dtype), g, dims=1) for k, g in grads.items()}  # (*param.shape)
            clipped.update({id(self._trainable[m][k]): g for k, g in summed.items()})
        params = self._params()
        sums = [clipped[id(p)] if id(p) in clipped else torch.zeros_like(p) for p in params]
        if self._ddp is not None:
            distributed.all_reduce_sum(sums, self._ddp.process_group)
        for p, g in zip(params, sums, strict=True):
            before, g = self._before.get(id(p), p.grad), g.to(p.dtype)  # autocast: the parameter's dtype
            p.grad = g if before is None else before + g
        return norms
