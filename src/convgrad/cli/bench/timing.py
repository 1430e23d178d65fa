"""Timing for `convgrad bench`: every backend, interleaved with native's forward, native and a matmul of equal FLOPs.

For each layer and dtype, every (backend, task) pair, native's forward convolution and the reference
matmul are timed with ``torch.utils.benchmark.Timer`` once per round. Within a round the backends of
one task are timed one right after another, since every ratio compares two of them on the same task;
the forward is timed right before the backends' ``both``, to which it is compared. The order of the
tasks and of the backends rotates from round to round, so that load on a shared machine hits all of
them alike. Each sample is the mean of enough calls to last ``min_time`` seconds; the report uses the
median and the interquartile range of the samples, and of the ratios within a round.
Tasks: ``grad_input``, ``grad_weight`` and ``both`` (one ``Backend.backward`` call). The forward is
the bar a backward is measured against: grad_input and grad_weight each do one forward's
multiply-adds, so a backward that runs at its forward's efficiency takes 2x the forward. The
matmul is ``torch.matmul`` of two m x m matrices with 2*m^3 ~= the FLOPs of one gradient: the
machine's dense throughput, measured in the same run, is the reference for the physical limit.

``auto`` is timed as a training run meets it after its first steps: before the rounds, its calls run until
each of its three choices has settled (auto compares the surviving candidates on the calls that follow its
tuning, running the slower ones in turn). Timed while still comparing, auto's figure mixed in its losing
candidates: in a float64 run it measured 1.22x native on a layer where it had chosen native for all three
tasks. The cost of tuning and settling is what ``benchmarks/first_step.py`` reports.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import benchmark

from convgrad.backends import get_backend, native
from convgrad.cli.bench.layers import Layer
from convgrad.tensor_ops import CHANNELS_LAST

__all__ = ["FORWARD", "TASKS", "LayerTiming", "Sample", "time_layer"]

TASKS = ("grad_input", "grad_weight", "both")
FORWARD = ("forward", "")  # the key of native's forward convolution among the timed calls


@dataclass
class Sample:
    """The samples (seconds per call) of one (backend, task), or the reference matmul."""

    seconds: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def iqr(self) -> float:
        """Interquartile range (0 with fewer than 2 samples)."""
        return _iqr(self.seconds)


def _iqr(values: list[float]) -> float:
    """Interquartile range (0 with fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


@dataclass
class LayerTiming:
    """Everything measured for one layer in one dtype."""

    layer: Layer
    dtype: str
    matmul_size: int
    matmul: Sample
    samples: dict[tuple[str, str], Sample]  # (backend, task) -> samples
    forward: Sample = field(default_factory=Sample)  # native's forward convolution
    auto_choice: dict[str, str] = field(default_factory=dict)  # gradient -> backend chosen by auto

    def median(self, backend: str, task: str) -> float:
        return self.samples[(backend, task)].median

    def ratio(self, backend: str, task: str, reference: str = "native") -> float:
        """Time relative to the reference backend's (native's by default): the median over rounds of the ratio
        within each round. Both were timed moments apart in every round, so load that comes and goes over a
        run cancels out of each ratio instead of landing on whichever backend it happened to hit."""
        return statistics.median(self._ratios(backend, task, reference))

    def ratio_iqr(self, backend: str, task: str, reference: str = "native") -> float:
        """The interquartile range of the per-round ratios that ``ratio`` takes the median of."""
        return _iqr(self._ratios(backend, task, reference))

    def x_forward(self, backend: str, task: str = "both") -> float:
        """Time as a multiple of native's forward: the median over rounds of the ratio within each round."""
        return statistics.median(self._over_forward(backend, task))

    def x_forward_iqr(self, backend: str, task: str = "both") -> float:
        """The interquartile range of the per-round ratios that ``x_forward`` takes the median of."""
        return _iqr(self._over_forward(backend, task))

    def _ratios(self, backend: str, task: str, reference: str) -> list[float]:
        ours, ref = self.samples[(backend, task)].seconds, self.samples[(reference, task)].seconds
        return [a / b for a, b in zip(ours, ref, strict=True)]

    def _over_forward(self, backend: str, task: str) -> list[float]:
        return [a / b for a, b in zip(self.samples[(backend, task)].seconds, self.forward.seconds, strict=True)]

    def gflops(self, backend: str, task: str) -> float:
        flop = self.layer.gflop() * (2 if task == "both" else 1)
        return flop / self.median(backend, task)

    def matmul_fraction(self, backend: str, task: str) -> float:
        """GFLOP/s as a fraction of the reference matmul's GFLOP/s."""
        matmul_gflops = 2 * self.matmul_size ** 3 / 1e9 / self.matmul.median
        return self.gflops(backend, task) / matmul_gflops


def _tensors(layer: Layer, dtype: torch.dtype, device: torch.device, channels_last: bool) -> dict[str, Any]:
    spec = layer.spec()
    g = torch.Generator().manual_seed(0)

    def rand(shape: tuple[int, ...]) -> torch.Tensor:
        t = torch.randn(shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)
        if channels_last and t.dim() in (4, 5):
            t = t.contiguous(memory_format=CHANNELS_LAST[t.dim()])
        return t

    return {"spec": spec, "input": rand(spec.input_shape), "weight": rand(spec.weight_shape),
            "grad_output": rand(spec.output_shape)}


def _calls(backend: str, t: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    b = get_backend(backend, "convgrad bench")
    spec, x, w, gy = t["spec"], t["input"], t["weight"], t["grad_output"]
    return {"grad_input": lambda: b.input_grad(spec, w, gy), "grad_weight": lambda: b.weight_grad(spec, x, gy),
            "both": lambda: b.backward(spec, gy, x, w, True, True)}


def _timer(fn: Callable[[], Any], threads: int) -> benchmark.Timer:
    return benchmark.Timer("fn()", globals={"fn": fn}, num_threads=threads)


def _number(timer: benchmark.Timer, min_time: float) -> int:
    """Calls per sample so that one sample lasts about min_time (after one warm-up call)."""
    once = timer.timeit(1).mean
    return max(1, math.ceil(min_time / max(once, 1e-9)))


def _round_order(backends: list[str], r: int) -> list[tuple[str, str]]:
    """Round r's order: task by task (rotated), each task's backends (rotated) back to back, native's forward right
    before "both", then the matmul."""
    b, t = r % len(backends), r % len(TASKS)
    order: list[tuple[str, str]] = []
    for task in TASKS[t:] + TASKS[:t]:
        order += [FORWARD] if task == "both" else []
        order += [(name, task) for name in backends[b:] + backends[:b]]
    return [*order, ("matmul", "")]


_SETTLE_CALLS = 200  # auto compares at most 7 rounds of two calls per surviving candidate


def _settle(choice: Callable[[], Any], call: Callable[[], Any]) -> None:
    """Call auto until its choice has no comparison pending (at most _SETTLE_CALLS calls)."""
    for _ in range(_SETTLE_CALLS):
        current = choice()
        if current is None or not current.pending:
            return
        call()


def time_layer(layer: Layer, dtype: str, backends: list[str], device: torch.device, threads: int, repeats: int,
               min_time: float, channels_last: bool = False) -> Iterator[LayerTiming]:
    """Time one layer in rounds; yields the (growing) result after every round, for progress bars."""
    torch_dtype = getattr(torch, dtype)
    t = _tensors(layer, torch_dtype, device, channels_last)
    names = ["native", *(b for b in backends if b != "native")]
    with torch.no_grad():
        fns = {(b, task): fn for b in names for task, fn in _calls(b, t).items()}
        m = max(1, round((layer.spec().macs()) ** (1 / 3)))
        a, c = torch.randn(m, m, dtype=torch_dtype, device=device), torch.randn(m, m, dtype=torch_dtype, device=device)
        fns[("matmul", "")] = lambda: torch.matmul(a, c)
        fns[FORWARD] = lambda: native.forward(t["spec"], t["input"], t["weight"], None)
        timers = {key: _timer(fn, threads) for key, fn in fns.items()}
        numbers = {key: _number(timer, min_time) for key, timer in timers.items()}  # first calls also tune auto
        result = LayerTiming(layer, dtype, m, Sample(), {key: Sample() for key in fns if key[1]})
        if "auto" in names:
            from convgrad.backends import auto

            previous = torch.get_num_threads()  # auto keys its choices by the thread count the Timers run with
            torch.set_num_threads(threads)
            try:
                for gradient in ("grad_input", "grad_weight", "both"):
                    _settle(lambda g=gradient: auto.chosen(t["spec"], g, t["grad_output"]), fns["auto", gradient])
                    choice = auto.chosen(t["spec"], gradient, t["grad_output"])
                    result.auto_choice[gradient] = choice.backend if choice else auto.FIXED_CHOICE
            finally:
                torch.set_num_threads(previous)
        for r in range(repeats):
            for key in _round_order(names, r):
                seconds = timers[key].timeit(numbers[key]).mean
                sample = {"matmul": result.matmul, "forward": result.forward}.get(key[0]) if not key[1] else None
                (sample or result.samples[key]).seconds.append(seconds)
            yield result
