"""The floor of the clipped DP-SGD step: per layer, the least measured cost of its per-sample norms and clipped sum
over every method, summed over the layers, beside the plain step and PerSampleGrads' clipped step (issue 38).

One clipped step of ``PerSampleGrads(norms_only=True, loss_reduction="sum")`` on a model of per_sample_models
(batch 32, float32) captures every layer call its rules serve, as the rule it built: the call's input, grad_output and
geometry. Then, on those very tensors, every way to get the layer's per-sample squared norms and its clipped sum is
timed alone (torch.utils.benchmark, the median of ``blocked_autorange``, after a warm-up call):

    conv      every option of the per-sample clip race, none pruned (``convgrad.per_sample.tuning.options``): ghost,
              unfold, conv, native (fft on large kernels), each followed by the Book-Keeping pass (one weight
              gradient of the batch on the per-sample-scaled grad_output, timed once per layer), and unfold+store,
              conv+store, native+store (materialised once, then a weighted sum); the bias's norms and sum added
    linear,   the rule's own ways (``convgrad.per_sample.rules``): its ghost norm where it has one, or the materialised
    norms,    norms, each followed by its clipped pass (``Layer.clipped``); or "stored": materialise, then the norms
    embedding and a weighted sum
    rerun     a module whose parameter meets the samples outside any rule (a layer-scale gamma): its forward run per
              sample (``convgrad.per_sample.fallback.rerun``), then the norms and a weighted sum; the only way

The floor of a layer is its least time over the ways PerSampleGrads may use there: storing only where the memory
rule allows it (``Layer.may_store``; the table gives the stored options' times either way). Identical layers (same
function, shapes and hyperparameters) are timed once and counted by their calls. A layer whose weight is computed
from parameters in the forward (NFNets' ScaledStdConv2d: a standardised weight times a gain) has one way per
materialising method ("unfold+pull-back", ...): the weight operand's per-sample gradients by that method, pulled
back to the parameters through the transform in one vmapped backward, as PerSampleGrads does, then the norms and a
weighted sum (the operand's ghost norm is not its parameters').

Beside the sum, in the same run: the plain step and PerSampleGrads' clipped step (``per_sample.time_model``:
interleaved rounds, medians, each round's ratio to plain), and the step's floor, the plain step less the weight
gradients it computes for these layers (each conv's and linear's Book-Keeping pass with all factors 1, the same
call), plus the sum of the floors. Norm layers' affine gradients and reruns count 0 there (torch computes the
affine gradients inside its fused norm backward), which keeps the step floor an upper bound of the true one by
those. A layer timed alone runs with warm caches, unlike inside a step.

Usage (results: benchmarks/results/per_sample_floor.{md,json}):
    PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE python benchmarks/per_sample_floor.py --threads 2
    PYTHONPATH=src python benchmarks/per_sample_floor.py --models small_cnn --batch 4 --min-time 0.01 --repeats 1 \\
        --out /tmp/floor                                                     # a quick check that it runs
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils import benchmark

sys.path.insert(0, str(Path(__file__).parent))
import per_sample
from per_sample_models import MODELS, TIMM, timm_available

import convgrad as cg
import convgrad.per_sample.session as session
from convgrad.functional import conv_bias_grad
from convgrad.per_sample import methods, rules, tuning
from convgrad.per_sample.functional import per_sample_bias_grad
from convgrad.tuning import device_name

MODELS_DEFAULT = ["resnet18", *TIMM]
STORED = ("+store", "stored")  # the ways that keep per-sample gradients: allowed where the memory rule allows it


@dataclasses.dataclass
class Row:
    """One layer shape of a step: how it was reached, its calls, and each way's time per call (norms + clipped sum).

    Attributes:
        what: the function ("conv2d", "linear", "group_norm", ...) or "rerun".
        where: the first module that made the call, as PerSampleGrads names it.
        shape: the call's shapes, in words.
        calls: identical calls in one step.
        store: whether PerSampleGrads may keep this layer's per-sample gradients (``Layer.may_store``).
        times: {way: seconds per call}.
        choice: the way PerSampleGrads took in the step.
        plain: seconds per call of the weight gradient that the plain step computes for this layer (0: none apart).
        shared: {part: seconds per call} that the ways include (the Book-Keeping pass, a pull-back).
    """

    what: str
    where: str
    shape: str
    calls: int
    store: bool
    times: dict[str, float]
    choice: str
    plain: float
    shared: dict[str, float]

    @property
    def floor_way(self) -> str:
        allowed = {k: t for k, t in self.times.items() if self.store or not k.endswith(STORED)}
        return min(allowed, key=allowed.__getitem__)

    @property
    def floor(self) -> float:
        """Seconds, all calls."""
        return self.times[self.floor_way] * self.calls

    @property
    def chosen(self) -> float | None:
        """Seconds, all calls, of PerSampleGrads' way."""
        return self.times[self.choice] * self.calls if self.choice in self.times else None


# ---- capture: the rules PerSampleGrads builds in one clipped step ---------------------------------------------
@dataclasses.dataclass
class Captured:
    what: str
    where: str
    identity: bool  # its weight and bias operands are the parameters themselves (no transform to pull back)
    layer: rules.Layer | None = None
    operands: dict[str, Any] = dataclasses.field(default_factory=dict)  # {operand: operands.Operand}
    params: dict[int, nn.Parameter] = dataclasses.field(default_factory=dict)  # the parameters behind them, by id
    rerun: tuple[Any, ...] = ()  # fallback.rerun's arguments


def capture(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[Captured]:
    """Every layer call of one clipped step, in the order the backward meets them. It wraps the session's ``tap``
    (every rule-served call passes it its rule's maker; ``convgrad.per_sample.session``) and the ``rerun`` that the
    session calls."""
    psg = cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True)
    params = {id(p): p for p in model.parameters()}
    names = {m: name or "(the model)" for name, m in model.named_modules()}
    out: list[Captured] = []
    tap, rerun = session.Session.tap, session.rerun

    def recording_tap(self: session.Session, name: str, make: Any, x: torch.Tensor, y: torch.Tensor,
                      operands: dict[str, Any]) -> Any:
        where = self.where()
        identity = all(len(op.sources) == 1 and id(op.tensor) in params for op in operands.values())

        def recording_make(*args: Any) -> rules.Layer:
            layer = make(*args)
            behind = {i: params[i] for op in operands.values() for i in op.sources}
            out.append(Captured(name, where, identity, layer=layer, operands=operands, params=behind))
            return layer
        return tap(self, name, recording_make, x, y, operands)

    def recording_rerun(module: nn.Module, *args: Any) -> Any:
        out.append(Captured("rerun", f"module {names[module]!r} ({type(module).__name__})", True,
                            rerun=(module, *args)))
        return rerun(module, *args)

    session.Session.tap = recording_tap  # type: ignore[method-assign]
    session.rerun = recording_rerun  # type: ignore[assignment]
    try:
        with psg:
            # retained: a computed weight's transform graph, which the pull-backs timed later go through
            per_sample.loss(model(x), y).backward(retain_graph=True)
        psg.clip_and_accumulate(per_sample.MAX_NORM)
    finally:
        session.Session.tap = tap  # type: ignore[method-assign]
        session.rerun = rerun  # type: ignore[assignment]
    return out


# ---- the ways of one captured layer ------------------------------------------------------------------------------
def _seconds(fn: Callable[[], object], threads: int, min_time: float) -> float:
    fn()  # warm-up: the first call at a shape pays one-time costs
    timer = benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)
    return float(timer.blocked_autorange(min_run_time=min_time).median)


Timer = Callable[[Callable[[], object]], float]


@dataclasses.dataclass
class Ways:
    """The timed ways of one layer: {way: seconds per call}, the parts they share, and plain's share."""

    times: dict[str, float]
    shared: dict[str, float]  # parts every way (or every way of a kind) includes, for the reader
    plain: float  # seconds of the weight gradient the plain step computes for this layer (0: none apart)


def _conv(layer: rules.ConvLayer, time: Timer) -> Ways:
    """Every option of the clip race of a conv layer whose operands are its parameters."""
    spec, sides = layer.spec, layer.sides
    n = spec.batch
    norms = tuning.options(spec, *sides, "clip", False, book=False)  # each option's squared norms alone
    stored = {k: r for k, r in tuning.options(spec, *sides, "clip", True).items() if k.endswith("+store")}
    book = time(lambda: tuning.book_keeping(spec, *sides))
    shared = {"Book-Keeping pass (in those without +store)": book}
    bias = 0.0
    if layer.has_bias:  # the same in every option: its per-sample sums over positions, and one sum for the clip
        bias = shared["bias (in each)"] = time(lambda: (methods.sq_norms(per_sample_bias_grad(layer.gy)),
                                              conv_bias_grad(layer.gy)))
    times = {k: time(lambda r=r: r(n)) + book + bias for k, r in norms.items()}
    times.update({k: time(lambda r=r: r(n)) + bias for k, r in stored.items()})
    return Ways(times, shared, book)


def _stored(grads: dict[str, torch.Tensor], ones: torch.Tensor) -> object:
    """Norms and weighted sums of materialised per-sample gradients."""
    return [(methods.sq_norms(g), torch.tensordot(ones.to(g.dtype), g, dims=1)) for g in grads.values()]


def _ones(layer: rules.Layer) -> torch.Tensor:
    """Clipping factors of 1, one per sample."""
    return torch.ones(layer.x.shape[0], dtype=methods.norm_dtype(layer.gy.dtype))


def _rule(layer: rules.Layer, linear: bool, time: Timer) -> Ways:
    """The ways of a linear, norm or embedding rule whose operands are its parameters."""
    ones = _ones(layer)
    clip = time(lambda: layer.clipped(ones))
    times = {"materialised": time(layer.materialised_sq_norms) + clip}
    if type(layer).ghost_sq_norms is not rules.Layer.ghost_sq_norms:  # the rule has a ghost norm
        times["ghost"] = time(layer.ghost_sq_norms) + clip
    times["stored"] = time(lambda: _stored(layer.grads(), ones))
    return Ways(times, {"clipped pass (in ghost and materialised)": clip}, clip if linear else 0.0)


def _pulled(c: Captured, layer: rules.Layer, time: Timer) -> Ways:
    """A layer whose weight is computed from parameters in the forward (a standardised weight): the operands'
    per-sample gradients (a conv's weight by each materialising method), pulled back to the parameters through the
    transform in one vmapped backward (as PerSampleGrads does), then the norms and a weighted sum."""
    ones = _ones(layer)
    computed = [k for k, op in c.operands.items() if not (len(op.sources) == 1 and op.tensor is c.params.get(
        next(iter(op.sources))))]
    params = list(c.params.values())

    def pull(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        got = torch.autograd.grad([c.operands[k].tensor for k in computed], params, [grads[k] for k in computed],
                                  retain_graph=True, allow_unused=True, is_grads_batched=True)
        out = {f"param {i}": g for i, g in enumerate(got) if g is not None}
        return out | {k: g for k, g in grads.items() if k not in computed}  # operands that are parameters

    if isinstance(layer, rules.ConvLayer):
        spec, sides = layer.spec, layer.sides
        bias = {"bias": per_sample_bias_grad(layer.gy)} if layer.has_bias else {}
        makers = {m: (lambda m=m: {"weight": methods.weight_grad(spec, *sides, m), **bias})
                  for m in tuning.raced(spec, "grads", False)}
        plain = time(lambda: tuning.book_keeping(spec, *sides))
    else:
        makers = {"materialised": layer.grads}
        plain = time(lambda: layer.clipped(ones)) if c.what == "linear" else 0.0
    grads = next(iter(makers.values()))()  # the same values by every method: the pull-back is timed once
    rest = time(lambda: _stored(pull(grads), ones))
    return Ways({f"{m}+pull-back": time(make) + rest for m, make in makers.items()},
                {"pull-back, norms and sum (in each)": rest}, plain)


def _rerun(c: Captured, time: Timer) -> Ways:
    """A module's forward run per sample for the parameters no rule reaches: the only way."""
    gy = c.rerun[5]  # fallback.rerun's grad_output
    ones = torch.ones(gy.shape[0], dtype=methods.norm_dtype(gy.dtype))
    return Ways({"rerun": time(lambda: _stored(session.rerun(*c.rerun), ones))}, {}, 0.0)


def _choice(c: Captured) -> str:
    """The way PerSampleGrads took for this layer in the step (its plan is the tuned choice, looked up)."""
    if c.layer is None:
        return "rerun"
    if not c.identity:  # materialised by the method tuned for all per-sample gradients, then pulled back
        if isinstance(c.layer, rules.ConvLayer):
            return tuning.method_for(c.layer.spec, *c.layer.sides, "grads") + "+pull-back"
        return "materialised+pull-back"
    how, store = c.layer.clip_plan()
    if isinstance(c.layer, rules.ConvLayer):
        return how + ("+store" if store else "")
    return "ghost" if how == "ghost" else "stored" if store else "materialised"


def _key(c: Captured) -> tuple[Any, ...]:
    """What makes two calls the same work: the function, the shapes and the hyperparameters."""
    if c.layer is None:
        module, params, _, _, samples, gy, _ = c.rerun
        return ("rerun", type(module), tuple((k, tuple(p.shape)) for k, p in params.items()),
                tuple(tuple(s.shape) for s in samples.values()), tuple(gy.shape))
    layer = c.layer
    hyper = tuple(sorted((k, repr(v)) for k, v in getattr(layer, "hyper", {}).items()
                         if not isinstance(v, torch.Tensor)))
    spec = layer.spec if isinstance(layer, rules.ConvLayer) else None
    return (c.what, c.identity, spec, tuple(layer.x.shape), tuple(layer.gy.shape), hyper,
            tuple(sorted((k, tuple(s)) for k, s in layer.shapes.items())), layer.may_store)


def _shape(c: Captured) -> str:
    if c.layer is None:
        module, params, *_ = c.rerun
        return f"{', '.join(params)} of {type(module).__name__}"
    layer = c.layer
    if isinstance(layer, rules.ConvLayer):
        s = layer.spec
        return (f"{tuple(s.input_shape[1:])} * {tuple(layer.weight_shape)} s{s.stride[0]}"
                + (f" g{s.groups}" if s.groups > 1 else ""))
    return f"{tuple(layer.x.shape[1:])}, {', '.join(f'{k} {tuple(v)}' for k, v in layer.shapes.items())}"


def rows(captured: list[Captured], threads: int, min_time: float) -> list[Row]:
    """One timed row per distinct layer call, in the order of their first calls."""
    def time(fn: Callable[[], object]) -> float:
        return _seconds(fn, threads, min_time)

    groups: dict[tuple[Any, ...], list[Captured]] = {}
    for c in captured:
        groups.setdefault(_key(c), []).append(c)
    out = []
    for same in groups.values():
        c = same[0]
        with torch.no_grad():
            if c.layer is None:
                ways, store = _rerun(c, time), True
            elif not c.identity:  # the parameters' per-sample gradients exist only by materialising the operands'
                ways, store = _pulled(c, c.layer, time), True
            elif isinstance(c.layer, rules.ConvLayer):
                ways, store = _conv(c.layer, time), c.layer.may_store
            else:
                ways, store = _rule(c.layer, c.what == "linear", time), c.layer.may_store
        out.append(Row(c.what, c.where, _shape(c), len(same), store, ways.times, _choice(c), ways.plain,
                       ways.shared))
    return out


# ---- one model ------------------------------------------------------------------------------------------------
def measure(name: str, threads: int, min_time: float, repeats: int) -> dict[str, Any]:
    """The rows of one model and, in the same run, its plain step and PerSampleGrads' clipped step."""
    torch.manual_seed(0)
    model = MODELS[name]()
    x, y = per_sample.data(name)
    table = rows(capture(model, x, y), threads, min_time)
    steps = {(r["contender"], r["quantity"]): r for r in
             per_sample.time_model(name, [("plain", "-"), ("convgrad", "c")], repeats)}
    return {"model": name, "rows": [dataclasses.asdict(r) | {"floor_s": r.floor, "floor_way": r.floor_way,
                                                             "chosen_s": r.chosen} for r in table],
            "sum_s": sum(r.floor for r in table), "chosen_sum_s": sum(r.chosen or 0.0 for r in table),
            "plain_share_s": sum(r.plain * r.calls for r in table), "steps": {f"{c} {q}": s for (c, q), s in
                                                                              steps.items()}}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def markdown(result: dict[str, Any]) -> str:
    """The per-layer table of one model, its sums and the step's figures."""
    lines = [f"## {result['model']}", "",
             "| layer | where (first in the backward) | shape | calls | store | every way, ms per call | "
             "floor, ms (all calls) | PerSampleGrads' way, ms (all calls) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        ways = ", ".join(f"{k} {_ms(t)}" + (" (not allowed)" if not r["store"] and k.endswith(STORED) else "")
                         for k, t in sorted(r["times"].items(), key=lambda kv: kv[1]))
        if r["shared"]:
            ways += "; including " + ", ".join(f"{k} {_ms(t)}" for k, t in r["shared"].items())
        chosen = f"{r['choice']} {_ms(r['chosen_s'])}" if r["chosen_s"] is not None else f"{r['choice']} (not timed)"
        lines.append(f"| {r['what']} | {r['where']} | {r['shape']} | {r['calls']} | {'yes' if r['store'] else 'no'} "
                     f"| {ways} | {r['floor_way']} {_ms(r['floor_s'])} | {chosen} |")
    lines.append(f"| **sum** | | | {sum(r['calls'] for r in result['rows'])} | | | **{_ms(result['sum_s'])}** | "
                 f"{_ms(result['chosen_sum_s'])} |")
    steps = result["steps"]
    plain, ours = steps.get("plain -", {}), steps.get("convgrad c", {})
    lines.append("")
    if "time_s" in plain and "time_s" in ours:
        floor = plain["time_s"] - result["plain_share_s"] + result["sum_s"]
        lines += [f"- plain step: {_ms(plain['time_s'])} ms",
                  f"- PerSampleGrads' clipped step: {_ms(ours['time_s'])} ms, {ours['ratio']:.2f}x plain (IQR "
                  f"{ours['iqr'][0]:.2f}-{ours['iqr'][1]:.2f})",
                  f"- weight gradients the plain step computes for these layers: {_ms(result['plain_share_s'])} ms",
                  f"- the clipped step's floor: plain - those + the sum of the floors = {_ms(floor)} ms, "
                  f"{floor / plain['time_s']:.2f}x plain"]
    else:
        lines += [f"- {k}: error: {s.get('error', '?')}" for k, s in steps.items() if "time_s" not in s]
    return "\n".join(lines) + "\n"


def _explained() -> str:
    """The module doc's paragraphs between its summary and its usage, as markdown (the indented list fenced)."""
    paragraphs = __doc__.split("\nUsage")[0].split("\n\n")[1:]
    return "\n\n".join(f"```text\n{p}\n```" if p.startswith("    ") else p for p in paragraphs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=MODELS_DEFAULT)
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--batch", type=int, default=per_sample.BATCH, help=f"samples (default {per_sample.BATCH})")
    p.add_argument("--min-time", type=float, default=0.2, help="seconds per timed way (default 0.2)")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds of the two steps (default 7)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_sample_floor")
    args = p.parse_args(argv)
    if min(args.threads, args.batch, args.repeats) < 1 or args.min_time <= 0:
        p.error(f"--threads {args.threads}, --batch {args.batch}, --repeats {args.repeats} must be at least 1 and "
                f"--min-time {args.min_time} positive")
    per_sample.BATCH = args.batch
    torch.set_num_threads(args.threads)
    results, skipped = [], []
    for name in args.models:
        if name in TIMM and not timm_available():
            skipped.append(f"{name}: timm is not installed (benchmarks/requirements.txt)")
            continue
        print(f"{name} ...", file=sys.stderr, flush=True)
        results.append(measure(name, args.threads, args.min_time, args.repeats))
    command = "PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE python benchmarks/per_sample_floor.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    head = ["# The floor of the clipped DP-SGD step", "",
            f"Made by: `{command.strip()}`", "",
            f"{device_name(torch.device('cpu'))}, {args.threads} threads, torch {torch.__version__}, "
            f"{platform.python_implementation()} {platform.python_version()}; batch {args.batch}, float32, "
            f"loss_reduction='sum'; each way the median of torch.utils.benchmark's blocked_autorange "
            f"({args.min_time} s), the steps the median of {args.repeats} interleaved rounds.", "",
            _explained(), ""]
    if skipped:
        head += ["Skipped: " + "; ".join(skipped) + ".", ""]
    md = "\n".join(head) + "\n" + "\n".join(markdown(r) for r in results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(md)
    args.out.with_suffix(".json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
