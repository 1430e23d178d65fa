"""`convgrad bench --model`: the user's own training step, plain against patched, and what auto chose per conv call.

The fast tier runs the patterns network (tests/patterns.py: conv subclasses with a forward of their own, F.conv2d
called in a forward) through the command, checks its per-call report against auto's store as auto itself keys it
(each call's real grad_output, recorded in a plain step), the JSON round trip, the rounds' pairing and dropping,
and the peak memory of a step; the slow tier runs the RepLKNet block of the docs' how-to and a timm model. The
command's one-line errors are in tests/test_cli.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from convgrad import cli
from convgrad.backends import auto
from convgrad.cli.bench import model as bench_model_module
from convgrad.cli.bench.model import MAX_DROPPED, ModelBench, bench_model, peak_bytes
from convgrad.cli.check.model import build_model
from convgrad.reach import CONV_FUNCTIONS, ConvCall
from convgrad.spec import ConvSpec

TESTS = Path(__file__).resolve().parent
NETWORK = f"{TESTS / 'patterns.py'}:network"  # SameConv, StdConv, BlurPool: F.conv2d in their forward
QUICK = ["--quick", "--threads", "1"]


def _run(*argv: str) -> tuple[int, str, str]:
    """``convgrad bench ARGV`` in-process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["bench", *argv])
    return code, out.getvalue(), err.getvalue()


class _Convs(TorchFunctionMode):
    """Every conv call of a forward: its spec, its batched input and, after the backward, its grad_output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in CONV_FUNCTIONS:
            c = ConvCall.parse(func, args, kwargs)
            spec = ConvSpec.from_shapes(c.input.shape, c.weight.shape, c.stride, c.padding, c.dilation, c.transposed,
                                        c.output_padding, c.groups, fn=c.fn)
            record = {"spec": spec, "input": c.input.detach(), "need": (c.input.requires_grad,
                                                                        c.weight.requires_grad)}
            out.register_hook(lambda g, record=record: record.update(grad_output=g))
            self.calls.append(record)
        return out


def _from_the_store(target: str, shape: tuple[int, ...]) -> list[tuple[str, str]]:
    """(forward, gradients) of each conv call of one training step of the model, read from auto's store with each
    call's own input and grad_output as auto keys them (``auto.chosen``): what bench's report must say."""
    model = build_model(target)
    x = torch.randn(shape)
    with _Convs() as convs:
        out = model(x)
    out.square().mean().backward()
    expected = []
    for c in convs.calls:
        need_input, need_weight = c["need"]
        wanted = "both" if need_input and need_weight else "grad_input" if need_input else "grad_weight"
        forward = auto.chosen(c["spec"], "forward", c["input"])
        grads = auto.chosen(c["spec"], wanted, c["grad_output"])
        assert grads is not None, f"{c['spec'].describe()}: no {wanted} choice in the store after a training step"
        expected.append(("native" if forward is None else forward.backend,
                         " / ".join(grads.parts) if grads.backend == "split" else grads.backend))
    return expected


def test_bench_model_reports_every_conv_call_as_auto_chose_it(tuned: None) -> None:
    """The patterns network through the command (--json): each conv call, a subclass's own F.conv2d included, was
    reached by convgrad, and its forward and gradients are auto's choices in the store for that call."""
    code, out, err = _run("--model", NETWORK, "--input-shape", "4,3,12,12", *QUICK, "--json")
    assert code == 0, err
    r = ModelBench.from_json(out)
    assert [c.call for c in r.calls][:4] == ["conv2d in SameConv.forward", "conv2d in StdConv.forward",
                                             "conv2d in ScaledStdConv.forward", "conv2d in BlurPool.forward"]
    assert {c.backend for c in r.calls} == {"auto"} and len(r.calls) == 7
    assert [(c.forward, c.gradients) for c in r.calls] == _from_the_store(NETWORK, (4, 3, 12, 12))
    assert r.machine["threads"] == 1 and r.machine["cores"] >= 1 and r.machine["cpu_model"]
    assert len(r.speedups) >= 3 and r.plain.first > 0 and r.patched.first > 0
    assert r.plain.peak_bytes > 0 and r.patched.peak_bytes > 0
    assert "first steps" in err and out.lstrip().startswith("{")  # progress on stderr, stdout JSON alone


def test_the_store_check_catches_a_report_that_misreads_the_layout(tuned: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge above bites: a report that looks auto's choices up with a contiguous grad_output only (where the
    patterns block's depthwise and 1x1 convs get one in channels last) does not match the store."""
    from convgrad.nn import conv_report

    like = conv_report._like
    monkeypatch.setattr(conv_report, "_like", lambda spec, x, channels_last: like(spec, x, False))
    r = bench_model(NETWORK, (4, 3, 12, 12), steps=1, min_time=0, warmup=0)
    rows = [(c.forward, c.gradients) for c in r.calls]
    assert "not tuned yet" in {g for _, g in rows}
    assert rows != _from_the_store(NETWORK, (4, 3, 12, 12))


def test_json_round_trips_with_every_figure(tuned: None) -> None:
    code, out, _ = _run("--model", "convgrad.cli.check:example_model", "--input-shape", "2,3,16,16", *QUICK,
                        "--backend", "fwdconv", "--optimizer", "sgd", "--json")
    assert code == 0
    r = ModelBench.from_json(out)
    assert r.to_json() == out.rstrip("\n")
    figures = json.loads(out)["figures"]
    assert figures == r.figures() and set(figures) >= {"speedup", "speedup_iqr", "first_step_cost", "plain_step",
                                                       "patched_step"}
    assert r.speedup == sorted(p / q for p, q in zip(r.plain.steps, r.patched.steps))[len(r.speedups) // 2]
    assert r.first_step_cost == r.patched.first / r.plain.median
    assert (r.backend, r.optimizer, r.input_shape, r.dtype) == ("fwdconv", "sgd", (2, 3, 16, 16), "float32")
    assert {c.gradients for c in r.calls} == {"fwdconv"}


def test_the_printed_report_names_the_machine_the_speedup_and_each_call(tuned: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("COLUMNS", raising=False)  # a pipe's width: whole rows
    code, out, err = _run("--model", NETWORK, "--input-shape", "2,3,12,12", *QUICK)
    assert code == 0, err
    first, machine = out.splitlines()[:2]
    assert first == f"{NETWORK}, input (2, 3, 12, 12), float32" and " 1 thread, torch " in machine
    for words in ("step, median ± IQR", "first step", "peak memory of a step", "speed-up of the step",
                  "first-step cost", "conv2d in BlurPool.forward", "7 of 7 conv calls reached by convgrad"):
        assert words in out, words


class _Steps:
    """A stand-in training step that logs its name and takes the seconds it is given, changing auto's choices on the
    calls listed."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def step(self) -> None:
        self.log.append(self.name)


def _fake_rounds(monkeypatch: pytest.MonkeyPatch, change_at: set[int], steps: int) -> tuple[Any, list[str]]:
    """``_rounds`` over stand-in steps: plain takes 2 s, patched 1 s; auto's choices change during the calls of
    ``change_at`` (counted from 0)."""
    log: list[str] = []
    count = {"changes": 0}

    def changes() -> int:
        return count["changes"]

    def timed(trainer: Any) -> float:
        trainer.step()
        if len(log) - 1 in change_at:
            count["changes"] += 1
        return 2.0 if trainer.name == "plain" else 1.0

    monkeypatch.setattr(bench_model_module.auto, "changes", changes)
    got = bench_model_module._rounds(_Steps("plain", log), _Steps("patched", log), timed, steps, 0.0)
    return got, log


def test_rounds_pair_one_step_of_each_and_swap_their_order(monkeypatch: pytest.MonkeyPatch) -> None:
    (plain, patched, dropped, settled), log = _fake_rounds(monkeypatch, set(), 4)
    assert log == ["plain", "patched", "patched", "plain"] * 2
    assert (plain, patched, dropped, settled) == ([2.0] * 4, [1.0] * 4, 0, True)


def test_a_round_in_which_auto_changed_a_choice_drops_the_rounds_so_far(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls 0-5 are rounds 0-2; a change in round 2 drops it and the two before it, and the count starts again."""
    (plain, _, dropped, settled), log = _fake_rounds(monkeypatch, {5}, 3)
    assert (len(plain), dropped, settled, len(log)) == (3, 3, True, 12)


def test_past_max_dropped_a_changing_round_is_kept_and_said(monkeypatch: pytest.MonkeyPatch) -> None:
    (plain, _, dropped, settled), _ = _fake_rounds(monkeypatch, set(range(1, 4 * MAX_DROPPED, 2)), 3)
    assert dropped == MAX_DROPPED and not settled and len(plain) == 3


def test_peak_bytes_counts_what_a_step_allocates_beyond_what_was_live() -> None:
    live = torch.ones(1 << 20)  # 4 MiB held before and after: not counted

    def step() -> None:
        a = live * 2  # 4 MiB
        b = a + 1  # 4 MiB more while a lives: 8 MiB
        del a, b
        c = live * 3  # 4 MiB once both were freed: the peak stays 8 MiB
        del c

    assert peak_bytes(step, torch.device("cpu")) >> 20 == 8  # and a few bytes of scalars
    assert peak_bytes(lambda: None, torch.device("cpu")) == 0


def test_a_model_whose_output_needs_no_gradient_is_refused(tmp_path: Path) -> None:
    (tmp_path / "frozen.py").write_text(textwrap.dedent("""
        import torch
        def build():
            return torch.nn.Conv2d(3, 4, 3).requires_grad_(False)
    """))
    with pytest.raises(ValueError, match="its output has no floating tensor that needs a gradient"):
        bench_model(f"{tmp_path / 'frozen.py'}:build", (1, 3, 8, 8), steps=1, min_time=0, warmup=0)


# ---- the slow tier: the docs' RepLKNet block and a timm model ------------------------------------------------------

@pytest.mark.slow
def test_the_replknet_block_of_the_how_to(tuned: None) -> None:
    """The block the large-kernel how-to starts from: every conv reached, the 31x31 depthwise conv's gradients on
    fft as auto chose them (the store agrees on every call)."""
    target = "convgrad.cli.bench.examples:replknet_block"
    code, out, err = _run("--model", target, "--input-shape", "2,64,28,28", *QUICK, "--json")
    assert code == 0, err
    r = ModelBench.from_json(out)
    assert [c.module for c in r.calls] == ["0.pw1.0.0", "0.lk.large.0", "0.lk.small.0", "0.pw2.0", "1.pw1.0",
                                           "1.pw2.0"]
    assert [(c.forward, c.gradients) for c in r.calls] == _from_the_store(target, (2, 64, 28, 28))
    assert r.calls[1].gradients == "fft"  # 961 taps per output on 64 channels of one each: fft's case


TIMM = textwrap.dedent("""
    import sys
    sys.path.insert(0, {stubs!r})  # timm is installed without torchvision: the few names it imports
    import timm

    def resnet():
        return timm.create_model("resnet18", num_classes=10)
""")


@pytest.mark.slow
def test_a_timm_model(tuned: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(TESTS / "stubs"))  # as tests/test_timm.py imports it
    if not os.environ.get("CI"):  # .ci/run installs timm: its absence there is a failure, not a skip
        pytest.importorskip("timm")
    (tmp_path / "timm_model.py").write_text(TIMM.format(stubs=str(TESTS / "stubs")))
    target = f"{tmp_path / 'timm_model.py'}:resnet"
    code, out, err = _run("--model", target, "--input-shape", "2,3,32,32", *QUICK, "--json")
    assert code == 0, err
    r = ModelBench.from_json(out)
    assert len(r.calls) == 20 and {c.backend for c in r.calls} == {"auto"}
    assert [(c.forward, c.gradients) for c in r.calls] == _from_the_store(target, (2, 3, 32, 32))
    sys.modules.pop("_convgrad_model_timm_model", None)


# ---- the run the docs show ------------------------------------------------------------------------------------------

def _page_blocks() -> tuple[Any, list[str]]:
    from helpers import load_script

    bench_page = load_script("bench_page", TESTS.parent / "docs" / "bench_page.py")
    bodies = []
    for page in bench_page.MODEL_PAGES:
        found = bench_page.MODEL_BLOCK.search(page.read_text())
        assert found is not None, page
        bodies.append(found.string[found.end(1):found.start(2)])
    return bench_page, bodies


def test_the_pages_show_the_kept_run_as_the_command_prints_it() -> None:
    """docs/cli/bench.md and the how-to show docs/bench_model_run.json as `convgrad bench --model` prints it
    (`python docs/bench_page.py --model RUN.json` writes both); a run with another figure would show otherwise."""
    bench_page, bodies = _page_blocks()
    text = bench_page.MODEL_RUN.read_text()
    block = bench_page.model_block(text)
    assert bodies == [block] * len(bench_page.MODEL_PAGES)
    r = ModelBench.from_json(text)
    assert f"speed-up of the step: {r.speedup:.2f}" in block and r.settings["command"].startswith("convgrad bench")
    other = json.loads(text)
    other["plain"]["steps"] = [t * 2 for t in other["plain"]["steps"]]
    assert bench_page.model_block(json.dumps(other)) not in bodies


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"dtype": "int64"}, "--dtype='int64' must name a floating dtype"),
    ({"dtype": "float31"}, "--dtype='float31' must name a floating dtype"),
    ({"optimizer": "lbfgs"}, "--optimizer='lbfgs' must be one of none, sgd, adamw"),
    ({"min_time": -1.0}, "--min-time=-1.0 must be at least 0"),
    ({"warmup": -1}, "bench: warmup=-1 must be at least 0"),
])
def test_bench_model_refuses_bad_arguments_by_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench_model("convgrad.cli.check:example_model", (2, 3, 16, 16), **kwargs)
