"""Timing for `convgrad bench`: every backend, interleaved with native's forward, native and a matmul of equal FLOPs.

For each layer and dtype, every (backend, task) pair, native's forward convolution and the reference
matmul are timed once per round. Within a round the backends of one task are timed one right after
another, since every speed-up compares two of them on the same task; the forward is timed right before
the backends' ``both``, to which it is compared. The order of the tasks and of the backends rotates from
round to round, so that load on a shared machine hits all of them alike. Each sample is the mean of
enough calls to last ``min_time`` seconds, or one call where one call lasts longer (a sample of several
calls starts with one untimed call, one of a single call does not: torch.utils.benchmark's ``timeit``
added two untimed calls to every sample, which tripled the cost of a layer whose calls take seconds).
The report uses the median and the interquartile range of the samples, and of the speed-ups within a
round.
Tasks: ``grad_input``, ``grad_weight`` and ``both`` (one ``Backend.backward`` call). The forward is
the bar a backward is measured against: grad_input and grad_weight each do one forward's
multiply-adds, so a backward that runs at its forward's efficiency takes 2 forwards. The
matmul is ``torch.matmul`` of two m x m matrices with 2*m^3 ~= the FLOPs of one gradient: the
machine's dense throughput, measured in the same run, is the reference for the physical limit.

``auto`` is timed as a training run meets it after its first steps: before the rounds, its calls run until
each of its three choices has settled (auto compares the surviving candidates on the calls that follow its
tuning, running the slower ones in turn). Timed while still comparing, auto's figure mixed in its losing
candidates: in a float64 run it measured 1.22x native on a layer where it had chosen native for all three
tasks. A choice can also be tuned again during the rounds (auto's drift watch, when its calls run much slower
than when it was tuned, as on a loaded machine): a round in which a choice of auto changed timed those
candidates too, so it is settled again and the round timed again (``LayerTiming.retimed``). A row the docs
published read ``1.52 | 1.53 | 0.39 ± 10.00`` (auto's grad_input and grad_weight 1.5x native's time, both
0.39x, its quartiles 10 apart) on a 0.01 ms layer whose choices the drift watch still watched then: quartiles
that far apart are what rounds that timed auto's 10x slower candidates give. The cost of tuning and settling is
what ``benchmarks/first_step.py`` reports.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from convgrad.backends import auto, get_backend, native
from convgrad.cli.bench.layers import Layer
from convgrad.tensor_ops import CHANNELS_LAST

__all__ = ["FORWARD", "MATMUL", "TASKS", "LayerTiming", "Sample", "clock", "iqr", "machine", "serves", "time_layer"]

TASKS = ("grad_input", "grad_weight", "both")
FORWARD = ("forward", "")  # the key of native's forward convolution among the timed calls
MATMUL = ("matmul", "")  # the key of the reference matmul


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
        return iqr(self.seconds)


def iqr(values: list[float]) -> float:
    """Interquartile range (0 with fewer than 2 values)."""
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[2] - q[0]


@dataclass
class LayerTiming:
    """Everything measured for one layer in one dtype.

    Every ratio between two backends is a speed-up: the reference's time over the backend's (native's by default;
    above 1: faster than native), the median over rounds of the speed-up within each round.
    """

    layer: Layer
    dtype: str
    matmul_size: int
    matmul: Sample
    samples: dict[tuple[str, str], Sample]  # (backend, task) -> samples
    forward: Sample = field(default_factory=Sample)  # native's forward convolution
    auto_choice: dict[str, str] = field(default_factory=dict)  # gradient -> backend chosen by auto
    first_seconds: float = 0.0  # wall time before the rounds: first calls, auto's tuning and settling, calibration
    tune_seconds: float = 0.0  # of which auto's first calls and settling
    seconds: float = 0.0  # wall time of the whole layer so far
    retimed: int = 0  # rounds timed again because a choice of auto changed during them

    @property
    def tasks(self) -> tuple[str, ...]:
        """The tasks timed, in TASKS' order."""
        return tuple(t for t in TASKS if ("native", t) in self.samples)

    def median(self, backend: str, task: str) -> float:
        return self.samples[(backend, task)].median

    def speedup(self, backend: str, task: str, reference: str = "native") -> float:
        """The reference's time over the backend's (above 1: the backend is faster), the median over rounds of the
        speed-up within each round. Both were timed moments apart in every round, so load that comes and goes over a
        run cancels out of each speed-up instead of landing on whichever backend it happened to hit."""
        return statistics.median(self._speedups(backend, task, reference))

    def speedup_iqr(self, backend: str, task: str, reference: str = "native") -> float:
        """The interquartile range of the per-round speed-ups that ``speedup`` takes the median of."""
        return iqr(self._speedups(backend, task, reference))

    def in_forwards(self, backend: str, task: str = "both") -> float:
        """Time as a multiple of native's forward (2 for both gradients at the forward's efficiency): the median over
        rounds of the multiple within each round."""
        return statistics.median(self._over_forward(backend, task))

    def in_forwards_iqr(self, backend: str, task: str = "both") -> float:
        """The interquartile range of the per-round multiples that ``in_forwards`` takes the median of."""
        return iqr(self._over_forward(backend, task))

    def _speedups(self, backend: str, task: str, reference: str) -> list[float]:
        ours, ref = self.samples[(backend, task)].seconds, self.samples[(reference, task)].seconds
        return [b / a for a, b in zip(ours, ref, strict=True)]

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


def serves(layer: Layer, dtype: str, backend: str, device: torch.device, channels_last: bool = False) -> bool:
    """Whether ``backend`` takes part on this layer as auto races it (its ``can_serve``: where it can differ from
    native, or where its cost model says it can win). A run times the backends it was not given by name only there:
    elsewhere they rearrange native's kernels or lose by their own model (fft took 10 s a call on HiFi-GAN's
    upsampling, 100x native's)."""
    spec = layer.spec()
    like = torch.empty(spec.output_shape, dtype=getattr(torch, dtype), device=device)  # no pages touched
    if channels_last and like.dim() in (4, 5):
        like = like.contiguous(memory_format=CHANNELS_LAST[like.dim()])
    return bool(get_backend(backend, "convgrad bench").can_serve(spec, like))


def machine(device: torch.device) -> dict[str, Any]:
    """What a timing depends on: the device and its model, the CPU model, the cores this process may use, torch's
    intra-op threads and torch's version (recorded with every result, printed before the tables)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"device": str(device), "device_model": auto.device_name(device),
            "cpu_model": auto.device_name(torch.device("cpu")), "cores": cores, "threads": torch.get_num_threads(),
            "torch": torch.__version__}


def clock(device: torch.device) -> Callable[[], float]:
    """A wall clock that first waits for the device's queued work (CUDA runs asynchronously)."""
    if device.type != "cuda":
        return time.perf_counter

    def synced() -> float:
        torch.cuda.synchronize(device)
        return time.perf_counter()

    return synced


def _sample(fn: Callable[[], Any], number: int, timer: Callable[[], float]) -> float:
    """Seconds per call over ``number`` calls; one untimed call first when there are several (caches, allocator)."""
    if number > 1:
        fn()
    start = timer()
    for _ in range(number):
        fn()
    return max(timer() - start, 1e-9) / number


def _number(seconds: float, min_time: float) -> int:
    """Calls per sample so that one sample lasts about min_time, from one call's seconds."""
    return max(1, math.ceil(min_time / max(seconds, 1e-9)))


def _round_order(backends: list[str], r: int, tasks: Sequence[str] = TASKS) -> list[tuple[str, str]]:
    """Round r's order: task by task (rotated), each task's backends (rotated) back to back, native's forward right
    before "both", then the matmul."""
    b, t = r % len(backends), r % len(tasks)
    order: list[tuple[str, str]] = []
    for task in [*tasks[t:], *tasks[:t]]:
        order += [FORWARD] if task == "both" else []
        order += [(name, task) for name in backends[b:] + backends[:b]]
    return [*order, MATMUL]


_SETTLE_CALLS = 200  # auto compares at most 7 rounds of two calls per surviving candidate


def _settle(choice: Callable[[], Any], call: Callable[[], Any]) -> None:
    """Call auto until its choice has no comparison pending (at most _SETTLE_CALLS calls)."""
    for _ in range(_SETTLE_CALLS):
        current = choice()
        if current is None or not current.pending:
            return
        call()


def _settle_auto(t: dict[str, Any], fns: dict[tuple[str, str], Callable[[], Any]], tasks: Sequence[str],
                 result: LayerTiming) -> None:
    """Run auto's calls until each of its choices has settled, and record what it chose."""
    for gradient in tasks:
        _settle(lambda g=gradient: auto.chosen(t["spec"], g, t["grad_output"]), fns["auto", gradient])
        choice = auto.chosen(t["spec"], gradient, t["grad_output"])
        result.auto_choice[gradient] = choice.backend if choice else auto.FIXED_CHOICE


def time_layer(layer: Layer, dtype: str, backends: list[str], device: torch.device, threads: int, repeats: int,
               min_time: float, channels_last: bool = False, tasks: Sequence[str] = TASKS) -> Iterator[LayerTiming]:
    """Time one layer in rounds; yields the (growing) result after every round, for progress bars.

    Runs at ``threads`` torch threads (auto keys its choices by the thread count), restored afterwards.
    """
    started = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield from _rounds(layer, dtype, backends, device, repeats, min_time, channels_last, tasks, started)
    finally:
        torch.set_num_threads(previous)


def _rounds(layer: Layer, dtype: str, backends: list[str], device: torch.device, repeats: int, min_time: float,
            channels_last: bool, tasks: Sequence[str], started: float) -> Iterator[LayerTiming]:
    torch_dtype, timer = getattr(torch, dtype), clock(device)
    t = _tensors(layer, torch_dtype, device, channels_last)
    names = ["native", *(b for b in backends if b != "native")]
    with torch.no_grad():
        fns = {(b, task): fn for b in names for task, fn in _calls(b, t).items() if task in tasks}
        m = max(1, round((layer.spec().macs()) ** (1 / 3)))
        a, c = torch.randn(m, m, dtype=torch_dtype, device=device), torch.randn(m, m, dtype=torch_dtype, device=device)
        fns[MATMUL] = lambda: torch.matmul(a, c)
        fns[FORWARD] = lambda: native.forward(t["spec"], t["input"], t["weight"], None)
        result = LayerTiming(layer, dtype, m, Sample(), {key: Sample() for key in fns if key[1]})
        for key, fn in fns.items():  # first calls: plans, allocations
            if key[0] != "auto":
                fn()
        if "auto" in names:  # its first calls tune its choices
            tuning = time.perf_counter()
            for task in tasks:
                fns["auto", task]()
            _settle_auto(t, fns, tasks, result)
            result.tune_seconds = time.perf_counter() - tuning
        numbers = {key: _number(_sample(fn, 1, timer), min_time) for key, fn in fns.items()}
        result.first_seconds = result.seconds = time.perf_counter() - started
        changes = auto.changes()
        r = redone = 0
        while r < repeats:
            timed = {key: _sample(fns[key], numbers[key], timer) for key in _round_order(names, r, tasks)}
            if "auto" in names and auto.changes() != changes and redone < repeats:
                _settle_auto(t, fns, tasks, result)  # a choice was tuned again inside the round: time it again
                changes, redone = auto.changes(), redone + 1
                result.retimed = redone
                continue
            for key, seconds in timed.items():
                sample = result.matmul if key == MATMUL else result.forward if key == FORWARD else result.samples[key]
                sample.seconds.append(seconds)
            r += 1
            result.seconds = time.perf_counter() - started
            yield result
