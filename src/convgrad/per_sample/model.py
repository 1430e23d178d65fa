"""PerSampleGrads: per-sample gradients, norms and clipped sums of every trainable parameter of a model.

It reaches the parameters through the functions a forward calls, not through module types, so a subclass with a
forward of its own, a conv called as a function, or a weight computed in the forward needs no rule of its own:

    hooks     a pre-hook and a forward hook on every module keep the stack of the modules whose forward runs (for
              the messages, and to find the module a rerun belongs to); the outermost forward runs with the capture
              mode on the stack (``convgrad.per_sample.capture``), which sees every torch function call;
    capture   a layer function that a parameter reaches (conv, linear, the norms, embedding) runs on detached
              operands, and its output is tapped (``tap.Tap``); an operation where a parameter meets the samples
              outside any rule marks the innermost running module that holds the parameter for a rerun;
    backward  a layer's tap hands grad_output and its saved input to the rule (``convgrad.per_sample.rules``); the
              operands' per-sample gradients are pulled back to the parameters they were computed from (one
              vmapped backward of that transform, ``torch.autograd.grad(is_grads_batched=True)``); a rerun
              module's tap runs its forward per sample (``convgrad.per_sample.fallback``);
    results   the context keeps what its own backward computed: ``.grad_sample``, the norms, the clipped sums.

Parameters stay the very same objects throughout: nothing is swapped, so a model's parameters are its optimizer's
whatever happens inside the context.

Under DistributedDataParallel the context runs the model under ``no_sync()``, so that DDP's buckets, which fire
during the backward before any per-sample norm exists, never all-reduce an unclipped gradient;
``clip_and_accumulate`` makes one all-reduce of the clipped sums instead (as Opacus's DistributedDPOptimizer does
after its clipping).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import nn

from convgrad import scopes
from convgrad.checks import check_module
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.per_sample import distributed
from convgrad.per_sample.capture import Capture
from convgrad.per_sample.fallback import Frame, rerun
from convgrad.per_sample.methods import one_layer
from convgrad.per_sample.operands import Operand, Sources, pull_back
from convgrad.per_sample.results import Record, Results
from convgrad.per_sample.rules import Layer
from convgrad.per_sample.tap import BatchGuard, Tap
from convgrad.reach import hidden, user_class

__all__ = ["PerSampleGrads"]

_COMPILED = (
    "PerSampleGrads: the forward of module {name!r} is being compiled by torch.compile; per-sample gradients are "
    "captured from the eager forward (every function call it makes), which a compiled graph does not make. Call "
    "the model itself inside the context, not torch.compile(model) (compile the rest of the training step, or use "
    "Opacus's hooks under compile); the model was left as it was")


def _compiled() -> bool:
    """Whether this forward runs under torch.compile: traced by Dynamo, or run by it eagerly after a graph break
    (Dynamo's frame callback is then still set; a ``torch.compiler.disable``d region clears it)."""
    return torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None


class PerSampleGrads:
    """Context manager: per-sample gradients (``.grad_sample``), per-sample norms and clipped sums for DP-SGD.

    Inside the ``with`` block, run the forward pass and ``loss.backward()``. Afterwards every trainable parameter
    of the model that the loss reached has ``.grad_sample`` of shape ``(N, *param.shape)``, as Opacus defines it:
    the gradient of each sample's own loss. The default ``loss_reduction="mean"`` fits a loss that is a mean over
    the batch, as PyTorch's losses and Opacus default to (``F.cross_entropy(model(x), y)``): each per-sample
    gradient is then N times its share of ``.grad``. For a summed loss (``reduction="sum"``) pass
    ``loss_reduction="sum"``; a mismatch scales every per-sample gradient and norm by N or 1/N.

    Every trainable parameter is reached however it reaches its layer. The layer functions have rules (conv1d/2d/3d
    and conv_transpose1d/2d/3d with any padding, padding mode, groups, dilation, output_size; linear; layer_norm,
    group_norm, rms_norm; batch_norm with running statistics; embedding), whoever calls them: torch.nn's modules,
    a subclass with its own forward (timm's ``StdConv2d``, ``Linear``, ``LayerNorm2d``), ``F.conv2d`` in any
    forward, convgrad's own modules and patched models. A weight computed from parameters in the forward (weight
    standardisation, a ``weight_norm`` / ``spectral_norm`` parametrization, ``w0 + B @ A``, ``gain * w``) gets its
    layer's per-sample gradient pulled back to its parameters, exactly. A parameter that meets the samples in any
    other operation (a layer-scale ``x * gamma``) gets its per-sample gradients from the forward of the innermost
    module that holds it, run again per sample (``report()`` says which parameters took which way). A module
    called several times in one forward sums its calls, like ``.grad``.

    The backward also adds to the ordinary ``.grad`` the sum of the per-sample gradients (divided by N for "mean")
    instead of a separate batch-summed weight gradient: the layers run on detached weights.

    With ``norms_only=True`` nothing is stored in ``.grad_sample`` and backward leaves the ``.grad`` of the
    parameters untouched (DP-SGD replaces it anyway): each layer keeps only its per-sample squared norms, computed
    by a ghost norm wherever that costs fewer operations (see ``convgrad.per_sample_grad_norms``), plus the smaller
    of its materialised per-sample gradients or its (input, grad_output) for clipping; then ``clip_and_accumulate``
    adds to ``.grad``. A parameter reached by several calls has their per-sample gradients summed before its norm.
    Double backward (create_graph=True) through a captured layer is refused.

    Micro-batches: ``clip_and_accumulate`` adds the clipped sum to ``.grad`` as it was before the context's
    backward, so one context and one call per micro-batch accumulate a logical batch, as Opacus's virtual steps
    do. Reset ``.grad`` (``optimizer.zero_grad()``) before each logical batch. One context holds one batch: a
    backward through a forward that its first backward did not reach (the next micro-batch) is refused, since
    its samples would land on the rows of the first batch's; a second backward through a retained graph, the
    same samples again, adds to them, like ``.grad``. Call ``clear()`` to start another batch in the same context.
    Results belong to the context: ``norms()`` of a context never entered, or one whose backward has not run, is
    an error, never another context's batch.

    DistributedDataParallel: pass the DDP module itself, ``PerSampleGrads(ddp_model)``, and run the forward inside
    the context. The context runs it under ``ddp_model.no_sync()``, so that DDP never all-reduces an unclipped
    gradient; the backward leaves ``.grad`` untouched, ``.grad_sample`` and ``norms()`` cover this rank's samples,
    and ``clip_and_accumulate`` makes one all-reduce (a sum) of the clipped sums: every rank then holds
    ``Σ_n clip(g_n)`` over the global batch. Add the noise once (the same draw on every rank, from generators
    seeded alike) and divide by the global batch size, the sum of the ranks' batch sizes.

    BatchNorm is accepted with its running statistics (eval mode: each sample is normalised alone) and its affine
    parameters get per-sample gradients. With the batch's statistics (training mode, or
    ``track_running_stats=False``) it mixes the samples of a batch, so no sample has a gradient of its own: a
    forward through it inside the context is refused, whether or not its parameters are trainable.

    Args:
        model: an ``nn.Module``, or a ``DistributedDataParallel`` wrapping one. Inputs are batch-first, batch 0
            included.
        loss_reduction: ``"mean"`` (default, as PyTorch's losses and Opacus) or ``"sum"``, how the loss combines
            the samples' losses.
        norms_only: compute norms (and clipped sums) only (default False).

    Raises:
        TypeError: model is not an nn.Module, norms_only not a bool; the model contains a DataParallel, an FSDP
            module or a DistributedDataParallel other than the model itself; the model is a DistributedDataParallel
            built with static_graph=True.
        ValueError: an unknown loss_reduction. At a forward inside the context: a batch_norm with the batch's
            statistics; an embedding with ``scale_grad_by_freq`` or ``sparse``; a module that must be rerun per
            sample whose forward draws random numbers, returns something other than one tensor, or changes its
            input in place; the forward is compiled by torch.compile; it runs inside a DistributedDataParallel
            that synchronises gradients (the model given was its inner module). During the backward: a gradient
            that reaches a parameter from outside the model's forward (a weight penalty in the loss); a layer
            called on another number of samples than the first one (part of the batch, or the batch folded into
            another dim); a backward of another batch (see Micro-batches).

    Source: the docs' "Per-sample gradients and DP-SGD" guide; Opacus's GradSampleModule (grad_sample's definition,
    its functorch fallback) and DistributedDPOptimizer (clipping before the all-reduce); Abadi et al., "Deep
    learning with differential privacy" (2016) for clipping.

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
        >>> psg.report()["0.weight"]
        'conv2d'
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
        self._params: dict[int, nn.Parameter] = {}
        self._param_names: dict[int, str] = {}
        self._find_params()
        self._mode = Capture(self)
        self._handles: list[Any] = []
        self._stack: list[Frame] = []
        self._rerunning = 0  # inside a per-sample rerun: the hooks stand aside
        self._pulling = 0  # inside a pull-back through a transform: the parameters' hooks stand aside
        self._no_sync = contextlib.ExitStack()
        self._guard = BatchGuard()
        self._calls = 0  # taps so far, numbering each one for the batch guard
        self._forget()

    def _find_params(self) -> None:
        """The trainable parameters as they are now (once each: a tied parameter keeps its first name), and the
        ones each module holds."""
        self._params, self._param_names = {}, {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self._params[id(p)] = p
                self._param_names[id(p)] = name
        self._holds = {m: frozenset(id(p) for p in m.parameters() if id(p) in self._params) for m in self._names}

    # ---- context --------------------------------------------------------------------------------
    def __enter__(self) -> PerSampleGrads:
        self.clear()
        self._find_params()  # requires_grad may have changed since the context was built
        for m in self._names:  # first among the pre-hooks: a weight_norm hook's weight is then computed captured
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        # a gradient that reaches a parameter through autograd did not come through the captured forward
        self._handles += [p.register_hook(functools.partial(self._direct_use, p)) for p in self._params.values()]
        if self._ddp is not None:
            self._no_sync.enter_context(self._ddp.no_sync())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._stack:  # a forward that raised before its outermost module's hook ran
            self._stack.clear()
            self._mode.__exit__(None, None, None)
        self._no_sync.close()

    def clear(self) -> None:
        """Forget every per-sample result: ``.grad_sample = None`` and no norms (called on entering)."""
        self._forget()
        for p in self._params.values():
            p.grad_sample = None  # type: ignore[attr-defined]

    def _forget(self) -> None:
        """This context's own results, none yet."""
        self._results = Results(self._params, self.norms_only, not self.norms_only and self._ddp is None)
        self._guard.clear()

    def report(self) -> dict[str, str]:
        """How each parameter's per-sample gradients were computed in this context's last forward.

        Returns:
            {parameter name: "conv2d", "linear", "conv2d through a transform (its weight computed from it)",
            "rerun of module 'blocks.0' (Block) per sample (mul)", several joined by "; "}, for the parameters
            that a captured forward reached.
        """
        return {self._param_names[pid]: "; ".join(sorted(how)) for pid, how in self._results.how.items()}

    # ---- where the forward is -------------------------------------------------------------------
    def _describe(self, module: nn.Module) -> str:
        return f"module {self._names.get(module, '?')!r} ({user_class(module).__name__})"

    def where(self) -> str:
        """The innermost running module, in words."""
        return self._describe(self._stack[-1].module) if self._stack else "the model's forward"

    def _pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self._rerunning:
            return
        if not self._stack:
            if not torch.is_grad_enabled():
                return
            if _compiled():
                raise ConvgradValueError(_COMPILED.format(name=self._names[module]))
            distributed.check_no_outer_sync()
            consts = [t for m in self._names for t in (*m.buffers(recurse=False),
                                                        *(p for p in m.parameters(recurse=False)
                                                          if id(p) not in self._params))]
            self._mode.reset(self._params, consts)
            self._mode.__enter__()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self._stack.append(Frame(module, args, kwargs, [(t, t._version) for t in tensors]))

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self._rerunning or not self._stack or self._stack[-1].module is not module:
            return None
        frame = self._stack.pop()
        if not self._stack:
            self._mode.__exit__(None, None, None)
        if not frame.rerun or output is None:  # nothing to rerun, or the forward raised
            return None
        with hidden():
            return self._tap_rerun(frame, output)

    def needs_rerun(self, sources: Sources, op: str) -> None:
        """An operation ``op`` met the samples with parameters (``sources``) outside any rule: the innermost
        running module that holds them all gets their per-sample gradients by rerunning its forward."""
        for frame in reversed(self._stack):
            if sources <= self._holds[frame.module]:
                frame.rerun = frame.rerun | sources
                frame.ops.add(op)
                return
        names = sorted(self._param_names[i] for i in sources)
        raise ConvgradValueError(f"PerSampleGrads: {op} in {self.where()} uses parameters {names} with the samples, "
                                 f"outside any per-sample rule, and no running module holds them all, so none can "
                                 f"be rerun per sample; call the module that holds them")

    def random_call(self, op: str) -> None:
        """A random operation ran: a module around it cannot be rerun per sample (checked at its end)."""
        for frame in self._stack:
            frame.random.add(op)

    # ---- taps -------------------------------------------------------------------------------------
    def tap(self, name: str, make: Callable[[torch.Tensor, torch.Tensor, float, dict[str, torch.Size]], Layer],
            x: torch.Tensor, out: torch.Tensor, operands: dict[str, Operand]) -> torch.Tensor:
        """Tap the output of a captured layer call, for its rule in the backward.

        Args:
            name: the function (``conv2d``).
            make: builds the rule from (input, grad_output, scale, {operand: shape}).
            x: the call's input (a batch of samples).
            out: the call's output.
            operands: the weight and bias operands that trainable parameters reach.
        """
        self._calls += 1
        where = f"{name} in {self.where()}"
        frames = tuple(self._stack)
        no_weight = scopes.weight_gradients_disabled
        is_conv = name.startswith("conv")
        for k, op in operands.items():
            computed = op.parameter(self._params) is None
            how = f"{name} through a transform (its {k} computed from it)" if computed else name
            for pid in op.sources:
                self._results.how.setdefault(pid, set()).add(how)
        callback = functools.partial(self._layer_backward, where, self._calls, frames, make, operands, is_conv,
                                     no_weight)
        with hidden():
            return Tap.apply(callback, 1, out, x.detach(), *(op.tensor for op in operands.values()))  # type: ignore[no-any-return]

    def _layer_backward(self, where: str, call: int, frames: tuple[Frame, ...], make: Any,
                        operands: dict[str, Operand], is_conv: bool, no_weight: bool,
                        saved: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        """One captured layer's part of the backward; its scratch buffers go after (``methods.one_layer``)."""
        self._guard.check_call(where, call)
        excluded = frozenset().union(*(f.rerun for f in frames))
        if is_conv and (no_weight or scopes.weight_gradients_disabled):  # the scope around forward or backward
            operands = {k: op for k, op in operands.items() if k != "weight"}
        operands = {k: op for k, op in operands.items() if op.sources - excluded}
        if not operands:
            return
        (x,) = saved
        gy = grad_output.detach()
        if x.is_floating_point() and x.dtype != gy.dtype:  # autocast: the input's own dtype (not an index)
            x = x.to(gy.dtype)
        scale = float(x.shape[0]) if self.loss_reduction == "mean" else 1.0
        with one_layer():
            layer = make(x, gy, scale, {k: op.tensor.shape for k, op in operands.items()})
            self._guard.check_size(where, layer.x.shape[0])
            self._results.remember_grads(frozenset().union(*(op.sources for op in operands.values())) - excluded)
            identity = {k: id(op.tensor) for k, op in operands.items() if op.parameter(self._params) is not None}
            if self.norms_only and len(identity) == len(operands):
                self._results.records.append(self._plan(layer, identity))
                return
            grads = layer.grads()
            self._pulling += 1  # the parameters' hooks stand aside: the transform's backward is ours
            try:
                per_param = pull_back(operands, grads, self._params, excluded)
            finally:
                self._pulling -= 1
            if self.norms_only:
                self._results.records.append(Record(frozenset(per_param), grads=per_param))
                return
            for pid, g in per_param.items():
                self._results.add_sample(pid, g)
            if self._ddp is None:  # under DDP this rank's sum alone would be a wrong .grad: clip_and_accumulate
                sums = {identity[k]: g for k, g in layer.summed({k: grads[k] for k in identity}).items()}
                for pid, g in per_param.items():
                    if pid not in sums:
                        sums[pid] = g.sum(0).div_(layer.scale)
                self._results.add_grads(sums)

    def _plan(self, layer: Layer, operands: dict[str, int]) -> Record:
        """norms_only: the layer's clipping plan; keep its per-sample gradients, or its state for one more pass."""
        rec = Record(frozenset(operands.values()), layer=layer, operands=operands)
        how, store = layer.clip_plan()
        if store:
            rec.materialised()
        else:
            rec.sq = layer.ghost_sq_norms() if how == "ghost" else layer.materialised_sq_norms()
        return rec

    def _tap_rerun(self, frame: Frame, output: Any) -> Any:
        """At the end of a forward that holds parameters to rerun per sample: check it can be, and tap its output."""
        where = self._describe(frame.module)
        names = sorted(self._param_names[i] for i in frame.rerun)
        ops = ", ".join(sorted(frame.ops))
        why = frame.refusal(output)
        if why:
            raise ConvgradValueError(f"PerSampleGrads: {where} must run its forward again per sample for parameters "
                                     f"{names} (they meet the samples in {ops}, which no per-sample rule covers), "
                                     f"but {why}")
        samples = {k: a for k, a in (*enumerate(frame.args), *frame.kwargs.items())
                   if isinstance(a, torch.Tensor) and self._mode.kind(a) is None}
        params = {n: p for n, p in frame.module.named_parameters() if id(p) in frame.rerun}
        for pid in frame.rerun:
            self._results.how.setdefault(pid, set()).add(f"rerun of {where} per sample ({ops})")
        self._calls += 1
        keys = list(samples)
        callback = functools.partial(self._rerun_backward, where, self._calls, frame, params, keys)
        return Tap.apply(callback, len(keys), output, *(samples[k].detach() for k in keys), *params.values())

    def _rerun_backward(self, where: str, call: int, frame: Frame, params: dict[str, nn.Parameter],
                        keys: list[int | str], saved: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        self._guard.check_call(where, call)
        gy = grad_output.detach()
        self._guard.check_size(where, gy.shape[0])
        scale = float(gy.shape[0]) if self.loss_reduction == "mean" else 1.0
        self._results.remember_grads(frame.rerun)
        self._rerunning += 1
        try:
            grads = rerun(frame.module, params, frame.args, frame.kwargs, dict(zip(keys, saved)), gy, scale)
        finally:
            self._rerunning -= 1
        per_param = {id(params[k]): g for k, g in grads.items()}
        if self.norms_only:
            self._results.records.append(Record(frozenset(per_param), grads=per_param))
            return
        for pid, g in per_param.items():
            self._results.add_sample(pid, g)
        if self._ddp is None:
            self._results.add_grads({pid: g.sum(0).div_(scale) for pid, g in per_param.items()})

    # ---- gradients ----------------------------------------------------------------------------------
    def _direct_use(self, param: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Hook on every trainable parameter: the captured forward hands autograd no gradient for it (its layers run
        on detached operands), so any gradient autograd brings comes from a use outside the model's forward."""
        if grad is None or self._pulling:
            return
        raise ConvgradValueError(
            f"PerSampleGrads: parameter {self._param_names[id(param)]!r} received a gradient from outside the "
            f"model's forward (a loss term such as a weight penalty, or a forward that ran outside the context); no "
            f"per-sample gradient can include that use, so its norms and clipped sum would be wrong. Apply weight "
            f"decay through the optimizer")

    def norms(self) -> torch.Tensor:
        """Per-sample L2 norms over the gradients of every parameter this context's backward reached.

        Returns:
            ``(N,)``, the norm of each sample's whole gradient (every layer, weight and bias); under
            DistributedDataParallel, of this rank's N samples. float32 for float16 and bfloat16 parameters: the
            squares accumulate in float32 (in float16 a norm of 360 would square to inf).

        Raises:
            RuntimeError: this context recorded no per-sample gradient (it was never entered, or no backward ran
                inside it since it was entered or cleared).
        """
        total = self._results.sq_norms()
        if total is None:
            raise RuntimeError("PerSampleGrads.norms: this context recorded no per-sample gradient; run the forward "
                               "pass and loss.backward() inside its `with PerSampleGrads(model)` block")
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
        clipped = self._results.clipped(factors)
        params = list(self._params.values())
        sums = [clipped[id(p)] if id(p) in clipped else torch.zeros_like(p) for p in params]
        if self._ddp is not None:
            distributed.all_reduce_sum(sums, self._ddp.process_group)
        for p, g in zip(params, sums, strict=True):
            before, g = self._results.before.get(id(p), p.grad), g.to(p.dtype)  # autocast: the parameter's dtype
            p.grad = g if before is None else before + g
        return norms

