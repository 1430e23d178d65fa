"""`convgrad bench --model`: does convgrad speed up my model? Its training step, plain against patched.

``MODULE:FACTORY`` builds the model (``convgrad.cli.check.model.build_model``, as `convgrad check --model` does) and
a deep copy of it is patched (``convgrad.patch(copy, backend)``): the same weights, in the same process, on the same
random input. A training step sets the gradients to None, runs the forward, a loss (the mean square of every
floating output that needs a gradient), the backward and, with ``optimizer``, an optimizer step on that model's own
parameters. In order:

1. The first steps: one of the plain model, then the patched model's first, which includes auto's tuning of every
   distinct layer (``convgrad.backends.auto``): the first-step cost, in plain steps.
2. Warm-up: ``warmup`` more patched steps, in which auto compares the candidates that survived its tuning on the
   calls that follow, then one plain step.
3. Rounds: one plain and one patched step back to back, their order swapped every round; a round's speed-up is the
   plain step's time over the patched one's, so load that comes and goes hits both. At least ``steps`` rounds, and
   more until each model has ``min_time`` seconds of timed steps. A round in which a choice of auto changed (a
   comparison settled, or a re-tuning) timed candidates that lost: the rounds so far are dropped and the count
   starts again, ``MAX_DROPPED`` rounds at most (``ModelBench.dropped``). Python's garbage collector is off during
   the rounds, as in ``timeit``.
4. Memory: one more step of each, the peak of the bytes it held in PyTorch's allocator beyond what was live when it
   began (after the gradients were set to None): the torch profiler's memory events on the CPU,
   ``torch.cuda.max_memory_allocated`` on CUDA.
5. What each conv call runs: ``convgrad.report(patched, x)`` after those steps.

Each step is timed alone, with bench's clock (``timing.clock``: on CUDA it waits for the queued work). A training
step lasts milliseconds at least, so one clock reading per step costs nothing, and one step per sample keeps both
models' samples paired; torch.utils.benchmark's ``Timer`` adds untimed calls to every sample (two in ``timeit``, one
in ``blocked_autorange``), which would double the cost of a run whose steps take seconds.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import statistics
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

import convgrad
from convgrad.backends import auto, get_backend
from convgrad.cli.bench.timing import clock, iqr, machine
from convgrad.cli.check.model import build_model, model_fails, output_tensors
from convgrad.errors import ConvgradValueError
from convgrad.nn import ConvCallReport

__all__ = ["MAX_DROPPED", "OPTIMIZERS", "ModelBench", "StepTimes", "bench_model", "peak_bytes", "step_time"]

FN = "convgrad bench"
OPTIMIZERS = ("none", "sgd", "adamw")
MAX_DROPPED = 50  # rounds dropped for a change of auto's choices, at most; then the figures include its comparisons


@dataclass
class StepTimes:
    """One model's training steps.

    Attributes:
        first: seconds of its first step.
        steps: seconds of each timed step, in the order of the rounds.
        peak_bytes: the most bytes one step held at once in PyTorch's allocator beyond what was live as it began.
    """

    first: float
    steps: list[float]
    peak_bytes: int

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def iqr(self) -> float:
        return iqr(self.steps)


@dataclass
class ModelBench:
    """What ``bench_model`` measured; ``to_json()`` writes every figure, ``model_print.show`` prints them.

    Attributes:
        model: the ``MODULE:FACTORY`` it was built from.
        input_shape: the size of its random input.
        dtype, backend, optimizer: the model's dtype, the backend given to ``convgrad.patch``, the optimizer step.
        machine: the device, CPU model, cores, threads and torch version (``timing.machine``).
        plain, patched: each model's steps (``StepTimes``).
        settings: what else the figures depend on: steps, min_time, warmup (patched steps between its first and the
            rounds), and auto's mode, forward mode and cache file.
        dropped: rounds dropped because a choice of auto changed during them.
        settled: False when the run stopped dropping rounds (``MAX_DROPPED``): its figures include auto's
            comparisons.
        calls: ``convgrad.report(patched, x).calls`` after the steps: what each conv call runs, and why.
    """

    model: str
    input_shape: tuple[int, ...]
    dtype: str
    backend: str
    optimizer: str
    machine: dict[str, Any]
    settings: dict[str, Any]
    plain: StepTimes
    patched: StepTimes
    dropped: int
    settled: bool
    calls: list[ConvCallReport]

    @property
    def speedups(self) -> list[float]:
        """Each round's plain step time over its patched step time."""
        return [p / q for p, q in zip(self.plain.steps, self.patched.steps, strict=True)]

    @property
    def speedup(self) -> float:
        """The median over rounds of each round's speed-up (above 1: the patched step is faster)."""
        return statistics.median(self.speedups)

    @property
    def speedup_iqr(self) -> float:
        return iqr(self.speedups)

    @property
    def first_step_cost(self) -> float:
        """The patched model's first step in plain steps (its time over the plain step's median)."""
        return self.patched.first / self.plain.median

    def figures(self) -> dict[str, float]:
        """The figures derived from the steps, as ``to_json`` writes them."""
        return {"speedup": self.speedup, "speedup_iqr": self.speedup_iqr, "first_step_cost": self.first_step_cost,
                "plain_step": self.plain.median, "plain_step_iqr": self.plain.iqr,
                "patched_step": self.patched.median, "patched_step_iqr": self.patched.iqr}

    def to_json(self) -> str:
        """Every measurement and option, the derived figures under "figures" (seconds, bytes)."""
        return json.dumps({**asdict(self), "figures": self.figures()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelBench:
        """The ``ModelBench`` that ``to_json`` wrote (its "figures" are derived again, not read)."""
        data = json.loads(text)
        data.pop("figures", None)
        return cls(**{**data, "input_shape": tuple(data["input_shape"]), "plain": StepTimes(**data["plain"]),
                      "patched": StepTimes(**data["patched"]),
                      "calls": [ConvCallReport(**row) for row in data["calls"]]})


def step_time(seconds: float) -> str:
    """3 significant digits, in ms below a second, else in s.

    Examples:
        >>> step_time(0.0261), step_time(2.256), step_time(164.2)
        ('26.1 ms', '2.26 s', '164 s')
    """
    if seconds < 0.9995:
        return f"{seconds * 1e3:.3g} ms"
    return f"{seconds:.3g} s" if seconds < 99.95 else f"{seconds:.0f} s"


def peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """The most bytes ``fn()`` holds at once in PyTorch's allocator beyond what was live when it began.

    On the CPU, the torch profiler's memory events (``profile_memory=True``: every allocation and free of PyTorch's
    CPU allocator, in order); on CUDA, ``torch.cuda.max_memory_allocated``.

    Examples:
        >>> peak_bytes(lambda: torch.ones(1024) + 1, torch.device("cpu")) // 1024  # two float32 tensors of 4 KiB
        8
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    with tempfile.TemporaryDirectory() as tmp, _kineto_quiet():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


@contextlib.contextmanager
def _kineto_quiet() -> Iterator[None]:
    """The profiler's library (kineto) prints "profiler_start" and "profiler_stop" lines on stderr at every profile,
    unless KINETO_LOG_LEVEL is above its levels when it first starts; a level the user set is left alone."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


@dataclass
class _Trainer:
    """One model's training step, in two parts: ``zero`` (gradients to None) and ``run`` (the rest)."""

    model: torch.nn.Module
    x: torch.Tensor
    optimizer: torch.optim.Optimizer | None

    def zero(self) -> None:
        self.model.zero_grad(set_to_none=True)

    trains: bool = True  # False when the model's output had nothing to differentiate

    def run(self) -> None:
        outputs = [o for o in output_tensors(self.model(self.x)) if o.requires_grad and o.is_floating_point()]
        self.trains = bool(outputs)
        if outputs:
            torch.stack([o.float().square().mean() for o in outputs]).sum().backward()
        if self.optimizer is not None:
            self.optimizer.step()

    def step(self) -> None:
        self.zero()
        self.run()


def _optimizer(name: str, model: torch.nn.Module) -> torch.optim.Optimizer | None:
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "none" or not params:
        return None
    return torch.optim.SGD(params, lr=1e-3) if name == "sgd" else torch.optim.AdamW(params, lr=1e-4)


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Python's garbage collector off (as timeit does), after one collection."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def bench_model(target: str, input_shape: tuple[int, ...], backend: str = "auto", dtype: str = "float32",
                device: torch.device | str = "cpu", steps: int = 10, min_time: float = 2.0, warmup: int = 10,
                optimizer: str = "none", progress: Callable[[str], None] | None = None) -> ModelBench:
    """Time the training step of ``MODULE:FACTORY()``'s model plain against ``convgrad.patch(copy, backend)``.

    Args:
        target: ``"module:factory"`` or ``"path/to/file.py:factory"``; ``factory()`` returns a torch.nn.Module.
        input_shape: the size of its input, e.g. ``(8, 3, 224, 224)``; random normal data (seed 0).
        backend: given to ``convgrad.patch`` (default "auto").
        dtype: the model's and the input's dtype, a name of ``torch`` (default "float32").
        device: where both run (default the CPU).
        steps: timed steps of each model at least, one of each per round (default 10).
        min_time: seconds of timed steps of each model at least (default 2.0).
        warmup: patched steps after its first, before the rounds (default 10).
        optimizer: "none" (default), "sgd" or "adamw": the optimizer step that ends each training step.
        progress: called with a line at each stage (default None).

    Returns:
        A ``ModelBench``: the steps of both, the speed-up, the first-step cost, the peak memory of a step and what
        each conv call runs (``convgrad.report``).

    Raises:
        ValueError: a target that does not load, a factory that raises, a model that fails on ``input_shape`` or
            has no convolution or nothing to differentiate, an unknown backend, dtype or optimizer, steps below 1, a
            negative min_time or warmup.
        TypeError: the factory does not return a torch.nn.Module.

    Source: the module's docstring; the docs' `convgrad bench` page, "Your own model".

    Examples:
        >>> r = bench_model("convgrad.cli.check:example_model", (2, 3, 16, 16), "fwdconv", steps=2, min_time=0,
        ...                 warmup=0)
        >>> len(r.speedups), r.speedup > 0, [(c.module, c.gradients) for c in r.calls][:2]
        (2, True, [('0', 'fwdconv'), ('3', 'fwdconv')])
    """
    say = progress or (lambda line: None)
    for name, value, low in (("--steps", steps, 1), ("--min-time", min_time, 0), ("warmup", warmup, 0)):
        if value < low:  # named as the command line names them; warmup is not an option there
            raise ConvgradValueError(f"{FN}: {name}={value} must be at least {low}")
    if optimizer not in OPTIMIZERS:
        raise ConvgradValueError(f"{FN}: --optimizer={optimizer!r} must be one of {', '.join(OPTIMIZERS)}")
    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype) or not torch_dtype.is_floating_point:
        raise ConvgradValueError(f"{FN}: --dtype={dtype!r} must name a floating dtype of torch (float32, ...)")
    backend = get_backend(backend, FN).name
    device = torch.device(device)
    model = build_model(target, FN).to(device=device, dtype=torch_dtype)
    x = torch.randn(input_shape, generator=torch.Generator().manual_seed(0)).to(device=device, dtype=torch_dtype)
    with model_fails(FN, target, input_shape):  # the wrong input size, in one forward before anything is timed
        if not convgrad.report(model, x).calls:
            raise ConvgradValueError(f"{FN}: --model={target!r} has no convolution: convgrad leaves its step as it is")
    try:
        patched = convgrad.patch(copy.deepcopy(model), backend=backend)
    except (TypeError, RuntimeError, copy.Error) as err:
        raise ConvgradValueError(f"{FN}: --model={target!r} cannot be copied (copy.deepcopy: {err})") from None
    plain_step, patched_step = (_Trainer(m, x, _optimizer(optimizer, m)) for m in (model.train(), patched.train()))
    timer = clock(device)

    def timed(trainer: _Trainer) -> float:
        start = timer()
        trainer.step()
        return timer() - start

    with model_fails(FN, target, input_shape):  # a training-mode failure (a BatchNorm over one value, ...)
        plain_first = timed(plain_step)
    if not plain_step.trains:
        raise ConvgradValueError(f"{FN}: --model={target!r}: its output has no floating tensor that needs a gradient: "
                                 "there is no backward to time")
    say(f"first steps: plain {step_time(plain_first)}, then the patched model's, which tunes auto ...")
    patched_first = timed(patched_step)
    say(f"patched {step_time(patched_first)}; {warmup} patched steps for auto to compare its survivors, then at least "
        f"{steps} rounds of one step of each{f' and {min_time:g} s of steps of each' if min_time else ''} ...")
    for _ in range(warmup):
        patched_step.step()
    plain_step.step()
    plain, ours, dropped, settled = _rounds(plain_step, patched_step, timed, steps, min_time)
    say(f"timed {len(plain)} rounds{f' ({dropped} dropped: auto changed a choice)' if dropped else ''}; "
        "the peak memory of a step of each ...")
    peaks = []
    for trainer in (plain_step, patched_step):
        trainer.zero()
        peaks.append(peak_bytes(trainer.run, device))
    settings = {"steps": steps, "min_time": min_time, "warmup": warmup, "auto_mode": auto.get_mode(),
                "auto_forward": auto.get_forward_mode(), "auto_cache": str(auto.cache_path() or "off")}
    return ModelBench(target, tuple(input_shape), dtype, backend, optimizer, machine(device), settings,
                      StepTimes(plain_first, plain, peaks[0]), StepTimes(patched_first, ours, peaks[1]), dropped,
                      settled, convgrad.report(patched, x).calls)


def _rounds(plain: _Trainer, patched: _Trainer, timed: Callable[[_Trainer], float], steps: int,
            min_time: float) -> tuple[list[float], list[float], int, bool]:
    """(plain's step times, patched's, rounds dropped, settled): rounds of one step of each, the order swapped each
    round, until ``steps`` rounds and ``min_time`` seconds of each since the last change of auto's choices; past
    ``MAX_DROPPED`` dropped rounds, a round with a change is kept and settled is False."""
    times: dict[str, list[float]] = {"plain": [], "patched": []}
    trainers = {"plain": plain, "patched": patched}
    dropped, r, settled = 0, 0, True
    with _no_gc():
        while len(times["plain"]) < steps or min(sum(t) for t in times.values()) < min_time:
            changes = auto.changes()
            order = ("plain", "patched") if r % 2 == 0 else ("patched", "plain")
            got = {name: timed(trainers[name]) for name in order}
            r += 1
            if auto.changes() != changes:  # a comparison settled (its losers ran) or a choice was tuned again
                if dropped + len(times["plain"]) + 1 <= MAX_DROPPED:
                    dropped += len(times["plain"]) + 1
                    times = {"plain": [], "patched": []}
                    continue
                settled = False
            for name, seconds in got.items():
                times[name].append(seconds)
    return times["plain"], times["patched"], dropped, settled

