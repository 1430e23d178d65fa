"""The autotuned "auto" backend: fixed mode is native; tuning screens the candidates on a slice of the batch,
settles the survivors on the calls that follow, and remembers the winner.

The rest of the suite runs "auto" in fixed mode (conftest.py); these tests switch tuning on for a
few small configurations.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import pkgutil
import sys
from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad import backends as backends_package
from convgrad import tuning
from convgrad.backends import _REGISTRY, Backend, auto, get_backend
from convgrad.cli import bench
from convgrad.spec import ConvSpec
from convgrad.tuning import modes, settle, store, tuner
from helpers import Case, assert_matches_autograd, make_tensors, reference_grads

CASES = [Case((2, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1, name="s2"),
         Case((2, 4, 8), (4, 2, 1), groups=2, name="1d-1x1-groups"),
         Case((2, 4, 5, 5), (4, 2, 2, 2), stride=2, transposed=True, name="T-2x2s2")]
GRADIENTS = ("grad_input", "grad_weight", "both")


Tunings = list[str]  # the gradient of each tuning: grad_input, grad_weight (auto._tune) or both (auto._tune_both)


@pytest.fixture
def tunings(monkeypatch: pytest.MonkeyPatch) -> Tunings:
    """The gradient of every tuning from here on (each still runs)."""
    seen: Tunings = []
    real, real_both = auto._tune, auto._tune_both

    def one(options: Any, *a: Any, **k: Any) -> Any:
        seen.append("one")
        return real(options, *a, **k)

    monkeypatch.setattr(auto, "_tune", one)
    monkeypatch.setattr(auto, "_tune_both", lambda *a: seen.append("both") or real_both(*a))
    return seen


def _grads(case: Case, t: dict[str, torch.Tensor], backend: str = "auto") -> dict[str, torch.Tensor | None]:
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, case.stride, case.padding,
                                 case.dilation, case.transposed, case.output_padding, case.groups,
                                 output_mask=(True, True, False), backend=backend)
    return {"grad_input": gi, "grad_weight": gw}


def _one(case: Case, t: dict[str, torch.Tensor], gradient: str) -> torch.Tensor:
    """One gradient alone through auto (the other is not asked for)."""
    mask = (gradient == "grad_input", gradient == "grad_weight", False)
    out = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, case.stride, case.padding, case.dilation,
                           case.transposed, case.output_padding, case.groups, output_mask=mask, backend="auto")
    return out[0] if gradient == "grad_input" else out[1]


def _settle(case: Case, t: dict[str, torch.Tensor], gradient: str = "both") -> int:
    """Call auto until its choice for the gradient is settled, checking every result; returns the calls made."""
    ref = reference_grads(case, t)
    for calls in range(1, 200):
        if gradient == "both":
            assert_matches_autograd(_grads(case, t), ref, torch.float64, str(case))
        else:
            torch.testing.assert_close(_one(case, t, gradient), ref[gradient], rtol=1e-7, atol=1e-9)
        choice = auto.chosen(case.spec(), gradient, t["grad_output"])
        if choice is not None and not choice.pending:
            return calls
    raise AssertionError(f"{case}: {gradient} did not settle in 200 calls")


def test_fixed_mode_is_bitwise_native() -> None:
    case = CASES[0]
    t = make_tensors(case, torch.float32)
    with auto.tuning_mode("fixed"):
        ours = _grads(case, t)
    for name, value in _grads(case, t, "native").items():
        assert torch.equal(ours[name], value)
    assert auto.chosen(case.spec(), "grad_input", t["grad_output"]) is None  # fixed mode remembers nothing


@pytest.mark.parametrize("case", CASES, ids=str)
def test_both_gradients_are_tuned_once_settled_and_remembered(tuned: None, tunings: Tunings, case: Case) -> None:
    t = make_tensors(case)
    _settle(case, t)
    assert tunings == ["both"]  # one tuning for both gradients, none per gradient
    both = auto.chosen(case.spec(), "both", t["grad_output"])
    racing = [b.name for b in auto.candidates(case.spec(), t["grad_output"])]
    assert both is not None and both.backend in ("split", *racing) and not both.rejected
    assert set(both.times) <= {*racing, "split"} and "native" in both.times
    # parts name the two halves exactly when "split" was an option (the best grad_input and grad_weight differ)
    assert ("split" in both.times) == (len(both.parts) == 2) and len(both.parts) in (0, 2)
    assert both.backend != "split" or "split" in both.times
    assert not both.parts or (both.parts[0] != both.parts[1] and set(both.parts) <= set(racing))
    for _ in range(3):
        assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert tunings == ["both"]  # remembered
    assert auto.chosen(case.spec(), "both", t["grad_output"].float()) is None  # per dtype


@pytest.mark.parametrize("gradient", ["grad_input", "grad_weight"])
def test_one_gradient_alone_is_tuned_on_its_own(tuned: None, tunings: Tunings, gradient: str) -> None:
    case = CASES[0]
    t = make_tensors(case)
    _settle(case, t, gradient)
    choice = auto.chosen(case.spec(), gradient, t["grad_output"])
    racing = [b.name for b in auto.candidates(case.spec(), t["grad_output"])]
    assert tunings == ["one"] and choice is not None and choice.backend in racing
    assert set(choice.times) <= set(racing)


class _Wrong(Backend):
    """Fast and wrong: zeros (and it claims to share work between the two gradients)."""

    name = "wrong"

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.new_zeros(spec.input_shape)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.new_zeros(spec.weight_shape)

    def backward(self, spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
        return self.input_grad(spec, weight, grad_output), self.weight_grad(spec, input, grad_output)


def test_a_candidate_that_disagrees_with_native_is_never_chosen(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_REGISTRY, "wrong", _Wrong())  # registered: raced
    case = CASES[0]
    t = make_tensors(case)
    for gradient in GRADIENTS:
        _settle(case, t, gradient)
        choice = auto.chosen(case.spec(), gradient, t["grad_output"])
        assert choice is not None and choice.backend != "wrong" and "wrong" in choice.rejected, gradient
        assert "wrong" not in choice.times and "wrong" not in choice.pending


class _Counting(Backend):
    """native's results, counting the batch size of every call."""

    name = "counting"

    def __init__(self) -> None:
        self.seen: list[int] = []

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        self.seen.append(spec.batch)
        return get_backend("native").input_grad(spec, weight, grad_output)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        self.seen.append(spec.batch)
        return get_backend("native").weight_grad(spec, input, grad_output)


def test_the_first_call_runs_the_candidates_on_a_slice_of_the_batch_only(tuned: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    counting = _Counting()
    monkeypatch.setitem(_REGISTRY, "counting", counting)
    case = Case((32, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1, name="n32")
    t = make_tensors(case)
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    # its grad_input and grad_weight screened (a probe and a timed call each) on 4 of the 32 samples; at most one
    # call on the whole batch: the real result, when it was the fastest screened
    sliced = [n for n in counting.seen if n == tuner.screen_batch(32)]
    assert tuner.screen_batch(32) == 4 and len(sliced) >= 4
    assert set(counting.seen) <= {4, 32} and counting.seen.count(32) <= 2  # one call computes both: 2 gradients


def test_layers_of_one_shape_share_one_tuning(tuned: None, tunings: Tunings) -> None:
    def model(layers: int) -> torch.nn.Module:
        convs = [torch.nn.Conv2d(4, 4, 3, padding=1, dtype=torch.float64) for _ in range(layers)]
        return cg.patch(torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1, dtype=torch.float64), *convs))

    x = torch.randn(8, 3, 6, 6, dtype=torch.float64)
    counts = []
    for layers in (1, 4):
        auto.clear()
        tunings.clear()
        model(layers)(x).sum().backward()
        counts.append(len(tunings))
    assert counts == [2, 2]  # the first conv (grad_weight alone) and the shared shape (both), for 1 and 4 layers


@pytest.mark.parametrize(("times", "winner"), [
    ({"native": 1.00, "fwdconv": 0.98, "gemm": 1.20}, "native"),  # 2% faster: within the noise of one tuning
    ({"native": 1.00, "fwdconv": 0.96, "gemm": 0.99}, "fwdconv"),  # 4% faster: a real win
    ({"native": 1.00, "fwdconv": 1.01, "gemm": 0.90}, "gemm"),
    ({"native": 1.00, "fwdconv": 0.99, "gemm": 1.20, "split": 0.98}, "native"),  # split too: within the noise
    ({"native": 1.00, "fwdconv": 0.90, "gemm": 1.20, "split": 0.86}, "fwdconv"),  # split must beat fwdconv by 5%
    ({"native": 1.00, "fwdconv": 0.90, "gemm": 1.20, "split": 0.85}, "split"),
    ({"native": 1.00, "fwdconv": 1.10, "gemm": 1.20, "split": 0.90}, "split"),
    ({"native": 1.00, "fwdconv": 0.99, "gemm": 1.20, "split": 0.95}, "native"),  # split: 4% under fwdconv
    ({"native": 1.00, "fwdconv": 0.975, "gemm": 1.20, "split": 0.96}, "native"),
])
def test_native_is_kept_unless_another_option_clearly_beats_it(times: dict[str, float], winner: str) -> None:
    assert settle.pick(times) == winner
    assert (auto.PREFER_NATIVE, auto.SPLIT_MARGIN) == (1.03, 1.05)
    explore = tuner.Exploration(tuple(times))  # native, the anchor, first
    settled = None
    while settled is None:
        name, timed = explore.next()
        if timed:
            settled = explore.record(name, times[name])
        else:
            explore.skip()
    assert settled == winner


@pytest.mark.parametrize(("ratios", "incumbent", "winner"), [
    ({"native": 1.00, "fwdconv": 1.02, "gemm": 1.20}, "fwdconv", "fwdconv"),  # native 2% faster: within the noise
    ({"native": 1.00, "fwdconv": 1.04, "gemm": 1.20}, "fwdconv", "native"),
    ({"native": 1.00, "fwdconv": 1.01, "gemm": 1.20}, "native", "native"),
    ({"native": 1.00, "gemm": 1.20}, "fwdconv", "native"),  # an incumbent that was not timed: the fastest
])
def test_for_both_gradients_the_backend_that_won_each_is_the_incumbent(ratios: dict[str, float], incumbent: str,
                                                                     winner: str) -> None:
    assert settle.pick(ratios, incumbent) == winner


@pytest.mark.parametrize(("gi", "gw", "anchor"), [
    ({"native": 2.0, "fwdconv": 1.0, "gemm": 3.0}, {"native": 2.0, "fwdconv": 1.0, "gemm": 3.0}, "fwdconv"),
    ({"native": 2.0, "fwdconv": 3.0, "gemm": 1.0}, {"native": 2.0, "fwdconv": 1.0, "gemm": 3.0}, "native"),
])
def test_both_gradients_are_settled_with_the_common_fastest_as_anchor(tuned: None, monkeypatch: pytest.MonkeyPatch,
                                                                      gi: dict[str, float], gw: dict[str, float],
                                                                      anchor: str) -> None:
    screens = iter([tuner.Screen(gi), tuner.Screen(gw), tuner.Screen({"native": 3.5})])
    monkeypatch.setattr(tuning, "screen", lambda *a, **k: next(screens))
    case = CASES[0]
    t = make_tensors(case)
    choice = auto._tune_both(case.spec(), t["grad_output"], t["input"], t["weight"])
    assert choice.pending[0] == anchor
    split = min(gi, key=gi.__getitem__) != min(gw, key=gw.__getitem__)
    assert ("split" in choice.times) == split and choice.parts == (("gemm", "fwdconv") if split else ())


def test_screening_drops_far_behind_options_after_timing_them_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    seconds = {"native": 1.0, "fwdconv": 1.9, "gemm": 2.1}
    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(tuner, "timed", lambda option, device: (option(), seconds[calls[-1][0]]))
    options = {n: (lambda m, n=n: calls.append((n, m)) or torch.zeros(1)) for n in seconds}
    seen = tuner.screen(options, 32, torch.device("cpu"), "native", agree=lambda a, b: True)
    assert seen.batch == 4 and all(m == 4 for _, m in calls)  # the slice only
    assert seen.times == pytest.approx({n: 8 * s for n, s in seconds.items()})  # scaled to the whole batch
    assert [n for n, _ in calls].count("gemm") == 3 and [n for n, _ in calls].count("fwdconv") == 2  # gemm again
    choice = tuner.decide(32, seen.times, "native")
    assert choice.backend == "native" and choice.pending == ("native", "fwdconv")  # gemm is over 2x native


def test_native_is_never_dropped_by_the_screening(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice can misrank: native stays among the options settled on the whole batch, however slow it screened."""
    seconds = {"native": 3.0, "fwdconv": 1.0, "gemm": 2.5}
    options = {n: (lambda m: torch.zeros(1)) for n in seconds}
    monkeypatch.setattr(tuner, "screen", lambda *a, **k: tuner.Screen(
        {n: 8 * t for n, t in seconds.items()}, (), {}, 4))
    choice, out = tuner.tune(options, 32, torch.device("cpu"))
    assert choice.backend == "fwdconv" and choice.pending == ("native", "fwdconv") and out is None  # gemm: 2.5x


def test_a_cost_model_prunes_options_before_any_call() -> None:
    called: list[str] = []
    options = {n: (lambda m, n=n: called.append(n) or torch.ones(1)) for n in ("ghost", "unfold", "conv")}
    choice, _ = tuner.tune(options, 8, torch.device("cpu"), reference="unfold",
                                 estimates={"ghost": 45.0, "unfold": 10.0, "conv": 30.0})
    assert "ghost" not in called and set(called) == {"unfold", "conv"} and "ghost" not in choice.times


def test_each_timed_call_follows_a_warm_up_call_of_the_same_option() -> None:
    explore = tuner.Exploration(("native", "fwdconv", "gemm"))
    calls: list[tuple[str, bool]] = []
    while len(calls) < 12:
        name, timed = explore.next()
        calls.append((name, timed))
        if timed:
            assert explore.record(name, 1.0) is None or len(calls) == 12
        else:
            explore.skip()
    assert all(a[0] == b[0] and not a[1] and b[1] for a, b in zip(calls[::2], calls[1::2]))
    assert {c[0] for c in calls[:6]} == {"native", "fwdconv", "gemm"}  # a round runs each option


def test_an_option_still_warming_up_is_timed_again_until_it_is_warm(monkeypatch: pytest.MonkeyPatch) -> None:
    """fft's first calls on a new shape ran 8x and 4x its steady time (UniRepLKNet 13x13, a fresh process): timed on
    its second call, it lost both the screening and the first round on the whole batch to options 4x slower."""
    calls: dict[tuple[str, int], int] = {}
    cost: list[float] = []
    steady, warming = {"native": 1.0, "fast": 0.25}, {"fast": (8.0, 4.0)}

    def option(name: str) -> tuner.Run:
        def run(m: int) -> torch.Tensor:
            k = calls[name, m] = calls.get((name, m), 0) + 1
            slow = warming.get(name, ())
            cost.append(m * (slow[k - 1] if k <= len(slow) else steady[name]))
            return torch.zeros(1)
        return run

    fake = lambda f, device: (f(), cost[-1])  # noqa: E731
    monkeypatch.setattr(tuner, "timed", fake)
    monkeypatch.setattr(store, "timed", fake)
    monkeypatch.setattr(store, "_STORES", [])
    options = {n: option(n) for n in steady}
    choice, _ = tuner.tune(options, 32, torch.device("cpu"), agree=lambda a, b: True)
    assert choice.times["fast"] == pytest.approx(0.25 * 32) and choice.pending == ("native", "fast")
    choices = store.Store(str, lambda c: True)
    while choice.pending:
        choices.run("k", choice, 32, torch.device("cpu"), lambda name: lambda: options[name](32))
        choice = choices.get("k", choice)
    assert choice.backend == "fast"
    assert calls["fast", 32] == 2 + tuner.WARM_CALLS  # the untimed call, the timed one, WARM_CALLS more


@pytest.mark.parametrize(("seconds", "rounds"), [
    ({"native": 1.0, "fwdconv": 1.5, "gemm": 3.0}, (1, 1, 1)),  # far behind after one round: settled
    ({"native": 1.0, "fwdconv": 1.12, "gemm": 1.4}, (3, 3, 1)),  # a clear call stops at _MIN_ROUNDS
    ({"native": 1.0, "fwdconv": 1.05, "gemm": 1.4}, (7, 7, 1)),  # a close one: _CLOSE_ROUNDS, gemm dropped
])
def test_close_calls_get_more_rounds_among_the_options_still_in_them(seconds: dict[str, float],
                                                                      rounds: tuple[int, int, int]) -> None:
    explore = tuner.Exploration(tuple(seconds))
    settled = None
    while settled is None:
        name, timed = explore.next()
        if timed:
            settled = explore.record(name, seconds[name])
        else:
            explore.skip()
    assert settled == "native"  # fwdconv is not 3% faster in any case
    assert tuple(len(explore.samples[n]) for n in seconds) == rounds


def _slower_than_tuned(key: Any, factor: float) -> None:
    """Pretend that the choice (alone: the other options kept their speed) was tuned at 1/factor of its real time."""
    choice = auto._choices[key]
    times = {n: t / factor if n == choice.backend else t for n, t in choice.times.items()}
    auto._choices[key] = dataclasses.replace(choice, times=times)


def test_a_choice_that_slows_down_is_tuned_again_at_most_twice(tuned: None, tunings: Tunings,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "DRIFT_MIN_S", 0.0)  # watch this tiny layer too
    monkeypatch.setattr(store, "DRIFT", 1e3)  # only the pretended slowdown (1e6), not a busy machine's
    case = CASES[0]
    t = make_tensors(case)
    _settle(case, t, "grad_input")
    key = auto._key(case.spec(), "grad_input", t["grad_output"])
    for before, after in ((1, 2), (2, 3), (3, 3)):  # the third slowdown is not watched any more: _MAX_RETUNES
        _slower_than_tuned(key, 1e6)
        for _ in range(store.DRIFT_CALLS):
            _one(case, t, "grad_input")
        assert len(tunings) == before
        _settle(case, t, "grad_input")
        assert len(tunings) == after


@pytest.mark.parametrize(("native", "kept"), [(12.0, True), (4.0, False)])
def test_a_choice_slowed_down_with_the_anchor_is_kept(monkeypatch: pytest.MonkeyPatch, native: float,
                                                     kept: bool) -> None:
    """Hyena's long conv, settled on fft: on a loaded machine its calls ran over DRIFT times its tuned time (fft's
    many ops wait more than native's one), the drift watch re-tuned (a screening of every option, 140 s) and
    auto's backward ran 2x native's against fft's 26x. Before re-tuning, the anchor is timed once: slowed down as
    much (native 3x too), the choice is kept, its times scaled; slowed alone (native as tuned), it is tuned again."""
    seconds = {"fast": 3.0, "native": native}  # per call of 4 samples; tuned at 1.0 and 4.0
    ran: list[str] = []
    monkeypatch.setattr(store, "timed", lambda f, device: (f(), seconds[ran[-1]]))
    monkeypatch.setattr(store, "_STORES", [])
    choices = store.Store(str, lambda c: True)
    choice = tuner.Choice("fast", {"native": 4.0, "fast": 1.0}, batch=4)
    choices.remember("k", choice)
    for _ in range(store.DRIFT_CALLS):
        choices.run("k", choices.get("k", choice), 4, torch.device("cpu"), lambda n: lambda: ran.append(n))
    assert ran == ["fast"] * store.DRIFT_CALLS + ["native"]
    assert ("k" in choices) == kept and choices.retunes.get("k", 0) == (0 if kept else 1)
    if kept:
        assert choices["k"].backend == "fast" and choices["k"].times == pytest.approx({"native": 12.0, "fast": 3.0})


def test_a_choice_that_keeps_its_speed_is_not_tuned_again(tuned: None, tunings: Tunings,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store, "DRIFT_MIN_S", 0.0)
    case = CASES[2]
    t = make_tensors(case)
    _settle(case, t)
    assert tunings == ["both"]
    _slower_than_tuned(auto._key(case.spec(), "both", t["grad_output"]), 1e-6)  # tuned 1e6 times slower
    for _ in range(2 * store.DRIFT_CALLS):
        assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert tunings == ["both"]


def test_batches_up_to_the_next_power_of_two_share_one_tuning(tuned: None, tunings: Tunings) -> None:
    assert [auto.batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 300, 512, 513)] == [0, 1, 2, 4, 4, 8, 512, 512, 1024]
    for batch in (3, 4, 3, 5):  # Poisson-sampled batches: 3 and 4 share the bucket 4; 5 is in the bucket 8
        case = Case((batch, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1, name=f"n{batch}")
        t = make_tensors(case)
        assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert tunings == ["both", "both"]  # for the buckets 4 and 8


def test_no_tuning_under_batched_grads(tuned: None) -> None:
    """is_grads_batched runs the backward under the legacy vmap, where values cannot be read: native, no tuning."""
    case = CASES[0]
    t = make_tensors(case)
    x = t["input"].requires_grad_()
    y = cg.conv(x, t["weight"], stride=case.stride, padding=case.padding)
    vs = torch.randn(2, *y.shape, dtype=y.dtype)
    ours = torch.autograd.grad(y, x, vs, is_grads_batched=True, retain_graph=True)[0]
    assert auto.chosen(case.spec(), "grad_input", t["grad_output"]) is None
    ref = torch.stack([torch.autograd.grad(y, x, v, retain_graph=True)[0] for v in vs])  # these calls tune
    torch.testing.assert_close(ours, ref, rtol=1e-7, atol=1e-9)


def test_double_backward_while_tuning(tuned: None) -> None:
    x = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w: cg.conv2d(x, w, stride=2, backend="auto"), (x, w))


def test_winners_persist_to_the_cache_file_and_load_back(tuned: None, tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[1]
    t = make_tensors(case)
    _settle(case, t)
    data = json.loads(path.read_text())
    assert data["torch"] == torch.__version__ and data["format"] == store.FORMAT and len(data["choices"]) == 1
    entry = next(iter(data["choices"].values()))
    assert entry["backend"] in (*cg.backends(), "split") and entry["pending"] == []  # settled, then saved again
    auto.clear()
    monkeypatch.setattr(auto, "_tune_both", lambda *a: pytest.fail("tuned although the cache file has the winner"))
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert auto.chosen(case.spec(), "both", t["grad_output"]) == auto.Choice(**{
        **entry, "times": entry["times"], "rejected": tuple(entry["rejected"]), "parts": tuple(entry["parts"]),
        "pending": ()})


def test_a_choice_saved_while_still_compared_goes_on_being_compared(tuned: None, tmp_path: Any,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[0]
    t = make_tensors(case)
    key = auto._key(case.spec(), "both", t["grad_output"])
    pending = auto.Choice("fwdconv", {"native": 1.0, "fwdconv": 0.9}, (), 2, (), ("native", "fwdconv"))
    auto._choices.remember(key, pending)
    auto.clear()
    monkeypatch.setattr(auto, "_tune_both", lambda *a: pytest.fail("tuned although the cache file has the choice"))
    assert _settle(case, t) >= 4  # a round: each of the two options twice in a row
    choice = auto.chosen(case.spec(), "both", t["grad_output"])
    assert choice is not None and choice.backend in ("native", "fwdconv") and not choice.pending
    assert json.loads(path.read_text())["choices"][auto._key_text(key)]["pending"] == []


def test_a_cache_file_of_another_format_is_ignored(tuned: None, tunings: Tunings, tmp_path: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[0]
    t = make_tensors(case)
    key = auto._key_text(auto._key(case.spec(), "both", t["grad_output"]))
    path.write_text(json.dumps({"torch": torch.__version__, "choices": {key: {"backend": "split", "times": {}}}}))
    _grads(case, t)  # format 1 had "split" without its parts: tuned again
    assert tunings == ["both"]


@pytest.mark.parametrize("field", ["batch", "times", "rejected", "parts", "pending"])
def test_a_malformed_cache_entry_is_ignored_and_tuned_again(tuned: None, tunings: Tunings, tmp_path: Any, field: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[1]
    t = make_tensors(case)
    _settle(case, t)
    data = json.loads(path.read_text())
    for entry in data["choices"].values():
        entry[field] = None if field != "pending" else ["no-such-backend"]
    path.write_text(json.dumps(data))
    auto.clear()
    tunings.clear()  # count from here
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert tunings == ["both"]


@pytest.mark.parametrize(("value", "expected"), [("", None), ("0", None), ("off", None), ("1", "default"),
                                                 ("/tmp/x/choices.json", "/tmp/x/choices.json")])
def test_persistence_is_off_by_default_and_on_by_env(value: str, expected: str | None,
                                                     monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", value)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = auto.cache_path()
    if expected is None:
        assert path is None
    elif expected == "default":
        assert path == tmp_path / "convgrad" / "autotune.json"
    else:
        assert str(path) == expected


def test_modes_are_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="mode='fast'"):
        auto.set_mode("fast")
    monkeypatch.setattr(modes, "_mode", None)  # not read from the environment yet
    monkeypatch.setenv("CONVGRAD_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="CONVGRAD_AUTOTUNE='sometimes'"):
        auto.get_mode()
    monkeypatch.setenv("CONVGRAD_AUTOTUNE", "fixed")
    assert auto.get_mode() == "fixed"


def test_complex_tensors_tune_only_among_complex_backends(tuned: None) -> None:
    case = CASES[0]
    t = {k: v.to(torch.complex128) for k, v in make_tensors(case).items()}
    _settle(case, t)
    choice = auto.chosen(case.spec(), "both", t["grad_output"])
    assert choice is not None and all(get_backend(n).supports_complex for n in choice.times if n != "split")
    assert all(get_backend(n).supports_complex for n in choice.parts)


TOY = """
from convgrad.backends import Backend, get_backend, register


@register
class ToyBackend(Backend):
    name = "toy"
    bench_by_default = True

    def can_serve(self, spec, like):
        return spec.groups == 2  # a rule of its own: only grouped layers

    def input_grad(self, spec, weight, grad_output):
        return get_backend("native").input_grad(spec, weight, grad_output)

    def weight_grad(self, spec, input, grad_output):
        return get_backend("native").weight_grad(spec, input, grad_output)
"""


def test_a_backend_in_one_file_with_the_decorator_is_raced_by_auto(tuned: None, tmp_path: Any,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Adding a backend is one file and ``@register``: no list in backends/__init__.py, auto or the bench to edit.
    Auto races it where its ``can_serve`` lets it in, and nowhere else; ``convgrad bench`` times it by default as
    its ``bench_by_default`` says. Mutants: auto's old hand-kept CANDIDATES tuple never raced it; the bench's old
    hand-kept DEFAULT_BACKENDS never timed it."""
    (tmp_path / "toy_backend.py").write_text(TOY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(backends_package, "_REGISTRY", dict(_REGISTRY))  # the toy leaves with the test
    monkeypatch.delitem(sys.modules, "toy_backend", raising=False)
    importlib.import_module("toy_backend")
    assert "toy" in cg.backends()
    assert "toy" in bench.default_backends()
    grouped, plain = CASES[1], CASES[0]  # groups=2, groups=1
    for case, raced in ((grouped, True), (plain, False)):
        t = make_tensors(case)
        assert ("toy" in [b.name for b in auto.candidates(case.spec(), t["grad_output"])]) is raced
        _settle(case, t, "grad_weight")
        choice = auto.chosen(case.spec(), "grad_weight", t["grad_output"])
        assert choice is not None and ("toy" in choice.times or "toy" in choice.rejected) is raced, choice


def test_every_module_of_the_backends_package_is_loaded() -> None:
    """The registry imports the package's modules by discovery (pkgutil), so none is left out."""
    cg.backends()
    names = {m.name for m in pkgutil.iter_modules(backends_package.__path__)}
    assert names and all(f"convgrad.backends.{n}" in sys.modules for n in names), names
