"""The autotuned "auto" backend: fixed mode is native, tuning picks an agreeing candidate once and remembers it.

The rest of the suite runs "auto" in fixed mode (conftest.py); these tests switch tuning on for a
few small configurations.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad.backends import _REGISTRY, Backend, auto, auto_tuning, get_backend
from convgrad.spec import ConvSpec
from helpers import Case, assert_matches_autograd, make_tensors, reference_grads

CASES = [Case((2, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1, name="s2"),
         Case((2, 4, 8), (4, 2, 1), groups=2, name="1d-1x1-groups"),
         Case((2, 4, 5, 5), (4, 2, 2, 2), stride=2, transposed=True, name="T-2x2s2")]


@pytest.fixture
def tune() -> Iterator[None]:
    """Tuning on, with nothing remembered before or after."""
    auto.clear()
    with auto.tuning_mode("tune"):
        yield
    auto.clear()


Tunings = list[tuple[Any, ...]]  # the arguments of each call of auto._tune


@pytest.fixture
def tunings(monkeypatch: pytest.MonkeyPatch) -> Tunings:
    """The arguments of every tuning from here on (each still runs)."""
    seen: list[tuple[Any, ...]] = []
    real = auto._tune
    monkeypatch.setattr(auto, "_tune", lambda *a: seen.append(a) or real(*a))
    return seen


def _grads(case: Case, t: dict[str, torch.Tensor], backend: str = "auto") -> dict[str, torch.Tensor | None]:
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, case.stride, case.padding,
                                 case.dilation, case.transposed, case.output_padding, case.groups,
                                 output_mask=(True, True, False), backend=backend)
    return {"grad_input": gi, "grad_weight": gw}


def test_fixed_mode_is_bitwise_native() -> None:
    case = CASES[0]
    t = make_tensors(case, torch.float32)
    with auto.tuning_mode("fixed"):
        ours = _grads(case, t)
    for name, value in _grads(case, t, "native").items():
        assert torch.equal(ours[name], value)
    assert auto.chosen(case.spec(), "grad_input", t["grad_output"]) is None  # fixed mode remembers nothing


@pytest.mark.parametrize("case", CASES, ids=str)
def test_tuning_chooses_once_per_gradient_and_matches_autograd(tune: None, tunings: Tunings, case: Case) -> None:
    t = make_tensors(case)
    served = {b.name for b in auto._candidates(case.spec(), t["grad_output"])}  # those whose can_serve rule holds
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert len(tunings) == 3  # grad_input and grad_weight separately, then both: split or one fused call
    for gradient in ("grad_input", "grad_weight"):
        choice = auto.chosen(case.spec(), gradient, t["grad_output"])
        assert choice is not None and choice.backend in auto.CANDIDATES and not choice.rejected
        assert set(choice.times) == served
    both = auto.chosen(case.spec(), "both", t["grad_output"])
    assert both is not None and both.backend in ("split", *auto.CANDIDATES)
    split = auto.chosen(case.spec(), "grad_input", t["grad_output"]).backend != auto.chosen(  # type: ignore[union-attr]
        case.spec(), "grad_weight", t["grad_output"]).backend  # type: ignore[union-attr]
    assert set(both.times) == {*served, *(["split"] if split else [])}
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert len(tunings) == 3  # remembered
    assert auto.chosen(case.spec(), "grad_input", t["grad_output"].float()) is None  # per dtype


class _Wrong(Backend):
    """Fast and wrong: zeros (and it claims to share work between the two gradients)."""

    name = "wrong"

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.new_zeros(spec.input_shape)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output.new_zeros(spec.weight_shape)

    def backward(self, spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
        return self.input_grad(spec, weight, grad_output), self.weight_grad(spec, input, grad_output)


def test_a_candidate_that_disagrees_with_native_is_never_chosen(tune: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(_REGISTRY, "wrong", _Wrong())
    monkeypatch.setattr(auto, "CANDIDATES", ("wrong", "native"))
    case = CASES[0]
    t = make_tensors(case)
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    for gradient in ("grad_input", "grad_weight", "both"):
        choice = auto.chosen(case.spec(), gradient, t["grad_output"])
        assert choice is not None and choice.backend != "wrong" and choice.rejected == ("wrong",), gradient


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
def test_native_is_kept_unless_another_option_clearly_beats_it(times: dict[str, float], winner: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_tuning, "_rounds", lambda options, device: {n: [times[n], 2 * times[n]] for n in options})
    x = torch.ones(3)
    choice, out = auto._tune({n: (lambda: x) for n in times}, x.device)
    assert choice.backend == winner and choice.times == pytest.approx({n: 1.5 * t for n, t in times.items()})
    assert out is x
    assert (auto.PREFER_NATIVE, auto.SPLIT_MARGIN) == (1.03, 1.05)


@pytest.mark.parametrize(("ratios", "incumbent", "winner"), [
    ({"native": 1.00, "fwdconv": 1.02, "gemm": 1.20}, "fwdconv", "fwdconv"),  # native 2% faster: within the noise
    ({"native": 1.00, "fwdconv": 1.04, "gemm": 1.20}, "fwdconv", "native"),
    ({"native": 1.00, "fwdconv": 1.01, "gemm": 1.20}, "native", "native"),
    ({"native": 1.00, "gemm": 1.20}, "fwdconv", "native"),  # an incumbent that was not timed: native
])
def test_for_both_gradients_the_backend_that_won_each_is_the_incumbent(ratios: dict[str, float], incumbent: str,
                                                                     winner: str) -> None:
    assert auto_tuning._winner(ratios, incumbent) == winner


@pytest.mark.parametrize(("gi", "gw", "incumbent"), [("fwdconv", "fwdconv", "fwdconv"), ("gemm", "fwdconv", "native")])
def test_both_gradients_are_tuned_with_the_common_winner_as_incumbent(tune: None, tunings: Tunings, gi: str, gw: str,
                                                                     incumbent: str) -> None:
    case = CASES[0]
    t = make_tensors(case)
    for gradient, backend in (("grad_input", gi), ("grad_weight", gw)):  # as if tuned already
        auto._choices[auto._key(case.spec(), gradient, t["grad_output"])] = auto.Choice(backend, {backend: 1.0})
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert [a[3] for a in tunings] == [incumbent]


def test_each_timed_call_follows_a_warm_up_call_of_the_same_option() -> None:
    calls: list[str] = []
    options = {n: (lambda n=n: calls.append(n)) for n in ("native", "fwdconv", "gemm")}
    samples = auto_tuning._rounds(options, torch.device("cpu"))  # type: ignore[arg-type]
    assert all(auto_tuning._MIN_ROUNDS <= len(s) <= len(samples["native"]) for s in samples.values())
    assert len(calls) == 2 * sum(map(len, samples.values())) and all(a == b for a, b in zip(calls[::2], calls[1::2]))


@pytest.mark.parametrize(("seconds", "rounds"), [
    ({"native": 1e-3, "fwdconv": 2e-3, "gemm": 3e-3}, (3, 3, 3)),  # a clear call stops at _MIN_ROUNDS
    ({"native": 1e-3, "fwdconv": 1.05e-3, "gemm": 3e-3}, (15, 15, 3)),  # close and cheap: _MAX_ROUNDS, gemm dropped
    ({"native": 0.05, "fwdconv": 0.052, "gemm": 0.2}, (7, 7, 3)),  # over _TIME_BUDGET_S: _CLOSE_ROUNDS
    ({"native": 0.1, "fwdconv": 0.1, "gemm": 0.2}, (5, 5, 3)),  # stopped by _CLOSE_BUDGET_S (3.2 s after round 5)
])
def test_close_calls_get_more_rounds_among_the_options_still_in_them(seconds: dict[str, float],
                                                                      rounds: tuple[int, int, int],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto_tuning, "_timed", lambda option, device: (None, seconds[option()]))
    options = {n: (lambda n=n: n) for n in seconds}
    samples = auto_tuning._rounds(options, torch.device("cpu"))  # type: ignore[arg-type]
    assert tuple(len(samples[n]) for n in ("native", "fwdconv", "gemm")) == rounds
    assert auto_tuning._winner(auto_tuning._paired(samples)) == "native"  # fwdconv is not 3% faster in any case


def _slower_than_tuned(key: Any, factor: float) -> None:
    """Pretend that the choice was tuned at 1/factor of its real time."""
    choice = auto._choices[key]
    auto._choices[key] = dataclasses.replace(choice, times={n: t / factor for n, t in choice.times.items()})


def test_a_choice_that_slows_down_is_tuned_again_at_most_twice(tune: None, tunings: Tunings,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "_DRIFT_MIN_S", 0.0)  # watch this tiny layer too
    case = CASES[0]
    t = make_tensors(case)

    def grad_input() -> torch.Tensor:
        return cg.conv_input_grad(t["input"].shape, t["weight"], t["grad_output"], case.stride, case.padding)

    ref = grad_input()
    key = auto._key(case.spec(), "grad_input", t["grad_output"])
    for before, after in ((1, 2), (2, 3), (3, 3)):  # the third slowdown is not watched any more: _MAX_RETUNES
        _slower_than_tuned(key, 1e6)
        for _ in range(auto._DRIFT_CALLS):
            torch.testing.assert_close(grad_input(), ref)
        assert len(tunings) == before
        torch.testing.assert_close(grad_input(), ref)
        assert len(tunings) == after


def test_a_choice_that_keeps_its_speed_is_not_tuned_again(tune: None, tunings: Tunings,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auto, "_DRIFT_MIN_S", 0.0)
    case = CASES[2]
    t = make_tensors(case)
    _grads(case, t)
    assert len(tunings) == 3
    for gradient in ("grad_input", "grad_weight", "both"):
        _slower_than_tuned(auto._key(case.spec(), gradient, t["grad_output"]), 1e-6)  # tuned 1e6 times slower
    for _ in range(2 * auto._DRIFT_CALLS):
        assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert len(tunings) == 3


def test_batches_up_to_the_next_power_of_two_share_one_tuning(tune: None, tunings: Tunings) -> None:
    assert [auto.batch_bucket(n) for n in (0, 1, 2, 3, 4, 5, 300, 512, 513)] == [0, 1, 2, 4, 4, 8, 512, 512, 1024]
    for batch in (3, 4, 3, 5):  # Poisson-sampled batches: 3 and 4 share the bucket 4; 5 is in the bucket 8
        case = Case((batch, 3, 9, 9), (4, 3, 3, 3), stride=2, padding=1, name=f"n{batch}")
        t = make_tensors(case)
        assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert len(tunings) == 6  # grad_input, grad_weight and both, for the buckets 4 and 8


def test_no_tuning_under_batched_grads(tune: None) -> None:
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


def test_double_backward_while_tuning(tune: None) -> None:
    x = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 1, 3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda x, w: cg.conv2d(x, w, stride=2, backend="auto"), (x, w))


def test_winners_persist_to_the_cache_file_and_load_back(tune: None, tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[1]
    t = make_tensors(case)
    _grads(case, t)
    data = json.loads(path.read_text())
    assert data["torch"] == torch.__version__ and len(data["choices"]) == 3  # grad_input, grad_weight, both
    assert all(entry["backend"] in (*auto.CANDIDATES, "split") for entry in data["choices"].values())
    auto.clear()
    monkeypatch.setattr(auto, "_tune", lambda *a: pytest.fail("tuned although the cache file has the winner"))
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))


@pytest.mark.parametrize("field", ["batch", "times", "rejected"])
def test_a_malformed_cache_entry_is_ignored_and_tuned_again(tune: None, tunings: Tunings, tmp_path: Any, field: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    case = CASES[1]
    t = make_tensors(case)
    _grads(case, t)
    data = json.loads(path.read_text())
    for entry in data["choices"].values():
        entry[field] = None
    path.write_text(json.dumps(data))
    auto.clear()
    tunings.clear()  # count from here
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.float64, str(case))
    assert len(tunings) == 3


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
    monkeypatch.setattr(auto, "_mode", None)
    monkeypatch.setenv("CONVGRAD_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="CONVGRAD_AUTOTUNE='sometimes'"):
        auto.get_mode()
    monkeypatch.setenv("CONVGRAD_AUTOTUNE", "fixed")
    assert auto.get_mode() == "fixed"


def test_complex_tensors_tune_only_among_complex_backends(tune: None) -> None:
    case = CASES[0]
    t = {k: v.to(torch.complex128) for k, v in make_tensors(case).items()}
    assert_matches_autograd(_grads(case, t), reference_grads(case, t), torch.complex128, str(case))
    choice = auto.chosen(case.spec(), "grad_input", t["grad_output"])
    assert choice is not None and all(get_backend(n).supports_complex for n in choice.times)
