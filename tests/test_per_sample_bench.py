"""benchmarks/per_sample.py's memory measurement: the peak of live bytes from the profiler's memory events."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("per_sample_bench", ROOT / "benchmarks" / "per_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _trace(tmp_path: Path, memory: list[tuple[int, int]], spans: dict[str, tuple[int, int]]) -> Path:
    events = [{"name": "[memory]", "ph": "i", "ts": ts, "args": {"Bytes": b, "Addr": i}}
              for i, (ts, b) in enumerate(memory)]
    events += [{"name": k, "ph": "X", "ts": lo, "dur": hi - lo} for k, (lo, hi) in spans.items()]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events[::-1]}))  # out of order: the reader sorts by time
    return path


def test_peak_allocated_counts_frees_and_what_step1_leaves_alive(bench: ModuleType, tmp_path: Path) -> None:
    # step 1: +100, +50, -50 (peak 150), leaves 100 alive; step 2: +30, -30, +20 (peak 100 + 30 = 130)
    memory = [(1, 100), (2, 50), (3, -50), (11, 30), (12, -30), (13, 20)]
    peaks = bench.peak_allocated(_trace(tmp_path, memory, {"step1": (0, 5), "step2": (10, 15)}))
    assert peaks == {"step1": 150, "step2": 130}


def test_the_memory_worker_reports_a_plain_step(bench: ModuleType) -> None:
    """A plain backward of the small CNN allocates the same in both steps, and more than its activations' 4 MiB."""
    out = bench.memory_worker("small_cnn", "plain", "c", "allocated")
    assert out["alloc_mib"] == pytest.approx(out["alloc_first_mib"])
    assert 4 < out["alloc_mib"] < 64
