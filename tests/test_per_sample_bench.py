"""benchmarks/per_sample.py: the memory measurement (the peak of live bytes from the profiler's memory events), a
run on a tiny batch, the contenders that fail on in-place ops (run again with them off, the failure kept), BackPACK's
missing per-sample results, and the targets' peers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus's and BackPACK's hooks, as the script does


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


def _run(bench: ModuleType, monkeypatch: pytest.MonkeyPatch, model: nn.Module, jobs: list[tuple[str, str]],
         batch: int = 3) -> dict[tuple[str, str], dict]:
    """time_model's records of one round on ``model`` (8x8 images, 10 classes), by (contender, quantity)."""
    monkeypatch.setattr(bench, "BATCH", batch)
    monkeypatch.setitem(bench.MODELS, "tiny", lambda: model)
    monkeypatch.setitem(bench.INPUT_SHAPES, "tiny", (3, 8, 8))
    return {(r["contender"], r["quantity"]): r for r in bench.time_model("tiny", jobs, 1)}


def _tiny(inplace: bool = False, affine: bool = False) -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(inplace=inplace), nn.GroupNorm(2, 4, affine=affine),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 10))


def test_the_script_runs_on_a_tiny_batch(bench: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bench, "BATCH", bench.BATCH)  # main sets it for the run
    out = tmp_path / "per_sample"
    assert bench.main(["--models", "small_cnn", "--batch", "2", "--repeats", "1", "--no-memory", "--malloc", "system",
                       "--threads", str(torch.get_num_threads()), "--contenders", "plain", "convgrad", "torch.func",
                       "--quantities", "a", "c", "--out", str(out)]) == 0
    records = json.loads(out.with_suffix(".json").read_text())
    assert [(r["contender"], r["quantity"]) for r in records] == [
        ("plain", "-"), ("convgrad", "a"), ("convgrad", "c"), ("torch.func", "a"), ("torch.func", "c")]
    assert all(len(r["times_s"]) == 1 and r["time_s"] > 0 for r in records)
    md = out.with_suffix(".md").read_text()
    assert md.count("| small_cnn |") == 5 and "- small_cnn (c): " in md


def test_a_contender_that_fails_on_in_place_ops_runs_again_with_them_off(bench: ModuleType,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Opacus's hooks refuse a module whose output a ReLU(inplace=True) changes: the failure stays, and the run with
    the flags off follows it; the model given is not changed."""
    pytest.importorskip("opacus")
    model = _tiny(inplace=True)
    got = _run(bench, monkeypatch, model, [("plain", "-"), ("opacus", "c")])
    assert list(got) == [("plain", "-"), ("opacus", "c"), ("opacus, in-place off", "c")]
    assert "inplace" in got[("opacus", "c")]["error"]
    assert got[("opacus, in-place off", "c")]["time_s"] > 0
    assert model[1].inplace
    clean = _run(bench, monkeypatch, _tiny(), [("plain", "-"), ("opacus", "c")])  # nothing in place: no second run
    assert list(clean) == [("plain", "-"), ("opacus", "c")] and "error" not in clean[("opacus", "c")]


def test_a_failing_opacus_ghost_convgrad_step_leaves_opacus_as_it_was(bench: ModuleType,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Its step registers convgrad's rules in Opacus around the forward and backward; one that raised (in-place ops)
    left them registered, so every contender timed after it ran Opacus with convgrad's conv rules."""
    pytest.importorskip("opacus")
    from opacus.grad_sample import GradSampleHooks

    before = GradSampleHooks.GRAD_SAMPLERS[nn.Conv2d]
    monkeypatch.setattr(bench, "BATCH", 3)
    step = bench.SETUPS["opacus-ghost+convgrad"](_tiny(inplace=True), "c")
    with pytest.raises(RuntimeError, match="modified inplace"):
        step(torch.randn(3, 3, 8, 8), torch.tensor([0, 1, 2]))
    assert GradSampleHooks.GRAD_SAMPLERS[nn.Conv2d] is before


def test_backpack_leaving_a_parameter_without_its_per_sample_result_is_an_error(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """BackPACK extends the module types it knows: GroupNorm's weight and bias got no grad_batch, and its (a) step
    was timed as if it had computed every per-sample gradient."""
    pytest.importorskip("backpack")
    got = _run(bench, monkeypatch, _tiny(affine=True), [("plain", "-"), ("backpack", "a"), ("backpack", "b")])
    assert got[("backpack", "a")]["error"] == ("RuntimeError: BackPACK gives no per-sample grad_batch to the "
                                               "parameters of GroupNorm")
    assert got[("backpack", "b")]["error"].endswith("no per-sample batch_l2 to the parameters of GroupNorm")
    assert "time_s" in _run(bench, monkeypatch, _tiny(), [("plain", "-"), ("backpack", "a")])[("backpack", "a")]


def test_the_targets_compare_with_peers_that_ran_the_unmodified_model(bench: ModuleType) -> None:
    def rec(contender: str, quantity: str, time_s: float) -> dict:
        return {"model": "m", "contender": contender, "quantity": quantity, "time_s": time_s, "ratio": 1.0,
                "first_s": time_s}

    results = [rec("plain", "-", 1.0), rec("convgrad", "c", 2.0), rec("torch.func", "c", 3.0),
               rec("opacus-ghost, in-place off", "c", 1.5), rec("opacus-ghost+convgrad", "c", 1.0),
               {"model": "m", "contender": "opacus-ghost", "quantity": "c", "error": "RuntimeError: inplace"}]
    lines = [t for t in bench.targets(results) if "peer" in t]
    assert lines == ["m (c): 1.50x faster than the fastest peer on the unmodified model, torch.func (target >= 1.0x)"]


@pytest.mark.slow  # builds timm's models
@pytest.mark.parametrize("name", ["efficientnet_b0", "convnext_atto", "mobilenetv3_small_100", "regnetx_002",
                                  "nf_resnet26"])
def test_each_timm_model_runs_with_every_contender(bench: ModuleType, monkeypatch: pytest.MonkeyPatch,
                                                    name: str) -> None:
    """A step of each contender on batch 2 (a check that it runs, not a timing): convgrad and torch.func run the
    model as it is; Opacus's and BackPACK's failures are rows with their reason, and Opacus runs with in-place off
    where the model has in-place modules."""
    if not bench.timm_available():
        pytest.skip("timm is not installed (benchmarks/requirements.txt)")
    monkeypatch.setattr(bench, "BATCH", 2)
    jobs = [("plain", "-")] + [(c, "c") for c in bench.CONTENDERS if c != "plain" and bench.available(c)]
    got = {(r["contender"], r["quantity"]): r for r in bench.time_model(name, jobs, 1)}
    for job in (("plain", "-"), ("convgrad", "c"), ("torch.func", "c")):
        assert "time_s" in got[job], got[job]
    for c in ("opacus", "opacus-ghost"):
        if (c, "c") in got and "error" in got[(c, "c")]:
            assert "inplace" in got[(c, "c")]["error"]
            assert "time_s" in got[(c + bench.INPLACE_OFF, "c")], got[(c + bench.INPLACE_OFF, "c")]
