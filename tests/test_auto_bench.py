"""benchmarks/large_kernels.py's measurement of auto: interleaved timing and a choice reported only when settled.

Regression: on hifigan.up16s8 the quiet table gave auto's forward 0.37x native although auto's forward ran native's
own aten.convolution (no candidate there): each contender was timed to the end before the next, auto last, after
fft's multi-second, multi-GB calls, so what they left behind fell on auto alone."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from convgrad.tuning import Choice

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("large_kernels_bench", ROOT / "benchmarks" / "large_kernels.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_a_contender_that_slows_the_machine_weighs_on_native_and_auto_alike(bench: ModuleType) -> None:
    """native and auto run the same call; the heavy contender between them makes every later call 3x slower. A fake
    measure (it returns the call's fake seconds) stands for the timer."""
    machine = {"factor": 1.0}

    def same() -> float:
        return machine["factor"]

    def heavy() -> float:
        machine["factor"] = 3.0
        return 100.0

    def measure(f: Callable[[], object], seconds: float) -> float:
        return f()  # type: ignore[return-value]

    times = bench.time_interleaved({"native": same, "fft": heavy, "auto": same}, 0.3, measure=measure)
    assert times["auto"] == times["native"] == 3.0
    assert times["fft"] == 100.0


def test_every_call_is_timed_once_per_round_in_turn(bench: ModuleType) -> None:
    order: list[str] = []
    calls = {k: (lambda k=k: order.append(k)) for k in ("native", "fft", "auto")}
    bench.time_interleaved(calls, 0.3, rounds=2, measure=lambda f, s: f() or 1.0)
    assert order == ["native", "fft", "auto"] * 3  # one warm-up call each, then two rounds


def test_a_race_still_pending_is_reported_unsettled(bench: ModuleType) -> None:
    """Before, a choice still racing after the settling calls was reported as if chosen (its timing then ran the
    race's slower options)."""
    racing = Choice("fwdconv", {"native": 1.0, "fwdconv": 0.9, "gemm": 2.0}, (), 4, (), ("native", "fwdconv", "gemm"))
    calls: list[int] = []
    assert bench.settle(lambda: calls.append(1), lambda: racing, most=5) == "fwdconv/fwdconv (unsettled)"
    assert len(calls) == 5
    settled = Choice("split", {"native": 1.0, "split": 0.5}, (), 4, ("native", "fft"))
    assert bench.settle(lambda: calls.append(1), lambda: settled, most=5) == "native/fft"
    assert len(calls) == 6
    assert bench.pick(None) == "native/native"


def test_a_row_without_fft_conv_pytorch_says_n_a_not_nan(bench: ModuleType) -> None:
    """Before: HiFi-GAN's transposed conv, which fft-conv-pytorch cannot compute, printed `nan` in both of its
    columns. The row's speed-ups are the reference's time over the contender's."""
    times = {"native_fwd": 0.1, "native_bwd": 0.4, "fft_fwd": 0.2, "fft_bwd": 0.1, "auto_fwd": 0.1, "auto_bwd": 0.2}
    row = {"layer": "hifigan.up16s8", "times": times, "auto": "native; fwdconv/fwdconv",
           "peaks": {"native": 2**20, "fft": 2**21, "auto": 2**20}}
    cells = [c.strip() for c in bench._row(row).split("|")[1:-1]]
    assert cells == ["hifigan.up16s8", "100.0", "400.0", "0.50", "4.00", "1.00", "2.00", "native; fwdconv/fwdconv",
                     "1.67", "n/a", "n/a", "1.0", "2.0", "1.0"]
    with_contender = bench._row(row | {"times": times | {"fftconv_step": 0.6}})
    assert "| 2.00 | 2.00 |" in with_contender  # fft-conv-pytorch's step 0.6 s, fft's and auto's 0.3 s
    assert all("speed-up" in h for h in bench.HEADER.split("\n")[0].split("|") if " vs " in h)
