"""The per-call cost of convgrad's Python path against plain torch, every ratio measured in one process.

(a) drop-in: ``convgrad.nn.Conv2d`` against ``torch.nn.Conv2d``, forward and backward of a tiny conv, (1, 8, 40, 40)
    with a 1x1 kernel and stride 2 (issue 25's example), for backend="auto" (let settle first) and "native";
(b) functional: ``cg.conv2d(backend="native")`` and ``cg.conv2d(backend="auto")`` against ``F.conv2d``, same conv;
(c) auto against native over the smoke suite's layers (``convgrad bench --suite smoke``), where auto's settled
    choice is native for the forward and both gradients, in two entry points: the autograd one (``cg.conv``,
    forward and backward) and the backend one (``conv_backward``, both gradients, as ``convgrad bench`` times it);
    the geometric mean of the per-layer ratios;
(f) frames: the Python frames and C calls each contender of (a) and (b) runs per forward + backward, counted by
    ``sys.setprofile`` over one call once settled: deterministic, so it shows a cut where timings are noise.

Timing: every contender of a comparison is timed in each round, in an order that rotates from round to round,
each by ``torch.utils.benchmark.Timer.timeit`` over enough calls to last ``--min-time``; a round's ratio divides
by the baseline's time in that round, and the report gives the median over ``--rounds`` rounds and its IQR.
The clock is the thread's CPU time by default (``--clock cpu``): on a machine shared with other work it counts
the work done rather than the waiting; ``--clock wall`` times wall clock. One thread (``--threads``).
Auto tunes (``CONVGRAD_AUTOTUNE=tune`` is set here) and every auto contender runs until its choices settle.

Usage:
    PYTHONPATH=src python benchmarks/overhead.py                     # everything, 15 rounds
    PYTHONPATH=src python benchmarks/overhead.py --parts a b --rounds 31 --clock wall
    PYTHONPATH=src python benchmarks/overhead.py --parts f                # frames per call, no timing
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from collections.abc import Callable

os.environ["CONVGRAD_AUTOTUNE"] = "tune"  # before convgrad reads it

import torch
import torch.nn.functional as F
from torch.utils import benchmark

import convgrad as cg
from convgrad.backends import auto
from convgrad.cli.bench.layers import SUITES, Layer

TARGETS = {"a": 1.15, "c": 1.05}
Step = Callable[[], None]


def _clock(name: str) -> Callable[[], float]:
    return time.thread_time if name == "cpu" else time.perf_counter


def compare(steps: dict[str, Step], baseline: str, rounds: int, min_time: float,
            clock: str) -> dict[str, tuple[float, float, float]]:
    """Per contender: (median ratio to the baseline over the rounds, its first and third quartiles)."""
    timer = _clock(clock)
    numbers = {}
    for name, step in steps.items():  # warm up, and calls per sample from one timed block
        for _ in range(5):
            step()
        t = benchmark.Timer("step()", globals={"step": step}, timer=timer).blocked_autorange(min_run_time=min_time)
        numbers[name] = max(1, round(min_time / max(t.median, 1e-9)))
    names = list(steps)
    ratios: dict[str, list[float]] = {n: [] for n in names if n != baseline}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        seconds = {n: benchmark.Timer("step()", globals={"step": steps[n]}, timer=timer).timeit(numbers[n]).mean
                   for n in order}
        for n in ratios:
            ratios[n].append(seconds[n] / seconds[baseline])
    out = {}
    for n, values in ratios.items():
        q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
        out[n] = (statistics.median(values), q[0], q[2])
    return out


def _fwd_bwd(forward: Callable[[], torch.Tensor]) -> Step:
    def step() -> None:
        y = forward()
        y.backward(torch.ones_like(y))
    return step


def _settle(step: Step, keys: Callable[[], bool], limit: int = 200) -> None:
    """Run step until keys() says auto's choices settled (or limit calls)."""
    for _ in range(limit):
        step()
        if keys():
            return


def _no_pending() -> bool:
    return all(not c.pending for c in auto._choices.values())


def part_a(args: argparse.Namespace) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(1, 8, 40, 40, requires_grad=True)
    ref = torch.nn.Conv2d(8, 8, 1, stride=2)
    ours = {b: cg.nn.Conv2d(8, 8, 1, stride=2, backend=b) for b in ("auto", "native")}
    for m in ours.values():
        m.load_state_dict(ref.state_dict())
    steps = {"torch.nn.Conv2d": _fwd_bwd(lambda: ref(x))}
    steps |= {f"convgrad.nn.Conv2d backend={b!r}": _fwd_bwd(lambda m=m: m(x)) for b, m in ours.items()}
    _settle(steps["convgrad.nn.Conv2d backend='auto'"], _no_pending)
    res = compare(steps, "torch.nn.Conv2d", args.rounds, args.min_time, args.clock)
    return _lines("(a) drop-in layer, forward + backward, (1, 8, 40, 40) 1x1 stride 2, x torch.nn.Conv2d", res,
                  TARGETS["a"])


def part_b(args: argparse.Namespace) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(1, 8, 40, 40, requires_grad=True)
    w = torch.randn(8, 8, 1, 1, requires_grad=True)
    b = torch.randn(8, requires_grad=True)
    steps = {"F.conv2d": _fwd_bwd(lambda: F.conv2d(x, w, b, 2))}
    steps |= {f"cg.conv2d backend={be!r}": _fwd_bwd(lambda be=be: cg.conv2d(x, w, b, 2, backend=be))
              for be in ("native", "auto")}
    _settle(steps["cg.conv2d backend='auto'"], _no_pending)
    res = compare(steps, "F.conv2d", args.rounds, args.min_time, args.clock)
    return _lines("(b) functional, forward + backward, same conv, x F.conv2d", res, None)


def _layer_steps(layer: Layer) -> dict[str, dict[str, Step]]:
    """Per entry point, native's and auto's step on one layer."""
    torch.manual_seed(0)
    spec = layer.spec()
    x = torch.randn(spec.input_shape, requires_grad=True)
    w = torch.randn(spec.weight_shape, requires_grad=True)
    gy = torch.randn(spec.output_shape)
    kw = dict(stride=layer.stride, padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
    fn = cg.conv_transpose if layer.transposed else cg.conv
    if layer.transposed:
        kw["output_padding"] = layer.output_padding
    xd, wd = x.detach(), w.detach()
    geometry = (layer.stride, layer.padding, layer.dilation, layer.transposed, layer.output_padding, layer.groups)
    return {
        "cg.conv forward + backward": {
            be: (lambda be=be: fn(x, w, **kw, backend=be).backward(gy)) for be in ("native", "auto")},
        "conv_backward (both gradients)": {
            be: (lambda be=be: cg.conv_backward(gy, xd, wd, None, *geometry, backend=be)) for be in ("native", "auto")},
    }


def part_c(args: argparse.Namespace) -> list[str]:
    lines = ["(c) auto x native on the smoke suite's layers where auto settled on native throughout"]
    per_entry: dict[str, list[float]] = {"cg.conv forward + backward": [], "conv_backward (both gradients)": []}
    for layer in SUITES["smoke"]:
        entries = _layer_steps(layer)
        for steps in entries.values():
            _settle(steps["auto"], _no_pending)
        spec = layer.spec()
        like = torch.empty(spec.output_shape)
        chosen = {g: getattr(auto.chosen(spec, g, like), "backend", "native") for g in ("both", "forward")}
        if set(chosen.values()) != {"native"}:
            lines.append(f"    {layer.name}: auto chose {chosen}, left out")
            continue
        for entry, steps in entries.items():
            ratio = compare(steps, "native", args.rounds, args.min_time, args.clock)["auto"]
            per_entry[entry].append(ratio[0])
            lines.append(f"    {layer.name:28s} {entry:32s} auto/native {ratio[0]:.3f} (IQR {ratio[1]:.3f}-"
                         f"{ratio[2]:.3f})")
    for entry, ratios in per_entry.items():
        if ratios:
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            lines.append(f"  {entry}: geomean auto/native {geo:.3f} over {len(ratios)} layers (target <= "
                         f"{TARGETS['c']}: {'met' if geo <= TARGETS['c'] else 'missed'})")
    return lines


def _calls(step: Step) -> tuple[int, int]:
    """(Python frames, C calls) that one call of step runs, the profiler's own call excluded."""
    counts = {"call": 0, "c_call": 0}

    def count(frame: object, event: str, arg: object) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(count)
    try:
        step()
    finally:
        sys.setprofile(None)
    return counts["call"], counts["c_call"] - 1  # the C call of sys.setprofile(None) itself


def part_f(args: argparse.Namespace) -> list[str]:
    torch.manual_seed(0)
    x = torch.randn(1, 8, 40, 40, requires_grad=True)
    ref = torch.nn.Conv2d(8, 8, 1, stride=2)
    w, b = ref.weight, ref.bias
    mods = {be: cg.nn.Conv2d(8, 8, 1, stride=2, backend=be) for be in ("native", "auto")}
    steps = {"torch.nn.Conv2d": _fwd_bwd(lambda: ref(x))}
    steps |= {f"convgrad.nn.Conv2d backend={be!r}": _fwd_bwd(lambda m=m: m(x)) for be, m in mods.items()}
    steps["F.conv2d"] = _fwd_bwd(lambda: F.conv2d(x, w, b, 2))
    steps |= {f"cg.conv2d backend={be!r}": _fwd_bwd(lambda be=be: cg.conv2d(x, w, b, 2, backend=be))
              for be in ("native", "auto")}
    for step in steps.values():
        _settle(step, _no_pending)
        step()  # a settled call fills the memos its next call reads
    lines = ["(f) Python frames and C calls per forward + backward of (a) and (b)'s conv, once settled"]
    for name, step in steps.items():
        frames, c_calls = _calls(step)
        lines.append(f"    {name:38s} {frames:4d} Python frames {c_calls:4d} C calls")
    return lines


def _lines(title: str, res: dict[str, tuple[float, float, float]], target: float | None) -> list[str]:
    lines = [title]
    for name, (median, lo, hi) in res.items():
        verdict = "" if target is None else f"  (target <= {target}: {'met' if median <= target else 'missed'})"
        lines.append(f"    {name:38s} {median:.3f}x  (IQR {lo:.3f}-{hi:.3f}){verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", nargs="+", choices=("a", "b", "c", "f"), default=["a", "b", "c"])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample (default 0.05)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.clock} clock, {args.rounds} rounds")
    for part in args.parts:
        print("\n".join({"a": part_a, "b": part_b, "c": part_c, "f": part_f}[part](args)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
