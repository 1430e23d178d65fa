"""`convgrad bench` respects the user's time and says what its figures mean.

Up front it says what it will time and about how long (``estimate``); it writes its reports after every layer (a
stopped run leaves what it measured) and, not on a terminal, a line per layer; one convention for every ratio
(the speed-up); ``(!)`` only where a measurement is suspect; every chart panel labelled. The layers are not
timed here: ``time_layer`` is replaced by one that yields made-up results, so these tests run in the fast tier.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from convgrad import cli
from convgrad.cli import bench
from convgrad.cli.bench import estimate, layers, report, timing

ROOT = Path(__file__).resolve().parents[1]


def _timing(times: dict[str, list[float]], layer: layers.Layer | int = 0, tasks: tuple[str, ...] = timing.TASKS,
            retimed: int = 0) -> timing.LayerTiming:
    """A LayerTiming whose every task of backend b took times[b] (s) in the rounds."""
    lay = layer if isinstance(layer, layers.Layer) else layers.SUITES["smoke"][layer]
    rounds = len(next(iter(times.values())))
    samples = {(b, t): timing.Sample(list(s)) for b, s in times.items() for t in tasks}
    return timing.LayerTiming(lay, "float32", 8, timing.Sample([1e-3] * rounds), samples,
                              forward=timing.Sample([0.5] * rounds), auto_choice={t: "native" for t in tasks},
                              seconds=1.0, retimed=retimed)


def _fake_time_layer(stop_at: int | None = None) -> Any:
    """A time_layer that times nothing: each layer's result after each round; KeyboardInterrupt at layer stop_at."""
    seen: list[str] = []

    def fake(layer: layers.Layer, dtype: str, backends: list[str], device: Any, threads: int, repeats: int,
             min_time: float, channels_last: bool = False, tasks: tuple[str, ...] = timing.TASKS
             ) -> Iterator[timing.LayerTiming]:
        seen.append(layer.name)
        if len(seen) == stop_at:
            raise KeyboardInterrupt
        speed = {"native": [1.0] * repeats, **{b: [0.5] * repeats for b in backends if b != "native"}}
        for _ in range(repeats):
            yield _timing(speed, layer, tasks)

    return fake, seen


# ---- before it starts, and while it runs ------------------------------------------------------------------------

FFT_TAKES_PART = {"replknet.dw31", "slak.dw51x5", "unireplknet.dw13", "wav2vec2.posconv", "hyena.long1d",
                  "sincnet.k251", "3duxnet.dw7x7x7"}  # of the large suite: where fft's cost model lets it race


def test_a_run_says_up_front_what_it_times_and_how_long_then_a_line_per_layer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: with stdout not a terminal, `--suite large` printed nothing for 60 minutes (the progress bar is for
    terminals only) and wrote nothing until its end; it timed the registry's backends on every layer, fft not among
    them. Now fft is timed where its cost model lets it race (it took 10 s a call on HiFi-GAN, 100x native)."""
    fake, seen = _fake_time_layer()
    monkeypatch.setattr(timing, "time_layer", fake)
    assert cli.main(["bench", "--suite", "large", "--repeats", "2", "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    large = layers.SUITES["large"]
    assert re.fullmatch(rf"convgrad bench --suite large: {len(large)} layers x 4 backends \(native, fwdconv, fft, "
                        rf"auto; fft on the {len(FFT_TAKES_PART)} where it takes part\), grad_input, grad_weight and "
                        r"both, float32, 2 rounds of samples of at least 0.05 s: about \d+(\.\d)? (s|min|h) \(.*\); "
                        r"results are written to .* after every layer", lines[0]), lines[0]
    for i, layer in enumerate(large, 1):
        fft = "fft 2.00x, " if layer.name in FFT_TAKES_PART else ""
        assert lines[i].startswith(f"[{i}/{len(large)}] {layer.name} float32 in 1 s: speed-up vs native on both "
                                   f"gradients: fwdconv 2.00x, {fft}auto 2.00x (chose native); "), lines[i]
        assert lines[i].endswith("done" if i == len(large) else " left"), lines[i]
    assert seen == [layer.name for layer in large]


def test_a_backend_named_by_backends_is_timed_on_every_layer(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    fake, _ = _fake_time_layer()
    monkeypatch.setattr(timing, "time_layer", fake)
    assert cli.main(["bench", "--suite", "large", "--layers", "hifigan.*", "--backends", "fft", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    assert "hifigan.up16s8 float32 in 1 s: speed-up vs native on both gradients: fft 2.00x" in capsys.readouterr().out


def test_a_stopped_run_leaves_the_results_of_the_layers_it_finished(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: results.json, results.md and the charts were written once, after the last layer; a run stopped after
    an hour left nothing."""
    fake, _ = _fake_time_layer(stop_at=4)
    monkeypatch.setattr(timing, "time_layer", fake)
    assert cli.main(["bench", "--suite", "large", "--repeats", "2", "--out", str(tmp_path), "--quiet"]) == 130
    err = capsys.readouterr().err
    assert err == (f"convgrad bench: interrupted after 3 of {len(layers.SUITES['large'])} layers; what they measured "
                   f"is in {tmp_path / 'results.json'} and {tmp_path / 'results.md'}\n")
    data = json.loads((tmp_path / "results.json").read_text())
    done = [layer.name for layer in layers.SUITES["large"][:3]]
    assert [row["layer"] for row in data["layers"]] == done
    assert data["meta"]["layers_done"] == f"3 of {len(layers.SUITES['large'])}"
    md = (tmp_path / "results.md").read_text()
    assert all(f"| {name} |" in md for name in done) and layers.SUITES["large"][3].name not in md
    assert (tmp_path / "speedups_float32.png").stat().st_size > 0  # the first layer's chart, at least
    assert not list(tmp_path.glob("*.part*"))  # every file replaced whole


def test_quick_mode_times_auto_against_native_on_both_gradients_in_three_short_rounds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    fake, _ = _fake_time_layer()

    def spy(*args: Any) -> Iterator[timing.LayerTiming]:
        calls.append(args)
        return fake(*args)

    monkeypatch.setattr(timing, "time_layer", spy)
    assert cli.main(["bench", "--suite", "large", "--layers", "replknet.dw31", "--quick", "--out", str(tmp_path)]) == 0
    (layer, _, backends, _, _, repeats, min_time, _, tasks), = calls
    assert (layer.name, backends, repeats, min_time, tasks) == ("replknet.dw31", ["native", "auto"], 3, 0.02,
                                                                ("both",))
    out = capsys.readouterr().out
    assert out.startswith("convgrad bench --suite large: 1 layer x 2 backends (native, auto), both gradients in one "
                          "call, float32, 3 rounds")
    md = (tmp_path / "results.md").read_text()
    assert "| replknet.dw31 | float32 | auto |  |  |" in md  # grad_input and grad_weight not timed: empty cells


def test_quick_mode_prices_the_large_kernels_of_the_issue_under_a_minute_on_the_reference_machine() -> None:
    """What --quick promises, on the reference run's figures (costs.json): the answer for RepLKNet's 31x31 and Hyena's
    1024-tap conv, each in under a minute (3D UX-Net's, whose native backward takes seconds a call, takes longer: the
    estimate says so before the run)."""
    costs = estimate.reference()
    if not costs:
        pytest.skip("no reference costs (src/convgrad/cli/bench/costs.json)")
    for layer in layers.select("large", ["replknet.dw31", "hyena.long1d"]):
        gflops = costs["layers"][f"{layer.name}|float32"]["matmul_gflops"]  # the reference machine itself
        plan = estimate.estimate([(layer, "float32", ["native", "auto"])], ("both",), bench.QUICK["repeats"],
                                 bench.QUICK["min_time"], gflops)
        assert plan.guessed == 0 and plan.total < 60, (layer.name, plan.total)


# ---- the estimate ---------------------------------------------------------------------------------------------

def test_the_estimate_prices_the_bench_loop_call_by_call() -> None:
    """From a reference, one layer: the first calls and calibration (2 calls each; auto: its tuning and 1), then per
    round max(min_time, a call) per call, plus one untimed call where a sample has several."""
    layer = layers.SUITES["smoke"][0]
    calls = {"native|both": 0.2, "auto|both": 0.01, "forward": 0.1, "matmul": 0.0015}
    costs = {"machine": "ref", "layers": {f"{layer.name}|float32": {"matmul_gflops": 100.0, "calls": calls,
                                                                     "tune_s": 3.0}}}
    plan = estimate.estimate([(layer, "float32", ["auto"])], ("both",), repeats=2, min_time=0.05, gflops=50.0,
                             costs=costs)
    here = {k: v * 2 for k, v in calls.items()}  # this machine's matmul runs at half the reference's rate
    first = 2 * (here["native|both"] + here["forward"] + here["matmul"]) + here["auto|both"] + 3.0 * 2
    per_round = here["native|both"] + here["forward"] + (0.02 * 3 + 0.02) + (0.003 * 17 + 0.003)  # 3, 17 calls
    assert plan.guessed == 0 and plan.seconds[0] == pytest.approx(first + 2 * per_round + estimate.WRITE_SECONDS)
    assert "from a reference run on ref" in plan.source
    guessed = estimate.estimate([(layer, "float32", ["fft"]), (layer, "float64", ["fft"])], ("both",), 2, 0.05, 50.0,
                                costs=costs)
    assert guessed.guessed == 2  # fft not in the reference; float64 from float32's
    assert guessed.seconds[1] > guessed.seconds[0]


def test_the_time_left_follows_how_far_off_the_done_layers_were() -> None:
    plan = estimate.Estimate((10.0, 20.0, 30.0), 0, "test")
    end = estimate.END_SECONDS
    assert plan.total == plan.left(0, 0.0) == 60.0 + end
    assert plan.left(1, 20.0) == pytest.approx(100.0 + end)  # 2x slower so far
    assert plan.left(1, 1000.0) == pytest.approx(150.0 + end) and plan.left(3, 99.0) == 0.0  # at most 3x


def test_duration_has_the_precision_of_an_estimate() -> None:
    assert [estimate.duration(s) for s in (0.2, 7.4, 44, 100, 3000, 9000)] == ["1 s", "7 s", "40 s", "2 min",
                                                                              "50 min", "2.5 h"]


# ---- one convention ------------------------------------------------------------------------------------------

def test_every_ratio_between_backends_is_a_speed_up_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Before: bench printed time ratios (0.04x: faster) under "x native" while large_kernels.md printed speed-ups
    (19.7) under the same words."""
    from matplotlib.figure import Figure

    r = _timing({"native": [1.0, 1.0, 1.0], "fft": [0.05, 0.05, 0.05]})
    assert r.speedup("fft", "both") == pytest.approx(20.0)
    header, body = report.table_rows([r])
    assert "20.00 ± 0.00" in body[1][7] and "(20.00x)" in body[1][4]
    ratio_columns = [h for h in (*header, *report.SUMMARY_HEADER) if "native" in h or "x " in h or "speed" in h]
    assert ratio_columns and all("speed-up" in h for h in ratio_columns), ratio_columns
    assert not any("x native" in h for h in (*header, *report.SUMMARY_HEADER))
    labels: list[str] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: labels.extend(ax.get_ylabel() for ax in self.axes))
    monkeypatch.setattr(report.os, "replace", lambda *a: None)
    report.write_plots([r], tmp_path)
    assert [lab.split("\n")[-1] for lab in labels[:3]] == ["speed-up vs native"] * 3
    page = (ROOT / "docs" / "cli" / "bench.md").read_text()
    run = page.split("<!-- bench-run -->")[1].split("<!-- /bench-run -->")[0]
    assert "speed-up" in run and "x native" not in run
    for results in ("large_kernels.md", "large_kernels_avx512.md"):
        head = (ROOT / "benchmarks" / "results" / results).read_text().split("\n| layer |")[1].split("\n")[0]
        assert "x native" not in head and "speed-up" in head, head


def test_no_published_table_has_a_nan_cell() -> None:
    """large_kernels.md had `nan` where fft-conv-pytorch has no transposed convolution (HiFi-GAN)."""
    for path in (ROOT / "benchmarks" / "results").glob("*.md"):
        cells = [c.strip() for line in path.read_text().splitlines() if line.startswith("|") for c in line.split("|")]
        assert "nan" not in cells and "inf" not in cells, path.name


# ---- trust signals ---------------------------------------------------------------------------------------------

def test_a_large_steady_speed_up_is_not_flagged() -> None:
    """Before: fft 20x faster than native, the result the large suite exists to show, flagged native's time as
    "implausible ... try --malloc keep" (the default already)."""
    r = _timing({"native": [1.0, 1.02, 0.98], "fft": [0.05, 0.051, 0.049]})
    assert report.suspect(r, "fft", "both") == ""
    _, body = report.table_rows([r])
    assert not any(report.SUSPECT_MARK in cell for row in body for cell in row)


def test_rounds_that_disagree_are_flagged_and_the_advice_fits_the_options(tmp_path: Path) -> None:
    """The judge bites where the per-round speed-ups spread over half their median (2.0 ± 9.5 here) and not where
    they spread by a tenth (mutant: UNSTEADY = 100 flags nothing)."""
    unsteady = _timing({"native": [1.0, 1.0, 1.0], "auto": [0.05, 0.5, 1.0]})
    steady = _timing({"native": [1.0, 1.0, 1.0], "auto": [0.48, 0.5, 0.52]}, 1)
    assert report.suspect(unsteady, "auto", "both").startswith("the rounds disagree")
    assert report.suspect(steady, "auto", "both") == "" and report.suspect(unsteady, "native", "both") == ""
    _, body = report.table_rows([unsteady, steady])
    assert [row[7].endswith(report.SUSPECT_MARK) for row in body] == [False, True, False, False]
    keep = {"suite": "smoke", "command": "convgrad bench", "malloc": "keep (glibc mallopt: no mmap, no trim)"}
    report.to_markdown([unsteady, steady], keep, tmp_path / "keep.md")
    assert "rerun on a quieter machine" in (tmp_path / "keep.md").read_text()
    assert "--malloc" not in (tmp_path / "keep.md").read_text()  # the default already: no advice to use it
    report.to_markdown([unsteady, steady], keep | {"malloc": "system"}, tmp_path / "system.md")
    assert "rerun with --malloc keep" in (tmp_path / "system.md").read_text()
    rows = report.rows([unsteady, steady])
    assert [bool(r["suspect"]) for r in rows if r["task"] == "both"] == [False, True, False, False]


def test_auto_that_kept_re_tuning_is_flagged() -> None:
    r = _timing({"native": [1.0] * 3, "auto": [0.5] * 3}, retimed=3)
    assert report.suspect(r, "auto", "both", repeats=3) == "auto kept re-tuning during the rounds"
    assert report.suspect(r, "auto", "both", repeats=4) == ""


def test_the_markdown_explains_why_both_need_not_lie_between_its_parts(tmp_path: Path) -> None:
    report.to_markdown([_timing({"native": [1.0], "auto": [0.5]})], {"suite": "smoke", "command": "c"},
                       tmp_path / "r.md")
    assert "its speed-up need not lie between grad_input's and grad_weight's" in (tmp_path / "r.md").read_text()


@pytest.mark.parametrize("speedups", [(0.02, 0.03, 0.08), (0.9, 1.05, 1.1), (20.0, 25.0, 50.0), (0.001, 1.0, 900.0)])
def test_every_chart_panel_has_numbers_on_its_y_axis(speedups: tuple[float, ...], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ticks came from a fixed list from 0.1 to 500, so a panel of ratios 0.02-0.08 (fft on RepLKNet, as time
    ratios) had none."""
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    monkeypatch.setattr(report.os, "replace", lambda *a: None)
    results = [_timing({"native": [1.0] * 3, "fft": [1 / s] * 3}, n) for n, s in enumerate(speedups)]
    report.write_plots(results, tmp_path)
    for fig in figures:
        for ax in fig.axes:
            low, high = ax.get_ylim()
            shown = [t for t in ax.get_yticks() if low <= t <= high]
            assert len(shown) >= 2 and all(label.get_text() for label in ax.get_yticklabels()), (ax.get_ylabel(), shown)
            assert math.isclose(low, shown[0]) and math.isclose(high, shown[-1])  # the ends are labelled


# ---- what a sample costs ----------------------------------------------------------------------------------------

def test_a_sample_of_one_call_runs_it_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: torch.utils.benchmark's timeit ran two untimed calls before every sample, so a layer whose calls last
    seconds cost three calls per sample (3D UX-Net's native backward: 8 s a call, 24 s a sample)."""
    import torch

    count = [0]
    forward = timing.native.forward

    def counted(*args: Any) -> Any:
        count[0] += 1
        return forward(*args)

    monkeypatch.setattr(timing.native, "forward", counted)
    layer = layers.SUITES["smoke"][3]  # wav2vec2's 1d conv, tiny
    rounds = list(timing.time_layer(layer, "float32", ["native"], torch.device("cpu"), 1, 3, min_time=0.0))
    assert len(rounds) == 3 and count[0] == 1 + 1 + 3  # first call, calibration, one per round


def test_a_round_in_which_auto_re_tuned_is_timed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A choice tuned again inside a round timed auto's candidates in it: the round is timed again, after settling."""
    import torch

    from convgrad.backends import auto

    ticks = iter([0, 1, 1, 1, 1, 1, 1])  # the count moves during the first round only
    monkeypatch.setattr(timing.auto, "changes", lambda: next(ticks))
    layer = layers.SUITES["smoke"][3]
    with auto.tuning_mode("tune"):
        result = list(timing.time_layer(layer, "float32", ["native", "auto"], torch.device("cpu"), 1, 2, 1e-4))[-1]
    auto.clear()
    assert result.retimed == 1 and len(result.forward.seconds) == 2
    assert all(len(s.seconds) == 2 for s in result.samples.values())
