"""What a model's convolutions run: every conv call of one forward, how convgrad reached it, and what auto chose.

``report(model, *inputs)`` runs the model's forward once, in eval mode with gradients enabled and no backward (its
norms' running statistics do not move, its dropout draws nothing), with a recording mode on the stack
(``convgrad.reach``): it sees every conv call that reaches convgrad (a patched conv module, a ``F.conv*d`` that
patch routed, a ``convgrad.nn`` module) and every one that does not (a torch conv no patch reached). For each call
it then reads auto's choices for that layer from auto's store (``convgrad.backends.auto.chosen``): after a training
step, they are what runs; before one, nothing is tuned yet.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from convgrad.backends import auto, get_backend
from convgrad.checks import check_module
from convgrad.nn.modules import EVERYWHERE
from convgrad.reach import CONV_FUNCTIONS, ConvCall, ReachMode, hidden
from convgrad.spec import ConvSpec

__all__ = ["ConvCallReport", "ModelReport", "report"]


@dataclass(frozen=True)
class ConvCallReport:
    """One conv call of the forward.

    Attributes:
        module: the qualified name of the module whose forward made the call ("" for the model itself).
        call: how it was made: a conv module's class (``Conv2d``) or a function in a forward
            (``conv2d in BlurPool.forward``).
        layer: the layer, in torch's argument names (``ConvSpec.describe``).
        summary: the layer in a few characters for the table: channels, kernel, the stride, padding, dilation and
            groups that differ from 1 and 0, the input's spatial size (``8->16 k3x3 s2 p1 g2 @32x32``).
        backend: the backend it runs with; "torch" where convgrad did not reach it.
        forward: what computes its forward.
        gradients: what computes grad_input and grad_weight ("native", "fft", "fwdconv / gemm" where they differ,
            "-" where none is needed).
        why: the reason, with the tuned times where auto measured them.
        pending: the candidates auto still compares on the calls that follow, for the forward or the gradients
            (empty: settled, or nothing to compare).
    """

    module: str
    call: str
    layer: str
    summary: str
    backend: str
    forward: str
    gradients: str
    why: str
    pending: tuple[str, ...] = ()


@dataclass
class ModelReport:
    """Every conv call of one forward (``report``); ``str()`` is a table, ``to_json()`` its rows."""

    calls: list[ConvCallReport]

    @property
    def settled(self) -> bool:
        """Whether auto compares nothing more for any call (what the calls that follow run is decided)."""
        return not any(c.pending for c in self.calls)

    @property
    def reached(self) -> int:
        """How many calls convgrad reached (all but the ones torch ran alone)."""
        return sum(c.backend != "torch" for c in self.calls)

    def to_json(self) -> str:
        return json.dumps([asdict(c) for c in self.calls], indent=1)

    def __str__(self) -> str:
        head = ["module", "call", "layer", "backend", "forward", "gradients", "why"]
        rows = [[c.module or "(model)", c.call, c.summary, c.backend, c.forward, c.gradients, c.why]
                for c in self.calls]
        footer = [f"{self.reached} of {len(self.calls)} conv calls reached by convgrad"]
        forwards = {r[4] for r in rows}
        if len(forwards) == 1:  # one forward for every call (native, mostly): said once, under the table
            footer.append(f"forward: {forwards.pop()} for every call")
            head.pop(4)
            for r in rows:
                r.pop(4)
        rows.insert(0, head)
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = ["  ".join(v.ljust(w) for v, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        return "\n".join([*lines, *footer])


class _Recorder(ReachMode):
    """Records each conv call that reaches convgrad (``conv``) or passes it by (``__torch_function__``)."""

    captures = True

    def __init__(self, where: Callable[[], nn.Module | None]) -> None:
        super().__init__()
        self.where = where
        self.calls: list[tuple[nn.Module | None, ConvCall, str]] = []  # (module, call, backend)

    def conv(self, call: ConvCall, forward: Callable[[ConvCall], torch.Tensor], backend: str | None) -> torch.Tensor:
        self.calls.append((self.where(), call, backend or "torch"))
        return forward(call)

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        return self.torch_conv(func, args, kwargs) if func in CONV_FUNCTIONS else func(*args, **kwargs)


def _summary(spec: ConvSpec) -> str:
    """``ConvSpec.describe`` in a few characters (``ConvCallReport.summary``)."""
    def dims(values: tuple[int, ...]) -> str:
        return str(values[0]) if len(set(values)) == 1 else "x".join(map(str, values))

    pads = spec.padding
    pad = (dims(tuple(lo for lo, _ in pads)) if all(lo == hi for lo, hi in pads)
           else ",".join(f"{lo}/{hi}" for lo, hi in pads))
    parts = [f"{'T ' if spec.transposed else ''}{spec.in_channels}->{spec.out_channels}",
             "k" + "x".join(map(str, spec.kernel_size))]
    parts += [f"{tag}{text}" for tag, text, plain in (("s", dims(spec.stride), "1"), ("p", pad, "0"),
                                                      ("d", dims(spec.dilation), "1"),
                                                      ("op", dims(spec.output_padding), "0"),
                                                      ("g", str(spec.groups), "1")) if text != plain]
    return " ".join(parts) + " @" + "x".join(map(str, spec.input_size))


def _times(choice: auto.Choice) -> str:
    """The tuned times, fastest first: ``fft 1.20 ms, native 24.9 ms``."""
    ranked = sorted(choice.times.items(), key=lambda kv: kv[1])[:4]
    return ", ".join(f"{name} {seconds * 1e3:.3g} ms" for name, seconds in ranked)


def _like(spec: ConvSpec, like: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """A stand-in for a grad_output of this layer as auto's keys read it (dtype, device, layout), without its data:
    a broadcast view whose channel stride is 1 (channels last) or 0 (contiguous, for the key)."""
    shape = spec.output_shape if not spec.unbatched else (1, *spec.output_shape)
    base = like.new_empty((1, shape[1], *(1,) * (len(shape) - 2)) if channels_last else (1,) * len(shape))
    return base.expand(shape)


def _choices(spec: ConvSpec, backend: str, everywhere: bool, like: torch.Tensor, need_input: bool,
             need_weight: bool) -> tuple[str, str, str, tuple[str, ...]]:
    """(forward, gradients, why, pending) for one call; ``like``: its input."""
    wanted = "both" if need_input and need_weight else "grad_input" if need_input else "grad_weight"
    if not (need_input or need_weight):
        wanted = ""
    if backend == "torch":
        return "torch", "torch" if wanted else "-", "not reached by convgrad: patch(model) reaches it", ()
    if not everywhere and not get_backend(backend).can_serve(spec, like):
        return "native", "native" if wanted else "-", (f"{backend}'s cost model rules it out here: torch's own conv "
                                                      f"(patch(..., force=True) forces {backend})"), ()
    if backend != "auto":
        return "native", backend if wanted else "-", "the module's backend", ()
    if auto.fixed():
        return "native", "native" if wanted else "-", "auto in fixed mode (CONVGRAD_AUTOTUNE=fixed): native", ()
    forward = auto.chosen(spec, "forward", like)
    grads, layout = None, ""
    for last in (False, True):  # grad_output's layout is the backward's: a key for either
        grads = auto.chosen(spec, wanted, _like(spec, like, last)) if wanted else None
        if grads is not None:
            layout = " (grad_output channels last)" if last else ""
            break
    why = []
    if forward is not None:
        why.append(f"forward: {_times(forward)}")
    if grads is not None:
        why.append(f"{wanted}{layout}: {_times(grads)}")
        if grads.pending:
            why.append(f"still comparing {', '.join(grads.pending)} on the calls that follow")
        if grads.rejected:
            why.append(f"disagreed with native: {', '.join(grads.rejected)}")
    fwd = "native" if forward is None or auto.get_forward_mode() == "native" else forward.backend
    if not wanted:
        gradients = "-"
    elif grads is None:
        gradients = "not tuned yet"
        why.append("run a training step first")
    elif grads.backend == "split":
        gradients = " / ".join(grads.parts)
    else:
        gradients = grads.backend
    pending = tuple(dict.fromkeys((*(forward.pending if forward else ()), *(grads.pending if grads else ()))))
    return fwd, gradients, "; ".join(why) or "native: no other candidate", pending


def report(model: nn.Module, *args: Any, **kwargs: Any) -> ModelReport:
    """Every conv call of one forward of ``model``: how convgrad reached it and what auto chose for it, and why.

    Runs ``model(*args, **kwargs)`` once, in eval mode with gradients enabled and no backward (the model's modes are
    put back), and reads auto's store for each call: call it after a training step to see what that step ran.

    Args:
        model: a model (patched or not; an unpatched model's convs are reported as torch's).
        args, kwargs: the inputs of one forward, e.g. a batch of the training data (the batch size decides the
            tuning's bucket, ``convgrad.backends.auto``).

    Returns:
        A ``ModelReport``: ``.calls`` (one ``ConvCallReport`` per call, in the order of the forward), ``str()`` a
        table, ``to_json()``.

    Raises:
        TypeError: model is not an ``nn.Module``.

    Source: the docs' "Backends and auto-tuning" page.

    Examples:
        >>> import torch, convgrad as cg
        >>> model = cg.patch(torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.Conv2d(2, 2, 1)), "fwdconv")
        >>> r = cg.report(model, torch.randn(4, 1, 8, 8))
        >>> [(c.module, c.call, c.gradients) for c in r.calls]
        [('0', 'Conv2d', 'fwdconv'), ('1', 'Conv2d', 'fwdconv')]
    """
    check_module("report", model)
    names = {m: name for name, m in model.named_modules()}
    stack: list[nn.Module] = []
    recorder = _Recorder(lambda: stack[-1] if stack else None)

    def pre(module: nn.Module, inputs: Any) -> None:
        stack.append(module)

    def post(module: nn.Module, inputs: Any, output: Any) -> None:
        if stack and stack[-1] is module:
            stack.pop()

    modes = {m: m.training for m in model.modules()}
    handles = [h for m in names for h in (m.register_forward_pre_hook(pre, prepend=True),
                                          m.register_forward_hook(post, always_call=True))]
    try:
        model.eval()
        with torch.enable_grad(), recorder:
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, training in modes.items():
            m.training = training
    rows = []
    with hidden():
        for module, call, backend in recorder.calls:
            spec = ConvSpec.from_shapes(call.input.shape, call.weight.shape, call.stride, call.padding, call.dilation,
                                        call.transposed, call.output_padding, call.groups, fn=call.fn)
            batched = call.input if call.input.dim() == call.weight.dim() else call.input.unsqueeze(0)
            everywhere = True if module is None else module.__dict__.get(EVERYWHERE, True)
            forward, gradients, why, pending = _choices(spec, backend, everywhere, batched, call.input.requires_grad,
                                                        call.weight.requires_grad)
            rows.append(ConvCallReport(names.get(module, "") if module is not None else "", call.fn,
                                       spec.describe(), _summary(spec), backend, forward, gradients, why, pending))
    return ModelReport(rows)
