"""How long a `convgrad bench` run will take, said before it starts.

The estimate prices the bench's own loop (``convgrad.cli.bench.timing``) call by call. Per (layer, dtype):

* the first call of every timed call (each backend and task, native's forward, the matmul), then one more to
  calibrate the calls per sample; for ``auto``, instead of the first call, its tuning and settling;
* ``repeats`` rounds, in each of which every call is sampled for ``max(min_time, one call)``, plus one untimed call
  where a sample has several;
* the reports written after it (``WRITE_SECONDS``), and once at the end the last charts and tables.

The seconds of one call come from a reference run: ``costs.json`` beside this module, written by
``benchmarks/bench_costs.py`` from the ``results.json`` of ``convgrad bench`` runs (the file names the machine and
the commands). Each reference time is scaled to this machine by the matmul rate: the reference layer's matmul
GFLOP/s (timed in the same rounds as its calls) over this machine's, from ``matmul_gflops`` (a matmul timed for
about 0.1 s at the run's thread count and dtype). What the reference lacks (another layer, backend or dtype) is
priced from its FLOPs at ``GUESS_EFFICIENCY`` of this machine's matmul rate, auto's tuning at ``GUESS_TUNE_CALLS``
calls of native's backward, a dtype other than float32 at ``GUESS_DTYPE_FACTOR`` times its float32 reference: the
estimate then says it is partly a guess.

Examples:
    >>> from convgrad.cli.bench.layers import SUITES
    >>> layer = SUITES["smoke"][0]
    >>> est = estimate([(layer, "float32", ["native", "auto"])], ("both",), repeats=3, min_time=0.05, gflops=50.0)
    >>> len(est.seconds), est.seconds[0] > 3 * 3 * 0.05   # 3 rounds of 3 calls (native, auto, the forward) at least
    (1, True)
"""

from __future__ import annotations

import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from convgrad.cli.bench.layers import Layer

__all__ = ["COSTS", "GUESS_DTYPE_FACTOR", "GUESS_EFFICIENCY", "GUESS_TUNE_CALLS", "Estimate", "duration",
           "estimate", "matmul_gflops", "reference"]

COSTS = Path(__file__).with_name("costs.json")
GUESS_EFFICIENCY = 0.2  # a backward's FLOP/s over the matmul's, where no reference says (conv kernels reach 0.05-0.6)
GUESS_TUNE_CALLS = 12  # auto's tuning and settling, in calls of native's backward, where no reference says
GUESS_DTYPE_FACTOR = 2.0  # float64 (or a half dtype on the CPU) over float32, where no reference says
WRITE_SECONDS = 0.5  # writing results.json, results.md (and now and then the charts) after a layer
END_SECONDS = 3.0  # the last charts and the printed tables (3 s on a 2-core VM for the smoke suite)


@dataclass(frozen=True)
class Estimate:
    """Seconds per (layer, dtype) of a run, in its order, and how many of them the reference did not price."""

    seconds: tuple[float, ...]
    guessed: int
    source: str

    @property
    def total(self) -> float:
        return sum(self.seconds) + END_SECONDS

    def left(self, done: int, spent: float) -> float:
        """Seconds left after ``done`` items took ``spent``: the rest of the estimate, scaled by how far off the done
        part was (within 0.5x to 3x, so one odd layer does not swing it)."""
        planned = sum(self.seconds[:done])
        scale = min(3.0, max(0.5, spent / planned)) if done and planned > 0 else 1.0
        return sum(self.seconds[done:]) * scale + (END_SECONDS if done < len(self.seconds) else 0.0)


@functools.cache
def reference() -> dict[str, Any]:
    """The reference run's costs (``costs.json``); empty when the file is missing or unreadable."""
    try:
        data: dict[str, Any] = json.loads(COSTS.read_text())
    except (OSError, ValueError):
        return {}
    return data


def matmul_gflops(device: Any, dtype: str = "float32", seconds: float = 0.1) -> float:
    """This machine's dense GFLOP/s: a 512 x 512 matmul timed for about ``seconds`` at torch's thread count."""
    import torch

    torch_dtype = getattr(torch, dtype)
    a = torch.randn(512, 512, device=device).to(torch_dtype)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    torch.matmul(a, a)
    sync()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds or calls < 3:
        torch.matmul(a, a)
        calls += 1
        if calls % 8 == 0:
            sync()
    sync()
    return 2 * 512 ** 3 * calls / (time.perf_counter() - start) / 1e9


def estimate(work: Sequence[tuple[Layer, str, Sequence[str]]], tasks: Sequence[str], repeats: int, min_time: float,
             gflops: float, costs: dict[str, Any] | None = None) -> Estimate:
    """The seconds each (layer, dtype, backends timed on it) of ``work`` will take with these options, on a machine
    whose matmul runs at ``gflops`` (``matmul_gflops``), priced from ``costs`` (default: the reference,
    ``costs.json``)."""
    costs = reference() if costs is None else costs
    table = costs.get("layers", {})
    seconds, guessed = [], 0
    for layer, dtype, backends in work:
        names = ["native", *(b for b in backends if b != "native")]
        entry, factor = table.get(f"{layer.name}|{dtype}"), 1.0
        if entry is None and dtype != "float32" and f"{layer.name}|float32" in table:
            entry, factor = table[f"{layer.name}|float32"], GUESS_DTYPE_FACTOR
        guess = entry is None or factor != 1.0

        def call(key: str, flop: float, entry: Any = entry, factor: float = factor) -> float:
            nonlocal guess
            if entry is not None and key in entry["calls"]:
                return float(entry["calls"][key]) * entry["matmul_gflops"] / gflops * factor
            guess = True
            return flop / 1e9 / (gflops * GUESS_EFFICIENCY) * factor

        flop = 2 * layer.spec().macs()  # of one gradient, or of the forward
        calls = {f"{b}|{t}": call(f"{b}|{t}", flop * (2 if t == "both" else 1)) for b in names for t in tasks}
        calls["forward"] = call("forward", flop)
        calls["matmul"] = call("matmul", flop * GUESS_EFFICIENCY)  # the matmul runs at the matmul rate
        if "auto" in names:
            if entry is not None and "tune_s" in entry:
                tune = float(entry["tune_s"]) * entry["matmul_gflops"] / gflops * factor
            else:
                guess = True
                tune = GUESS_TUNE_CALLS * call("native|both", 2 * flop)
        else:
            tune = 0.0
        first = sum(t * (1 if key.startswith("auto|") else 2) for key, t in calls.items()) + tune
        per_round = sum(_sample_seconds(t, min_time) for t in calls.values())
        seconds.append(first + repeats * per_round + WRITE_SECONDS)
        guessed += guess
    source = (f"from a reference run on {costs['machine']}, scaled by this machine's matmul speed"
              if costs else "a guess from FLOP counts: the reference run's costs.json is missing")
    return Estimate(tuple(seconds), guessed, source)


def _sample_seconds(call: float, min_time: float) -> float:
    """One sample: enough calls to last min_time (timing._number), plus an untimed one when there are several."""
    number = max(1, math.ceil(min_time / max(call, 1e-9)))
    return call * (number + (number > 1))


def duration(seconds: float) -> str:
    """'40 s', '3 min', '1.5 h': the precision an estimate has."""
    if seconds < 90:
        return f"{max(1, round(seconds, -1 if seconds >= 20 else 0)):.0f} s"
    if seconds < 90 * 60:
        return f"{round(seconds / 60):.0f} min"
    return f"{seconds / 3600:.1f} h"
