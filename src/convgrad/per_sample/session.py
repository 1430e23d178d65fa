"""The machinery of one PerSampleGrads context (``convgrad.per_sample.model``): the module hooks, the capture mode,
the taps of the captured calls and their part of the backward.

A pre-hook and a forward hook on every module keep the stack of the modules whose forward runs; the outermost
forward runs with the capture mode on the stack (``convgrad.per_sample.capture``), which hands this session each
layer call a parameter reaches (``tap``) and each operation where one meets the samples outside any rule
(``needs_rerun``). In the backward, a layer's tap builds its rule from (input, grad_output) and pulls the operands'
per-sample gradients back to their parameters (``convgrad.per_sample.operands``); a rerun module's tap runs its
forward per sample (``convgrad.per_sample.fallback``). What comes out goes to the context's ``Results``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from convgrad import scopes
from convgrad.errors import ConvgradValueError
from convgrad.per_sample import distributed
from convgrad.per_sample.capture import Capture
from convgrad.per_sample.fallback import Frame, rerun
from convgrad.per_sample.methods import one_layer
from convgrad.per_sample.operands import Operand, Sources, pull_back
from convgrad.per_sample.results import Record, Results
from convgrad.per_sample.rules import Layer
from convgrad.per_sample.tap import BatchGuard, Tap
from convgrad.reach import hidden, user_class

__all__ = ["Session"]

COMPILED = (
    "PerSampleGrads: the forward of module {name!r} is being compiled by torch.compile; per-sample gradients are "
    "captured from the eager forward (every function call it makes), which a compiled graph does not make. Call "
    "the model itself inside the context, not torch.compile(model) (compile the rest of the training step, or use "
    "Opacus's hooks under compile); the model was left as it was")


def _compiled() -> bool:
    """Whether this forward runs under torch.compile: traced by Dynamo, or run by it eagerly after a graph break
    (Dynamo's frame callback is then still set; a ``torch.compiler.disable``d region clears it)."""
    return torch.compiler.is_compiling() or torch._C._dynamo.eval_frame.get_eval_frame_callback() is not None


class Session:
    """The hooks, the capture mode and the taps of one context (see the module doc).

    Args:
        model: the model (a DistributedDataParallel's inner hooks are its modules' too).
        loss_reduction: "mean" or "sum".
        norms_only: keep records for the norms and the clip instead of per-sample gradients.
        ddp: the DistributedDataParallel the model is, or None.
    """

    def __init__(self, model: nn.Module, loss_reduction: str, norms_only: bool, ddp: nn.Module | None) -> None:
        self.model, self.loss_reduction, self.norms_only, self.ddp = model, loss_reduction, norms_only, ddp
        self.names = {m: name or "(the model itself)" for name, m in model.named_modules()}
        self.params: dict[int, nn.Parameter] = {}
        self.param_names: dict[int, str] = {}
        self.find_params()
        self.mode = Capture(self)
        self.guard = BatchGuard()
        self._handles: list[Any] = []
        self._stack: list[Frame] = []
        self._rerunning = 0  # inside a per-sample rerun: the hooks stand aside
        self._pulling = 0  # inside a pull-back through a transform: the parameters' hooks stand aside
        self._calls = 0  # taps so far, numbering each one for the batch guard
        self.results = Results(self.params, norms_only, not norms_only and ddp is None)

    def find_params(self) -> None:
        """The trainable parameters as they are now (once each: a tied parameter keeps its first name), and the
        ones each module holds."""
        self.params, self.param_names = {}, {}
        for name, p in self.model.named_parameters():
            if p.requires_grad:
                self.params[id(p)] = p
                self.param_names[id(p)] = name
        self._holds = {m: frozenset(id(p) for p in m.parameters() if id(p) in self.params) for m in self.names}

    def forget(self) -> None:
        """Start with no results."""
        self.results = Results(self.params, self.norms_only, not self.norms_only and self.ddp is None)
        self.guard.clear()

    def install(self) -> None:
        """The hooks on every module and every trainable parameter (``remove`` takes them off)."""
        for m in self.names:  # first among the pre-hooks: a weight_norm hook's weight is then computed captured
            self._handles.append(m.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
            self._handles.append(m.register_forward_hook(self._post, with_kwargs=True, always_call=True))
        # a gradient that reaches a parameter through autograd did not come through the captured forward
        self._handles += [p.register_hook(functools.partial(self._direct_use, p)) for p in self.params.values()]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._stack:  # a forward that raised before its outermost module's hook ran
            self._stack.clear()
            self.mode.__exit__(None, None, None)

    # ---- where the forward is -------------------------------------------------------------------
    def _describe(self, module: nn.Module) -> str:
        return f"module {self.names.get(module, '?')!r} ({user_class(module).__name__})"

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
                raise ConvgradValueError(COMPILED.format(name=self.names[module]))
            distributed.check_no_outer_sync()
            consts = [t for m in self.names for t in (*m.buffers(recurse=False),
                                                        *(p for p in m.parameters(recurse=False)
                                                          if id(p) not in self.params))]
            self.mode.reset(self.params, consts)
            self.mode.__enter__()
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        self._stack.append(Frame(module, args, kwargs, [(t, t._version) for t in tensors]))

    def _post(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> Any:
        if self._rerunning or not self._stack or self._stack[-1].module is not module:
            return None
        frame = self._stack.pop()
        if not self._stack:
            self.mode.__exit__(None, None, None)
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
        names = sorted(self.param_names[i] for i in sources)
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
        no_weight = bool(scopes.weight_gradients_disabled)  # a count of open scopes
        is_conv = name.startswith("conv")
        for k, op in operands.items():
            computed = op.parameter(self.params) is None
            how = f"{name} through a transform (its {k} computed from it)" if computed else name
            for pid in op.sources:
                self.results.how.setdefault(pid, set()).add(how)
        callback = functools.partial(self._layer_backward, where, self._calls, frames, make, operands, is_conv,
                                     no_weight)
        with hidden():
            tapped = Tap.apply(callback, 1, out, x.detach(), *(op.tensor for op in operands.values()))
        return tapped  # type: ignore[no-any-return]

    def _layer_backward(self, where: str, call: int, frames: tuple[Frame, ...], make: Any,
                        operands: dict[str, Operand], is_conv: bool, no_weight: bool,
                        saved: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        """One captured layer's part of the backward; its scratch buffers go after (``methods.one_layer``)."""
        self.guard.check_call(where, call)
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
            self.guard.check_size(where, layer.x.shape[0])
            self.results.remember_grads(frozenset().union(*(op.sources for op in operands.values())) - excluded)
            identity = {k: id(op.tensor) for k, op in operands.items() if op.parameter(self.params) is not None}
            if self.norms_only and len(identity) == len(operands):
                self.results.records.append(self._plan(layer, identity))
                return
            grads = layer.grads()
            self._pulling += 1  # the parameters' hooks stand aside: the transform's backward is ours
            try:
                per_param = pull_back(operands, grads, self.params, excluded)
            finally:
                self._pulling -= 1
            if self.norms_only:
                self.results.records.append(Record(frozenset(per_param), grads=per_param))
                return
            for pid, g in per_param.items():
                self.results.add_sample(pid, g)
            if self.ddp is None:  # under DDP this rank's sum alone would be a wrong .grad: clip_and_accumulate
                sums = {identity[k]: g for k, g in layer.summed({k: grads[k] for k in identity}).items()}
                for pid, g in per_param.items():
                    if pid not in sums:
                        sums[pid] = g.sum(0).div_(layer.scale)
                self.results.add_grads(sums)

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
        names = sorted(self.param_names[i] for i in frame.rerun)
        ops = ", ".join(sorted(frame.ops))
        why = frame.refusal(output)
        if why:
            raise ConvgradValueError(f"PerSampleGrads: {where} must run its forward again per sample for parameters "
                                     f"{names} (they meet the samples in {ops}, which no per-sample rule covers), "
                                     f"but {why}")
        arguments: list[tuple[int | str, Any]] = [*enumerate(frame.args), *frame.kwargs.items()]
        samples = {k: a for k, a in arguments if isinstance(a, torch.Tensor) and self.mode.kind(a) is None}
        params = {n: p for n, p in frame.module.named_parameters() if id(p) in frame.rerun}
        for pid in frame.rerun:
            self.results.how.setdefault(pid, set()).add(f"rerun of {where} per sample ({ops})")
        self._calls += 1
        keys = list(samples)
        callback = functools.partial(self._rerun_backward, where, self._calls, frame, params, keys)
        return Tap.apply(callback, len(keys), output, *(samples[k].detach() for k in keys), *params.values())

    def _rerun_backward(self, where: str, call: int, frame: Frame, params: dict[str, nn.Parameter],
                        keys: list[int | str], saved: tuple[torch.Tensor, ...], grad_output: torch.Tensor) -> None:
        self.guard.check_call(where, call)
        gy = grad_output.detach()
        self.guard.check_size(where, gy.shape[0])
        scale = float(gy.shape[0]) if self.loss_reduction == "mean" else 1.0
        self.results.remember_grads(frame.rerun)
        self._rerunning += 1
        try:
            grads = rerun(frame.module, params, frame.args, frame.kwargs, dict(zip(keys, saved)), gy, scale)
        finally:
            self._rerunning -= 1
        per_param = {id(params[k]): g for k, g in grads.items()}
        if self.norms_only:
            self.results.records.append(Record(frozenset(per_param), grads=per_param))
            return
        for pid, g in per_param.items():
            self.results.add_sample(pid, g)
        if self.ddp is None:
            self.results.add_grads({pid: g.sum(0).div_(scale) for pid, g in per_param.items()})

    # ---- gradients ----------------------------------------------------------------------------------
    def _direct_use(self, param: nn.Parameter, grad: torch.Tensor | None) -> None:
        """Hook on every trainable parameter: the captured forward hands autograd no gradient for it (its layers run
        on detached operands), so any gradient autograd brings comes from a use outside the model's forward."""
        if grad is None or self._pulling:
            return
        raise ConvgradValueError(
            f"PerSampleGrads: parameter {self.param_names[id(param)]!r} received a gradient from outside the "
            f"model's forward (a loss term such as a weight penalty, or a forward that ran outside the context); no "
            f"per-sample gradient can include that use, so its norms and clipped sum would be wrong. Apply weight "
            f"decay through the optimizer")
