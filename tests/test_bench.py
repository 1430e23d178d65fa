"""`convgrad bench` and its layer suites: a smoke run writes every report; the suites hold the layers asked for."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from convgrad import cli
from convgrad.cli import bench
from convgrad.cli.bench import layers, report, timing

REQUIRED = {  # the default suite: layer name -> network
    "resnet50.stem7x7s2": "ResNet-50", "resnet50.3x3@56": "ResNet-50", "resnet50.3x3@28": "ResNet-50",
    "resnet50.3x3@14": "ResNet-50", "resnet50.3x3@7": "ResNet-50", "resnet50.3x3s2": "ResNet-50",
    "resnet50.1x1reduce": "ResNet-50", "resnet50.1x1expand": "ResNet-50", "resnet50.1x1s2down": "ResNet-50",
    "mobilenetv2.dw3x3": "MobileNetV2", "mobilenetv2.dw3x3s2": "MobileNetV2", "mobilenetv2.pointwise": "MobileNetV2",
    "vgg16.3x3": "VGG-16", "deeplabv3.aspp12": "DeepLabv3", "wav2vec2.k10s5": "wav2vec 2.0",
    "wav2vec2.k3s2": "wav2vec 2.0", "r3d18.3x3x3": "R3D-18", "resnext50.g32": "ResNeXt-50 32x4d",
    "dcgan.convT4x4s2": "DCGAN", "unet.upconv2x2": "U-Net",
}


def test_default_suite_has_every_layer_the_issue_lists() -> None:
    suite = {layer.name: layer for layer in layers.SUITES["default"]}
    assert {name: suite[name].network for name in REQUIRED} == REQUIRED
    spec = {name: layer.spec() for name, layer in suite.items()}
    assert spec["resnet50.stem7x7s2"].kernel_size == (7, 7) and spec["resnet50.stem7x7s2"].stride == (2, 2)
    assert spec["mobilenetv2.dw3x3s2"].groups == spec["mobilenetv2.dw3x3s2"].in_channels
    assert spec["deeplabv3.aspp12"].dilation == (12, 12) and spec["resnext50.g32"].groups == 32
    assert spec["wav2vec2.k10s5"].n == 1 and spec["r3d18.3x3x3"].n == 3
    assert spec["dcgan.convT4x4s2"].transposed and spec["unet.upconv2x2"].transposed
    assert layers.select("default", dtype="float64") and all(layer.float64 for layer in layers.select(
        "default", dtype="float64"))


def test_default_backends_come_from_the_registry_as_the_old_hand_kept_list_did() -> None:
    """The backends timed without --backends are those whose class declares ``bench_by_default``: the set the
    hand-kept DEFAULT_BACKENDS held (numpy: too slow; fft: timed by the ``large`` suite), auto last. Mutant:
    ``bench_by_default = True`` on Backend itself times numpy and fft too."""
    for suite in (None, "default", "slow", "all", "smoke"):
        names = bench.default_backends(suite)
        assert set(names) == {"fwdconv", "gemm", "channels_last", "regroup", "chunked", "auto"}
        assert names[-1] == "auto" and "native" not in names


def test_the_large_suite_times_fft_by_default() -> None:
    """Before: ``--suite large`` timed the registry's defaults, fft not among them, although its help says the
    suite is where fft pays; it times fft, fwdconv and auto (auto's only picks there besides native)."""
    assert bench.default_backends("large") == ["fwdconv", "fft", "auto"]
    args = cli.build_parser().parse_args(["bench", "--suite", "large"])
    assert bench._check(args) == ["native", "fwdconv", "fft", "auto"]
    assert "fft" in bench._check(cli.build_parser().parse_args(["bench", "--suite", "large", "--quick",
                                                                 "--backends", "fft", "auto"]))


def test_select_refuses_unknown_suites_and_patterns_that_match_nothing() -> None:
    with pytest.raises(ValueError, match="--suite='nope'"):
        layers.select("nope")
    with pytest.raises(ValueError, match="match no layer"):
        layers.select("default", ["inception.*"])
    assert [layer.name for layer in layers.select("default", ["wav2vec2.*"])] == ["wav2vec2.k10s5", "wav2vec2.k3s2"]


@pytest.mark.slow  # times real layers
def test_smoke_run_writes_json_markdown_and_a_chart(tmp_path: Any) -> None:
    out = tmp_path / "bench"
    assert cli.main(["bench", "--suite", "smoke", "--backends", "fwdconv", "gemm", "auto", "--dtype", "float32",
                     "float64", "--repeats", "3", "--min-time", "0", "--threads", "1", "--out", str(out),
                     "--quiet"]) == 0
    data = json.loads((out / "results.json").read_text())
    meta = data["meta"]
    assert meta["threads"] == 1 and meta["cores"] >= 1 and meta["cpu_model"] and meta["suite"] == "smoke"
    rows = data["results"]
    smoke_f64 = sum(layer.float64 for layer in layers.SUITES["smoke"])
    assert len(rows) == (len(layers.SUITES["smoke"]) + smoke_f64) * 4 * 3  # layers x backends x tasks
    for row in rows:
        assert len(row["samples_ms"]) == 3 and row["median_ms"] > 0 and row["gflops"] > 0
        assert row["matmul_fraction"] > 0 and row["iqr_ms"] >= 0
        if row["backend"] == "native":
            assert row["speedup"] == 1.0 and row["suspect"] is None
        if row["backend"] == "auto":
            assert row["auto_choice"] in ("native", "fwdconv", "gemm", *(("split",) if row["task"] == "both" else ()))
        assert len(row["forward_samples_ms"]) == 3 and row["forward_ms"] > 0
        assert row["in_forwards"] > 0 and row["in_forwards_iqr"] >= 0 and row["speedup_iqr"] >= 0
    assert {s["backend"] for s in data["summary"]} == {"native", "fwdconv", "gemm", "auto"}
    assert all(s["geomean_in_forwards"] > 0 for s in data["summary"])
    assert meta["layers_done"] == f"{len(data['layers'])} of {len(data['layers'])}" and meta["estimate_s"] > 0
    assert set(meta["conventions"]) == {"speedup", "in_forwards"}
    assert "targets" not in data
    md = (out / "results.md").read_text()
    assert "| layer | dtype | backend | fwd ms |" in md and "both in fwds ± IQR" in md
    for name in ("speedups", "forward"):
        for dtype in ("float32", "float64"):
            assert (out / f"{name}_{dtype}.png").stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--backends", "nope"], "backend='nope'"),
    (["--threads", "0"], "--threads=0"),
    (["--layers", "nothing*"], "match no layer"),
    (["--device", "tpu"], "--device=tpu"),
])
def test_bench_errors_are_one_line(argv: list[str], message: str, capsys: Any, tmp_path: Any) -> None:
    assert cli.main(["bench", "--suite", "smoke", "--out", str(tmp_path), "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_an_unusable_out_is_refused_before_any_layer_is_timed(capsys: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """--out naming a file used to fail only after the whole run (53 s for smoke on 2 cores), losing its timings."""
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a layer was timed before --out was checked")

    monkeypatch.setattr(timing, "time_layer", never)
    a_file = tmp_path / "results.txt"
    a_file.write_text("")
    assert cli.main(["bench", "--suite", "smoke", "--out", str(a_file), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err == (f"convgrad bench: error: --out={a_file} is an existing file, not a folder; --out names the folder "
                   "that gets results.json, results.md and the charts (give a new or existing folder)\n")


def test_geomean() -> None:
    assert report.geomean([1.0, 4.0]) == pytest.approx(2.0) and math.isnan(report.geomean([]))


def test_rounds_time_each_task_back_to_back_and_rotate() -> None:
    """Every (backend, task) once per round; a task's backends adjacent (the ratios compare them), native's forward
    right before "both"; orders rotate."""
    backends = ["native", "fwdconv", "gemm", "auto"]
    orders = [timing._round_order(backends, r) for r in range(12)]
    for order in orders:
        assert sorted(order) == sorted([(b, t) for b in backends for t in timing.TASKS]
                                       + [("matmul", ""), timing.FORWARD])
        at = order.index(timing.FORWARD)
        assert {t for _, t in order[at + 1:at + 1 + len(backends)]} == {"both"}
        tasks = [t for key, t in order[:-1] if key != timing.FORWARD[0]]
        assert all(len(set(tasks[i:i + len(backends)])) == 1 for i in range(0, len(tasks), len(backends)))
    firsts = {(b, t) for b in backends for t in timing.TASKS if t != "both"} | {timing.FORWARD}
    assert {o[0] for o in orders} == firsts  # every task and every backend goes first in some round


def test_auto_is_timed_once_its_choices_have_settled() -> None:
    """Before the rounds, auto's calls run until no comparison is pending, so the rounds time its choice, not the
    losing candidates it still compared (a float64 run measured auto 1.22x native where it had chosen native)."""
    from convgrad.backends import auto

    layer = next(lay for lay in layers.SUITES["default"] if lay.name == "resnet50.1x1s2down")
    small = dataclasses.replace(layer, input_shape=(8, 16, 12, 12), weight_shape=(32, 16, 1, 1))
    auto.clear()
    with auto.tuning_mode("tune"):
        result = next(timing.time_layer(small, "float32", ["native", "fwdconv", "gemm", "auto"],
                                        timing.torch.device("cpu"), 1, 1, 1e-4))
        spec = small.spec()
        like = timing.torch.empty(spec.output_shape)
        previous = timing.torch.get_num_threads()
        timing.torch.set_num_threads(1)  # the thread count the rounds ran with: part of auto's key
        choices = [auto.chosen(spec, g, like) for g in timing.TASKS]
        timing.torch.set_num_threads(previous)
    auto.clear()
    assert all(c is not None and not c.pending for c in choices)
    assert result.auto_choice == {g: c.backend for g, c in zip(timing.TASKS, choices, strict=True)}


def test_settle_stops_when_nothing_is_pending_or_after_its_calls() -> None:
    calls = []

    class Choice:
        def __init__(self, pending: tuple[str, ...]) -> None:
            self.pending = pending

    timing._settle(lambda: Choice(("native", "gemm") if len(calls) < 3 else ()), lambda: calls.append(1))
    assert len(calls) == 3
    calls.clear()
    timing._settle(lambda: Choice(("native", "gemm")), lambda: calls.append(1))
    assert len(calls) == timing._SETTLE_CALLS
    calls.clear()
    timing._settle(lambda: None, lambda: calls.append(1))
    assert calls == []


def test_slow_suite_holds_the_layers_users_report_slow_and_all_holds_both() -> None:
    slow = {layer.name: layer for layer in layers.SUITES["slow"]}
    spec = {name: layer.spec() for name, layer in slow.items()}
    assert all(layer.network and layer.where for layer in slow.values())
    depthwise = {n for n, s in spec.items() if s.groups == s.in_channels == s.out_channels}
    assert {n for n in depthwise if spec[n].n == 3} >= {"csn.dw3x3x3", "x3d.dw3x3x3s2"}
    assert {n for n in depthwise if spec[n].n == 1} >= {"conformer.dw31", "convtasnet.dw3d8"}
    assert spec["convnext.dw7x7"].kernel_size == (7, 7) and "convnext.dw7x7" in depthwise
    assert spec["efficientnet.dw5x5s2"].kernel_size == (5, 5) and spec["efficientnet.dw5x5s2"].stride == (2, 2)
    grouped = [s for s in spec.values() if s.n == 3 and 1 < s.groups < s.in_channels]
    assert grouped and all(s.in_channels // s.groups == 8 for s in grouped)
    assert layers.SUITES["all"] == layers.SUITES["default"] + layers.SUITES["slow"]
    assert [layer.name for layer in layers.SUITES["default"]] == list(REQUIRED)  # the 20 layers, unchanged


def _timing(forward: list[float], native: list[float], other: list[float]) -> timing.LayerTiming:
    layer = layers.SUITES["smoke"][0]
    samples = {(b, t): timing.Sample(list(s)) for b, s in (("native", native), ("gemm", other)) for t in timing.TASKS}
    return timing.LayerTiming(layer, "float32", 8, timing.Sample([1e-3] * len(forward)), samples,
                              forward=timing.Sample(forward))


def test_multiples_of_the_forward_pair_each_round_with_its_own_forward() -> None:
    """in fwds is the median of per-round multiples (not a ratio of medians, which load in one round would skew)."""
    r = _timing(forward=[1.0, 2.0, 4.0], native=[2.0, 2.0, 8.0], other=[3.0, 8.0, 4.0])
    assert r.in_forwards("native") == pytest.approx(2.0)  # multiples 2, 1, 2 (medians: 2 / 2 = 1)
    assert r.in_forwards("gemm") == pytest.approx(3.0)  # multiples 3, 4, 1 (medians: 4 / 2 = 2)
    assert r.in_forwards_iqr("gemm") == pytest.approx(3.5 - 2.0)
    assert r.speedup("gemm", "both") == pytest.approx(2 / 3)  # speed-ups 2/3, 1/4, 2
    assert r.speedup_iqr("gemm", "both") == pytest.approx((2 / 3 + 2) / 2 - (1 / 4 + 2 / 3) / 2)  # inclusive


def test_list_prints_the_layers_and_times_nothing(capsys: Any, tmp_path: Any) -> None:
    out = tmp_path / "never"
    assert cli.main(["bench", "--list", "--suite", "all", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert all(name in text for name in ("default", "slow", "all", "smoke"))
    for layer in layers.SUITES["all"]:
        assert layer.name in text and layer.network in text
    assert not out.exists()
    assert cli.main(["bench", "--list", "--dtype", "float64"]) == 0
    listed = capsys.readouterr().out
    assert all((layer.name in listed) == layer.float64 for layer in layers.SUITES["default"])


@pytest.mark.slow  # times real layers
def test_printed_tables_are_whole_in_a_pipe_and_name_no_targets(tmp_path: Any) -> None:
    """Piped, rich used to squeeze the table into 80 columns ("resne…"); the summary showed goals and a red NO."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80"}
    done = subprocess.run([sys.executable, "-m", "convgrad", "bench", "--suite", "smoke", "--layers", "resnet50.*",
                           "wav2vec2.*", "--backends", "gemm", "--repeats", "2", "--min-time", "0", "--threads", "1",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "…" not in text
    for name in ("resnet50.3x3s2", "resnet50.1x1s2down", "wav2vec2.k10s5", "both in fwds ± IQR", "geomean in fwds"):
        assert name in text
    assert max(len(line) for line in text.splitlines()) > 80
    lowered = text.lower()
    assert "issue" not in lowered and "target" not in lowered and "goal" not in lowered and " no " not in lowered
    md = (tmp_path / "results.md").read_text().lower()
    assert "issue" not in md and "target" not in md


def test_benchmarks_readme_says_how_long_a_run_takes_and_names_no_internal_goals() -> None:
    from pathlib import Path

    text = (Path(__file__).parents[1] / "benchmarks" / "README.md").read_text()
    assert "How long it takes" in text and "minutes" in text and "--list" in text
    lowered = text.lower()
    assert "issue" not in lowered and "target" not in lowered and "goal" not in lowered
