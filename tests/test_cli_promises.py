"""What the command line promises, run in-process through ``cli.main``: --version, output paths written as reported
and refused before any work, the status of a closed pipe, shapes shown as typed, demo's --out and summary, and the
bench charts' colours (bench's trust signals: tests/test_bench_run.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import convgrad
from convgrad import cli
from convgrad.cli.bench import layers, report, timing

SMALL = ["--input", "1,1,5,5", "--weight", "1,1,3,3", "--stride", "2"]


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"convgrad {convgrad.__version__}\n"


# ---- explain's output paths ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("argv", "message"), [
    (["--plot", "recipe"], "--plot=recipe has no extension; end it in one of .png, .svg, .pdf"),
    (["--plot", "recipe.txt"], "--plot=recipe.txt has the extension '.txt', which it cannot write"),
    (["--plot", "{tmp}"], "--plot={tmp} is a folder; give a file in it, e.g. {tmp}/recipe.png"),
    (["--animate", "steps"], "--animate=steps has no extension; end it in one of .gif, .webp, .mp4, .html"),
    (["--animate", "{tmp}"], "--animate={tmp} is a folder"),
    (["--html", "page"], "--html=page has no extension; end it in one of .html, .htm"),
    (["--html", "page.gif"], "--html=page.gif has the extension '.gif'"),
    (["--html", "{tmp}/missing/page.html"], "{tmp}/missing/page.html: No such file or directory"),
    (["--plot", "ok.png", "--html", "{tmp}/missing/page.html"], "missing/page.html: No such file or directory"),
])
def test_an_output_path_is_refused_in_one_line_before_any_work(argv: list[str], message: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --plot recipe wrote recipe.png and said "wrote recipe"; a bad --animate or --html suffix, or a missing
    folder, was found after the recipe had been printed (and after the --plot before it had been written)."""
    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the recipe was built before the output paths were checked")

    monkeypatch.setattr(convgrad, "explain", never)
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert cli.main(["explain", *SMALL, *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("convgrad explain: error: ") and message.replace("{tmp}", str(tmp_path)) in err, err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a file was written"


def test_each_output_is_written_exactly_where_it_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert cli.main(["explain", *SMALL, "--plot", "r.svg", "--animate", "a.gif", "--html", "p.htm",
                     "--max-frames", "3"]) == 0
    reported = [line.removeprefix("wrote ") for line in capsys.readouterr().err.splitlines()]
    assert reported == ["r.svg", "a.gif", "p.htm"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(reported)
    assert all((tmp_path / name).stat().st_size > 0 for name in reported)


@pytest.mark.parametrize("argv", [["--plot", "r.png"], ["--animate", "a.gif", "--max-frames", "3"],
                                  ["--html", "p.html", "--max-frames", "3"], ["--plot", "r.png", "--html", "p.html"]])
def test_a_picture_command_prints_one_line_per_file_not_the_recipe(argv: list[str], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --plot, --animate and --html printed the whole recipe (40 lines here) before saying what they wrote;
    --text asks for it."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["explain", *SMALL, *argv]) == 0
    out, err = capsys.readouterr()
    written = [a for a in argv if "." in a]
    assert out == "" and err.splitlines() == [f"wrote {name}" for name in written]
    assert cli.main(["explain", *SMALL, *argv, "--text"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("conv2d input=(1, 1, 5, 5) weight=(1, 1, 3, 3) stride=(2, 2)\n") and "grad_weight" in out
    assert err.splitlines() == [f"wrote {name}" for name in written]


@pytest.mark.parametrize("frames", ["0", "2", "-1"])
def test_too_few_frames_are_refused_before_anything_is_printed(frames: str, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: --max-frames 0 printed the recipe, then failed in the renderer."""
    monkeypatch.chdir(tmp_path)
    assert cli.main(["explain", *SMALL, "--animate", "a.gif", "--text", "--max-frames", frames]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == (f"convgrad explain: error: --max-frames={frames} must be at least 3: one frame for "
                                 "each of forward, grad_input, grad_weight\n")
    assert list(tmp_path.iterdir()) == []


# ---- a closed pipe ------------------------------------------------------------------------------------------------

@pytest.mark.slow  # a fresh interpreter; test_cli.py::test_a_closed_pipe_ends_quietly checks the status in-process
def test_a_closed_pipe_is_status_141_not_checks_out_of_tolerance() -> None:
    """`convgrad check ... | head` returned 1, the status check gives a gradient out of tolerance; a script with
    pipefail could not tell a closed pipe from a failed check. 141 = 128 + SIGPIPE, as the shell reports for
    coreutils' `yes | head`."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "convgrad", "check", "--input", "1,2,5,5", "--weight", "2,2,3,3",
                               "--backend", "native"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=300)
    finally:
        os.close(write)
    assert proc.returncode == cli.CLOSED_PIPE == 141 and proc.stderr == ""


# ---- shapes as typed ----------------------------------------------------------------------------------------------

def test_a_three_entry_input_of_a_2d_weight_is_shown_unbatched(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `--input 4,9,9` was shown as input=(1, 4, 9, 9)."""
    assert cli.main(["explain", "--input", "4,9,9", "--weight", "6,2,3,3", "--groups", "2"]) == 0
    head = capsys.readouterr().out.splitlines()
    assert head[0] == "conv2d input=(4, 9, 9) (unbatched) weight=(6, 2, 3, 3) groups=2"
    assert head[1].startswith("grad_output shape (6, 7, 7) (unbatched; the steps below run it as a batch of 1);")
    assert cli.main(["check", "--input", "4,9,9", "--weight", "6,2,3,3", "--groups", "2", "--backend", "native"]) == 0
    assert capsys.readouterr().out.startswith("conv2d input=(4, 9, 9) (unbatched) weight=(6, 2, 3, 3) groups=2")


@pytest.mark.parametrize(("command", "size", "weight", "message"), [
    ("explain", "2,3,9,9", "6,4,3,3", "weight.shape=(6, 4, 3, 3) with groups=1 expects in_channels=4, but input has "
                                      "3 channels (--input 2,3,9,9 is read as (N, C_in, H, W): C_in=3 is its entry 2)"),
    ("explain", "3,9,9", "6,4,3,3", "--input 3,9,9 has 3 sizes and --weight 6,4,3,3 is a 2d convolution's, so the "
                                    "input is read as unbatched (C_in, H, W) = (3, 9, 9); a batched input takes 4 "
                                    "sizes (N, C_in, H, W). Read so: weight.shape=(6, 4, 3, 3) with groups=1 expects "
                                    "in_channels=4, but input has 3 channels"),
    ("check", "3,9,9", "6,4,3,3", "--input 3,9,9 has 3 sizes and --weight 6,4,3,3 is a 2d convolution's, so the "
                                  "input is read as unbatched (C_in, H, W) = (3, 9, 9); a batched input takes 4 sizes "
                                  "(N, C_in, H, W). Read so: weight.shape=(6, 4, 3, 3) with groups=1 expects "
                                  "in_channels=4, but input has 3 channels"),
    ("check", "5,7", "6,4,3", "--input 5,7 has 2 sizes and --weight 6,4,3 is a 1d convolution's, so the input is "
                              "read as unbatched (C_in, L) = (5, 7); a batched input takes 3 sizes (N, C_in, L). Read "
                              "so: weight.shape=(6, 4, 3) with groups=1 expects in_channels=4, but input has 5 "
                              "channels"),
    # before: "kernel extent dilation*(k-1)+1=3 is larger than the padded input 1+0+0=1 in spatial dim 0 (...)", the
    # kernel blamed where a size of the input is missing
    ("explain", "1,1,5", "1,1,3,3", "--input 1,1,5 has 3 sizes and --weight 1,1,3,3 is a 2d convolution's, so the "
                                    "input is read as unbatched (C_in, H, W) = (1, 1, 5); a batched input takes 4 "
                                    "sizes (N, C_in, H, W). Read so: kernel extent dilation*(k-1)+1=3 is larger than "
                                    "the padded input 1+0+0=1 in spatial dim 0"),
])
def test_a_shape_error_says_how_the_input_was_read(command: str, size: str, weight: str, message: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "... but input has 3 channels", with no word of which entry of --input 3,9,9 that was; an input one
    size short (read as unbatched) blamed the kernel."""
    assert cli.main([command, "--input", size, "--weight", weight]) == 2
    assert capsys.readouterr().err == f"convgrad {command}: error: {message}\n"


@pytest.mark.parametrize("argv", [
    ["explain", "--input", "1,4,40,40", "--weight", "4,1,31,31", "--groups", "4", "--method", "ftt"],
    ["check", "--input", "1,4,40,40", "--weight", "4,1,31,31", "--groups", "4", "--backend", "fftt"],
], ids=["explain-method", "check-backend"])
def test_a_bad_method_or_backend_name_is_not_explained_by_how_input_was_read(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """Before (review6): "method='ftt' must be None or one of (...) (--input 1,4,40,40 is read as (N, C_in, H, W):
    C_in=4 is its entry 2)": how the shapes were read, added to an error that is not about them."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "'ftt'" in err or "'fftt'" in err, err
    assert "is read as" not in err and err.count("\n") == 1, err


def test_read_as_only_speaks_of_shapes_it_can_read() -> None:
    assert cli.read_as((2, 3, 9, 9, 9), (6, 3, 3, 3, 3)) == \
        "--input 2,3,9,9,9 is read as (N, C_in, D, H, W): C_in=3 is its entry 2"
    assert cli.read_as((9, 9), (6, 3, 3, 3)) == ""  # too few dims: the library's own message says so


# ---- demo --------------------------------------------------------------------------------------------------------

def test_demo_out_onto_an_existing_file_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "convgrad demo: error: run: File exists"."""
    target = tmp_path / "run"
    target.write_text("keep me")
    assert cli.main(["demo", "--out", str(target), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err == (f"convgrad demo: error: --out={target} is an existing file, not a folder; --out names the folder "
                   "that gets training.png and summary.json (give a new or existing folder)\n")
    assert target.read_text() == "keep me"



@pytest.mark.slow  # the demo trains (issue 26: training runs in the slow tier, with tests/test_demo.py)
def test_demo_summary_records_the_steps_that_ran(tmp_path: Path) -> None:
    """Before: `--steps 2 --epochs 3` recorded "epochs": 3, though 2 steps are a fraction of one epoch."""
    assert cli.main(["demo", "--out", str(tmp_path), "--steps", "2", "--epochs", "3"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["steps_requested"] == 2 and summary["epochs_requested"] == 3
    assert summary["steps_per_epoch"] == 23  # 1,437 training images in batches of 64
    assert summary["epochs"] == round(2 / 23, 3)


# ---- bench reports ------------------------------------------------------------------------------------------------

def _timing(times: dict[str, float], layer: int = 0) -> timing.LayerTiming:
    """A LayerTiming of three rounds with these per-backend times (s), the same for every task."""
    samples = {(b, t): timing.Sample([s] * 3) for b, s in times.items() for t in timing.TASKS}
    return timing.LayerTiming(layers.SUITES["smoke"][layer], "float32", 8, timing.Sample([1e-3] * 3), samples,
                              forward=timing.Sample([0.5] * 3))


def test_bench_charts_give_each_backend_one_colour(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: the speed-up chart (without native) and the forward chart (with it) coloured each backend from
    matplotlib's cycle, so fwdconv was orange in one and blue in the other."""
    from matplotlib.container import BarContainer
    from matplotlib.figure import Figure

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: figures.append(self))
    monkeypatch.setattr(report.os, "replace", lambda *a: None)  # nothing was saved to move into place
    results = [_timing({"native": 1.0, "fwdconv": 0.8, "gemm": 1.5, "auto": 0.9}, n) for n in range(2)]
    report.write_plots(results, tmp_path)
    colours: dict[str, set[tuple[float, ...]]] = {}
    for fig in figures:
        for ax in fig.axes:
            for bars in ax.containers:
                if isinstance(bars, BarContainer):
                    colours.setdefault(bars.get_label(), set()).update(tuple(p.get_facecolor()) for p in bars)
    assert set(colours) == {"native", "fwdconv", "gemm", "auto"} and len(figures) == 2
    assert all(len(c) == 1 for c in colours.values()), colours  # one colour per backend across the charts
    assert len({next(iter(c)) for c in colours.values()}) == 4  # and a different one for each
