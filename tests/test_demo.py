"""`convgrad demo` run in-process for a few steps: exit status, files, summary, and that a wrong backward fails."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import convgrad.backends as backends
from convgrad.backends.native import NativeBackend
from convgrad.cli import main
from convgrad.cli._demo_train import EXERCISES
from convgrad.cli.demo import THRESHOLD


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    threads = torch.get_num_threads()
    rc = main(["demo", "--steps", "3", "--epochs", "1", "--out", str(tmp_path), *extra])
    assert torch.get_num_threads() == threads, "the demo must restore torch's thread count"
    summary = json.loads((tmp_path / "summary.json").read_text()) if (tmp_path / "summary.json").exists() else {}
    return rc, summary


@pytest.mark.slow  # the demo trains
def test_demo_few_steps_agrees_and_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, summary = _run(tmp_path)
    assert rc == 0
    assert (tmp_path / "training.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["backend"] == "fwdconv" and summary["steps"] == 3 and summary["passed"] is True
    assert summary["train_images"] + summary["test_images"] == 1797  # load_digits, split 80/20
    assert math.isfinite(summary["final_loss"]) and summary["final_loss"] > 0
    assert 0 <= summary["test_accuracy"] <= 1
    assert set(summary["layers"]) == set(EXERCISES)
    for name, layer in summary["layers"].items():
        assert 0 <= layer["max_rel_diff"] <= THRESHOLD, name
    assert summary["max_rel_diff"] == max(v["max_rel_diff"] for v in summary["layers"].values())
    # the hard cases are really there, read from the shapes each layer received
    assert summary["layers"]["strided"]["unread_input_rows"] == [1, 1]
    assert "padding=((1, 2), (1, 2))" in summary["layers"]["same_even"]["spec"]
    assert "groups=4" in summary["layers"]["grouped"]["spec"]
    assert summary["layers"]["decoder"]["spec"].startswith("conv_transpose2d")
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "agreement" in out and "strided" in out


class _OffByAThousandth(NativeBackend):
    """A wrong backward: grad_weight scaled by 1 + 1e-3."""

    name = "off-by-a-thousandth"

    def backward(self, *args: Any) -> Any:
        gi, gw = super().backward(*args)
        return gi, (None if gw is None else gw * (1 + 1e-3))


@pytest.mark.slow  # the demo trains
def test_demo_fails_on_a_wrong_backward(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(backends._REGISTRY, _OffByAThousandth.name, _OffByAThousandth())
    rc, summary = _run(tmp_path, "--backend", _OffByAThousandth.name)
    assert rc == 1 and summary["passed"] is False
    # every conv's weight gradient is off by 1e-3 relative; each layer's figure must show it
    for name, layer in summary["layers"].items():
        assert layer["max_rel_diff"] == pytest.approx(1e-3, rel=1e-2), name


@pytest.mark.parametrize(("args", "message"), [(["--backend", "nope"], "backend='nope' is not registered"),
                                               (["--steps", "0"], "--steps=0 must be positive")])
def test_demo_user_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    rc, summary = _run(tmp_path, *args)
    assert rc == 2 and summary == {}
    assert message in capsys.readouterr().err
