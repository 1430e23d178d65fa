"""benchmarks/per_sample_floor.py: the floor of the clipped DP-SGD step, per layer and summed (issue 38).

The script runs on a tiny model and batch; its sum is the sum of its rows, in the results file as printed; every
trainable parameter of a model whose layers reach it in every way (tests/patterns.py: rules, computed weights, a
rerun) is in some row, and no row's floor is above the way PerSampleGrads took there (that way is one of the ways
it may take). The figures themselves are timings: the lead makes the committed file on a quiet machine.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from types import ModuleType

import pytest
import torch

import patterns
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(scope="module")
def floor() -> ModuleType:
    return load_script("per_sample_floor", ROOT / "benchmarks" / "per_sample_floor.py")


def _table(md: str, model: str) -> tuple[list[list[str]], list[str]]:
    """The data rows and the sum row of one model's table in the results file, as cells."""
    section = md.split(f"## {model}\n")[1].split("\n## ")[0]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in section.splitlines()
             if line.startswith("| ") and not line.startswith("| layer ")]
    return cells[:-1], cells[-1]


def test_the_script_runs_and_its_sum_is_the_sum_of_its_rows(floor: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "floor"
    assert floor.main(["--models", "small_cnn", "--batch", "3", "--min-time", "0.001", "--repeats", "1",
                       "--threads", str(torch.get_num_threads()), "--out", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())["results"][0]
    rows = result["rows"]
    assert [r["what"] for r in rows] == ["linear", "conv2d", "conv2d", "conv2d"]  # the backward's order
    assert result["sum_s"] == pytest.approx(math.fsum(r["floor_s"] for r in rows), rel=1e-12)  # nothing else
    for r in rows:
        allowed = [t for k, t in r["times"].items() if r["store"] or not k.endswith(("+store", "stored"))]
        assert r["floor_s"] == min(allowed) * r["calls"] > 0
    assert {"plain -", "convgrad c"} <= set(result["steps"]) and all("time_s" in s for s in result["steps"].values())
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# The floor of the clipped DP-SGD step\n\nMade by: `PYTHONPATH=src OMP_WAIT_POLICY=PASSIVE "
                         "python benchmarks/per_sample_floor.py --models small_cnn --batch 3")
    printed, total = _table(md, "small_cnn")
    floors = [float(r[6].split()[-1]) for r in printed]  # "conv+store 1.04": ms, two decimals
    assert len(printed) == len(rows) and total[0] == "**sum**"
    assert float(total[6].strip("*")) == pytest.approx(sum(floors), abs=0.005 * (len(floors) + 1))
    assert re.search(r"the clipped step's floor: plain - those \+ the sum of the floors = [\d.]+ ms, [\d.]+x plain",
                     md)


def test_every_parameter_is_in_a_row_and_no_floor_is_above_persamplegrads_way(floor: ModuleType) -> None:
    torch.manual_seed(0)
    model = patterns.network()
    x, y = torch.randn(4, 3, 12, 12), torch.tensor([0, 1, 2, 0])
    captured = floor.capture(model, x, y)
    reached = set().union(*(c.params for c in captured if c.layer is not None))
    reached |= {id(p) for c in captured if c.layer is None for p in c.rerun[1].values()}
    assert reached == {id(p) for p in model.parameters() if p.requires_grad}
    rows = floor.rows(captured, threads=1, min_time=0.001)
    kinds = {(r.what, r.choice.split("+")[-1] if "+" in r.choice else r.choice) for r in rows}
    assert {("conv2d", "pull-back"), ("linear", "pull-back"), ("rerun", "rerun"), ("group_norm", "stored")} <= kinds
    assert sum(r.calls for r in rows) == len(captured)
    for r in rows:
        assert r.chosen is not None, r  # PerSampleGrads' way is one of the ways timed
        assert 0 < r.floor <= r.chosen, r


def test_a_row_stores_only_where_the_memory_rule_allows_it(floor: ModuleType) -> None:
    """Storing per-sample gradients is a way only where PerSampleGrads may take it (``Layer.may_store``)."""
    times = {"ghost": 0.003, "unfold+store": 0.001, "unfold": 0.002}
    kept = floor.Row("conv2d", "m", "s", 2, False, times, "unfold", 0.0, {})
    assert (kept.floor_way, kept.floor, kept.chosen) == ("unfold", 0.004, 0.004)
    stored = floor.Row("conv2d", "m", "s", 2, True, times, "ghost", 0.0, {})
    assert (stored.floor_way, stored.floor, stored.chosen) == ("unfold+store", 0.002, 0.006)
    rule = floor.Row("linear", "m", "s", 1, False, {"stored": 0.001, "materialised": 0.002}, "", 0.0, {})
    assert (rule.floor_way, rule.chosen) == ("materialised", None)
