"""`convgrad bench` and its layer suites: a smoke run writes every report; the suites are what issue 4 lists."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from convgrad import cli
from convgrad.cli.bench import layers, report, timing

REQUIRED = {  # issue 4: layer name -> network
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


def test_select_refuses_unknown_suites_and_patterns_that_match_nothing() -> None:
    with pytest.raises(ValueError, match="--suite='nope'"):
        layers.select("nope")
    with pytest.raises(ValueError, match="match no layer"):
        layers.select("default", ["inception.*"])
    assert [layer.name for layer in layers.select("default", ["wav2vec2.*"])] == ["wav2vec2.k10s5", "wav2vec2.k3s2"]


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
            assert row["ratio_to_native"] == 1.0
        if row["backend"] == "auto":
            assert row["auto_choice"] in ("native", "fwdconv", "gemm", *(("split",) if row["task"] == "both" else ()))
    assert {s["backend"] for s in data["summary"]} == {"native", "fwdconv", "gemm", "auto"}
    assert any(t["goal"].startswith("gemm float64") and t["met"] is not None for t in data["targets"])
    md = (out / "results.md").read_text()
    assert "| layer | dtype | backend |" in md and "Targets (issue 4)" in md
    assert (out / "ratios_float32.png").stat().st_size > 0 and (out / "ratios_float64.png").stat().st_size > 0


@pytest.mark.parametrize(("argv", "message"), [
    (["--backends", "nope"], "backend='nope'"),
    (["--threads", "0"], "--threads=0"),
    (["--layers", "nothing*"], "match no layer"),
    (["--device", "tpu"], "--device=tpu"),
])
def test_bench_errors_are_one_line(argv: list[str], message: str, capsys: Any, tmp_path: Any) -> None:
    assert cli.main(["bench", "--suite", "smoke", "--out", str(tmp_path), "--quiet", *argv]) == 2
    assert message in capsys.readouterr().err


def test_geomean() -> None:
    assert report.geomean([1.0, 4.0]) == pytest.approx(2.0) and math.isnan(report.geomean([]))


def test_rounds_time_each_task_back_to_back_and_rotate() -> None:
    """Every (backend, task) once per round; a task's backends adjacent (the ratios compare them); orders rotate."""
    backends = ["native", "fwdconv", "gemm", "auto"]
    orders = [timing._round_order(backends, r) for r in range(12)]
    for order in orders:
        assert sorted(order) == sorted([(b, t) for b in backends for t in timing.TASKS] + [("matmul", "")])
        tasks = [t for _, t in order[:-1]]
        assert all(len(set(tasks[i:i + len(backends)])) == 1 for i in range(0, len(tasks), len(backends)))
    assert {o[0] for o in orders} == {(b, t) for b in backends for t in timing.TASKS}  # everyone goes first
