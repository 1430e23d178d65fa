"""The capture mode of PerSampleGrads: what each torch function call of a model's forward does with the parameters.

While a model's forward runs inside ``PerSampleGrads``, this mode (a ``convgrad.reach.ReachMode``) sees every torch
function call. It sorts the tensors the forward handles into three kinds:

    CONST   buffers, frozen parameters, tensors made from nothing (``torch.ones(...)``), tensors that need no
            gradient: no sample, no trainable parameter
    PARAM   a trainable parameter, or a tensor computed from parameters and constants alone (a standardised
            weight, ``w0 + B @ A``, ``gain * w``): it carries its *sources*, the parameters it was computed from
    SAMPLE  everything else: the model's inputs and whatever is computed from them

and acts on each call by the kinds of its operands:

    a layer function (conv, ``rules.FUNCTIONS``)   the layer runs on its detached weight and bias (no batch-summed
      with a SAMPLE input and PARAM weight/bias    weight gradient is computed), and its output is tapped: in the
                                                   backward the rule gives the per-sample gradients of the weight
                                                   and bias operands, which the context pulls back to their sources
                                                   through the transform (``PerSampleGrads``)
    an operation on PARAM and CONST alone          part of a transform: it runs as it is; its output is PARAM
    any other operation that meets PARAM with      its PARAM operands run detached, and the innermost module whose
      SAMPLE (a layer-scale γ * x, x + pos_embed)  forward is running and that holds all their sources gets the
                                                   per-sample gradients of those sources from its own forward, per
                                                   sample (``convgrad.per_sample.fallback``)
    anything else                                  runs as it is (SAMPLE)

A call that cannot have per-sample gradients (a batch norm with the batch's statistics) is refused by name, as is a
random operation inside a module that must be rerun per sample (the rerun would draw other numbers).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from convgrad.errors import ConvgradValueError
from convgrad.per_sample.operands import Operand, Sources
from convgrad.per_sample.rules import FUNCTIONS, ConvLayer, Layer
from convgrad.reach import CONV_FUNCTIONS, ConvCall, ReachMode, bind_arguments
from convgrad.spec import ConvSpec

__all__ = ["CONST", "Capture", "Owner"]

CONST: Sources = frozenset()
# torch functions that draw random numbers: a module rerun per sample would draw other ones
_RANDOM = {torch.bernoulli, torch.Tensor.bernoulli, torch.Tensor.bernoulli_, torch.rand, torch.rand_like,
           torch.randn, torch.randn_like, torch.randint, torch.randint_like, torch.randperm, torch.normal,
           torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_, torch.Tensor.exponential_,
           torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_, torch.multinomial,
           torch.poisson, F.gumbel_softmax, F.rrelu}
# dropout functions -> their default `training`: random only in training mode with p > 0 (input, p, training, inplace)
_DROPOUTS = {F.dropout: True, F.dropout1d: True, F.dropout2d: True, F.dropout3d: True, F.alpha_dropout: False,
             F.feature_alpha_dropout: False}


class Owner(Protocol):
    """What the capture mode asks of the context that keeps its results (``PerSampleGrads``)."""

    def where(self) -> str:
        """The innermost running module, in words."""

    def tap(self, name: str, make: Callable[[torch.Tensor, torch.Tensor, float, dict[str, torch.Size]], Layer],
            x: torch.Tensor, out: torch.Tensor, operands: dict[str, Operand]) -> torch.Tensor:
        """Tap a captured layer call's output for its rule in the backward."""

    def needs_rerun(self, sources: Sources, op: str) -> None:
        """A parameter met the samples outside any rule."""

    def random_call(self, op: str) -> None:
        """A random operation ran."""


def _tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[torch.Tensor]:
    """The tensors among a call's arguments, one level into lists and tuples (torch.cat's list)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _detached(value: Any, kinds: Callable[[torch.Tensor], Sources | None]) -> Any:
    """``value`` with every PARAM tensor in it detached (one level into lists and tuples)."""
    if isinstance(value, torch.Tensor):
        sources = kinds(value)
        return value.detach() if sources else value
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v, kinds) for v in value)
    return value


class Capture(ReachMode):
    """The capture mode of one PerSampleGrads context (see the module doc).

    Args:
        owner: the context; it keeps what the calls record and knows which module's forward is running.
    """

    captures = True

    def __init__(self, owner: Owner) -> None:
        super().__init__()
        self.owner = owner
        self._kinds: dict[int, tuple[weakref.ref[torch.Tensor], Sources]] = {}

    # ---- the kinds -------------------------------------------------------------------------------
    def reset(self, params: dict[int, torch.nn.Parameter], consts: list[torch.Tensor]) -> None:
        """Start a forward: the trainable parameters are PARAM (their own source), ``consts`` (buffers, frozen
        parameters, tensors kept as module attributes) CONST."""
        self._kinds = {}
        for pid, p in params.items():
            self._mark(p, frozenset((pid,)))
        for t in consts:
            self._mark(t, CONST)

    def _mark(self, t: torch.Tensor, sources: Sources) -> None:
        self._kinds[id(t)] = (weakref.ref(t), sources)

    def kind(self, t: torch.Tensor) -> Sources | None:
        """The sources of a PARAM tensor, CONST (empty) for a constant, None for SAMPLE."""
        entry = self._kinds.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _param(self, t: Any) -> Sources:
        """The sources of a PARAM operand that needs a gradient, else empty."""
        if not isinstance(t, torch.Tensor) or not t.requires_grad:
            return CONST
        return self.kind(t) or CONST

    def _mark_outputs(self, out: Any, sources: Sources) -> None:
        if isinstance(out, torch.Tensor):
            self._mark(out, sources if out.requires_grad else CONST)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self._mark(o, sources if o.requires_grad else CONST)

    # ---- every call --------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in CONV_FUNCTIONS:
            return self.torch_conv(func, args, kwargs)
        rule = FUNCTIONS.get(func)
        if rule is not None:
            return self._layer(func, rule, args, kwargs)
        if func in _RANDOM or (func in _DROPOUTS and self._drops(func, args, kwargs)):
            self.owner.random_call(getattr(func, "__name__", str(func)))
        return self._generic(func, args, kwargs)

    @staticmethod
    def _drops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether a dropout call draws random numbers (training mode, p > 0)."""
        bound = bind_arguments(func.__name__, ("input", "p", "training", "inplace"), (0.5, _DROPOUTS[func], False),
                               args, kwargs)
        return bool(bound["training"]) and bound["p"] > 0

    def _generic(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Any operation that is no layer function: a transform, a meeting of PARAM with SAMPLE, or plain."""
        sources, sample, seen = CONST, False, False
        for t in _tensors(args, kwargs):
            seen = True
            k = self.kind(t)
            if k is None:
                sample = True
            else:
                sources = sources | k
        if not seen:  # made from nothing (torch.ones, arange): a constant
            out = func(*args, **kwargs)
            self._mark_outputs(out, CONST)
            return out
        if not sample:  # a transform of parameters and constants
            out = func(*args, **kwargs)
            self._mark_outputs(out, sources)
            return out
        if not sources:
            return func(*args, **kwargs)
        # PARAM meets SAMPLE outside any rule: the module that holds the sources reruns its forward per sample
        self.owner.needs_rerun(sources, getattr(func, "__name__", str(func)))
        kinds = self.kind
        return func(*_detached(args, kinds), **{k: _detached(v, kinds) for k, v in kwargs.items()})

    # ---- layer functions -------------------------------------------------------------------------------
    def _layer(self, func: Any, rule: type[Layer], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        name = getattr(func, "__name__", str(func))
        bound = bind_arguments(name, *rule.SIGNATURE, args, kwargs)
        x = bound[rule.INPUT]
        if not isinstance(x, torch.Tensor) or self.kind(x) is not None:
            return self._generic(func, args, kwargs)  # no sample in: part of a transform (a standardised weight)
        why = rule.refusal(bound)
        if why is not None:
            raise ConvgradValueError(f"PerSampleGrads: {name} in {self.owner.where()} {why}")
        operands = {k: Operand(bound[k], s) for k in rule.OPERANDS if (s := self._param(bound.get(k)))}
        others = [bound[k] for k in bound if k not in (rule.INPUT, *rule.OPERANDS)]
        if not operands or any(self.kind(t) is None for t in _tensors(tuple(others), {})):
            return self._generic(func, args, kwargs)
        out = func(**{**bound, **{k: op.tensor.detach() for k, op in operands.items()}})

        def make(x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size]) -> Layer:
            return rule.from_call(bound, x, gy, scale, shapes)

        return self.owner.tap(name, make, x, out, operands)

    def conv(self, call: ConvCall, forward: Callable[[ConvCall], torch.Tensor], backend: str | None) -> torch.Tensor:
        """A conv call (reached here, or handed on by routing or by convgrad's ``apply``): captured as a layer where
        a sample meets a parameter, run by ``forward`` either way."""
        x = call.input
        operands = {k: Operand(t, s) for k, t in (("weight", call.weight), ("bias", call.bias))
                    if t is not None and (s := self._param(t))}
        if not operands:
            return self._conv_generic(call, forward)
        if self.kind(x) is not None:  # parameters and constants only: a transform
            out = forward(call)
            self._mark_outputs(out, frozenset().union(*(op.sources for op in operands.values())))
            return out
        bias = call.bias
        detached = call.with_operands(call.weight.detach() if "weight" in operands else call.weight,
                                      bias.detach() if bias is not None and "bias" in operands else bias)
        out = forward(detached)

        def make(x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size]) -> Layer:
            if x.dim() == call.weight.dim() - 1:  # unbatched: one sample, whose "mean" loss is its own
                x, gy, scale = x.unsqueeze(0), gy.unsqueeze(0), 1.0  # (1, C, *spatial)
            spec = ConvSpec.from_shapes(x.shape, call.weight.shape, call.stride, call.padding, call.dilation,
                                        call.transposed, call.output_padding, call.groups, fn=call.fn)
            return ConvLayer(spec, x, gy, scale, call.weight.shape, shapes)

        return self.owner.tap(call.function, make, x, out, operands)

    def _conv_generic(self, call: ConvCall, forward: Callable[[ConvCall], torch.Tensor]) -> torch.Tensor:
        """A conv no trainable parameter reaches as its weight or bias: plain, a transform (a parameter as its
        input, constants elsewhere), or a parameter in its input meeting a sample in its weight."""
        kinds = [self.kind(t) for t in (call.input, call.weight, call.bias) if t is not None]
        sources = frozenset().union(*(k for k in kinds if k))
        if all(k is not None for k in kinds):
            out = forward(call)
            self._mark_outputs(out, sources)
            return out
        if not sources:
            return forward(call)
        self.owner.needs_rerun(sources, call.fn)
        return forward(ConvCall(call.fn, call.input.detach(), call.weight, call.bias, call.stride, call.padding,
                                call.dilation, call.transposed, call.output_padding, call.groups))
