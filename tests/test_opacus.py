"""convgrad.opacus: our conv rules inside Opacus's PrivacyEngine, hooks and ghost modes, float64 against a loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convgrad as cg
from helpers import TOL, assert_matches_autograd, opacus_private_step

opacus = pytest.importorskip("opacus")
from opacus.grad_sample import GradSampleHooks, GradSampleHooksFastGradientClipping  # noqa: E402

import convgrad.opacus as cgo  # noqa: E402

DT = torch.float64
pytestmark = [pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel:UserWarning"),
              pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
              pytest.mark.filterwarnings("ignore:Secure RNG turned off:UserWarning"),
              pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha:UserWarning")]


@pytest.fixture(autouse=True)
def _registered_only_inside_a_test() -> Iterator[None]:
    """Every test starts and ends with Opacus's own registries."""
    cgo.unregister()
    yield
    cgo.unregister()


class Zoo(nn.Module):
    """Every layer where Opacus alone goes wrong or falls back, and the ones where bugs live."""

    def __init__(self) -> None:
        super().__init__()
        self.same = nn.Conv2d(2, 4, (4, 2), padding="same")  # even kernel: asymmetric padding
        self.circular = nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular")
        self.grouped = nn.Conv2d(4, 6, 3, stride=2, groups=2)  # 1 < groups < C_in, rows left unread
        self.depthwise = nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.up = nn.ConvTranspose2d(6, 2, 3, stride=2, padding=1, output_padding=1)
        self.c3 = nn.Conv3d(1, 2, 2, padding=1, stride=(1, 2, 1))
        self.gn = nn.GroupNorm(2, 2)
        self.fc = nn.Linear(2 * 3 * 4 * 7, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 2, 8, 7)
        h = torch.tanh(self.circular(torch.tanh(self.same(x))))  # (N, 4, 8, 7)
        h = torch.tanh(self.depthwise(torch.tanh(self.grouped(h))))  # (N, 6, 3, 3)
        h = self.up(h)  # (N, 2, 6, 6)
        h = self.gn(self.c3(h.unsqueeze(1)))  # (N, 2, 3, 4, 7)
        return self.fc(h.flatten(1))


def _data(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 2, 8, 7, dtype=DT, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _per_sample_loop(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The ground truth: one torch autograd backward per sample."""
    grads: dict[str, list[torch.Tensor]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        for (k, _), g in zip(model.named_parameters(), gs, strict=True):
            grads[k].append(g)
    return {k: torch.stack(v) for k, v in grads.items()}


def _clipped_sum(grads: dict[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # Opacus's factor
    return {k: torch.tensordot(factors, g, dims=1) for k, g in grads.items()}


def _median_norm(grads: dict[str, torch.Tensor]) -> float:
    """A bound that clips about half of the samples."""
    return float(torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).median())


def _private_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, max_norm: float,
                  reduction: str = "sum") -> dict[str, Any]:
    return opacus_private_step(model, x, y, mode, max_norm, reduction)


def _models() -> dict[str, nn.Module]:
    torch.manual_seed(1)
    plain = Zoo().to(DT)
    patched = cg.patch(Zoo().to(DT))  # the classes convgrad.patch gives them
    built = Zoo().to(DT)
    built.circular = cg.nn.Conv2d(4, 4, 3, padding=1, padding_mode="circular").to(DT)
    built.up = cg.nn.ConvTranspose2d(6, 2, 3, stride=2, padding=1, output_padding=1).to(DT)
    return {"torch.nn": plain, "patched": patched, "convgrad.nn": built}


@pytest.mark.parametrize("kind", ["torch.nn", "patched", "convgrad.nn"])
@pytest.mark.parametrize(("mode", "reduction"), [("hooks", "sum"), ("ghost", "sum"), ("hooks", "mean"),
                                                 ("ghost", "mean")])
def test_make_private_with_registered_rules_clips_like_a_per_sample_loop(mode: str, reduction: str,
                                                                         kind: str) -> None:
    model = _models()[kind]
    x, y = _data()
    grads = _per_sample_loop(model, x, y)
    max_norm = _median_norm(grads)
    expected = _clipped_sum(grads, max_norm)
    if reduction == "mean":  # Opacus divides by the expected batch size
        expected = {k: g / x.shape[0] for k, g in expected.items()}
    cgo.register()
    got = _private_step(model, x, y, mode, max_norm, reduction)
    assert got.pop("functorch") == []  # every layer ran a registered rule
    convs = {type(m) for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)}
    assert convs <= set(GradSampleHooksFastGradientClipping.NORM_SAMPLERS)  # ghost mode: norms, no gradients
    assert_matches_autograd(got, expected, DT, f"Opacus {mode} {reduction} + convgrad, {kind}")


def test_opacus_alone_is_wrong_on_circular_padding_and_falls_back_on_conv_transpose() -> None:
    from opacus import GradSampleModule

    torch.manual_seed(2)
    model = Zoo().to(DT)
    x, y = _data()
    grads = _per_sample_loop(model, x, y)
    gsm = GradSampleModule(model, loss_reduction="sum")
    F.cross_entropy(gsm(x), y, reduction="sum").backward()
    err = (model.circular.weight.grad_sample - grads["circular.weight"]).abs().max()
    assert err > 1e-2, "Opacus's conv rule ignores padding_mode"
    assert hasattr(model.up, "ft_compute_sample_grad"), "Opacus has no ConvTranspose rule: functorch runs"
    gsm._close()
    assert not set(GradSampleHooksFastGradientClipping.NORM_SAMPLERS) & {nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d}
    max_norm = _median_norm(grads)
    for mode in ("hooks", "ghost"):
        got = _private_step(model, x, y, mode, max_norm)
        assert got.pop("functorch") == ["up"]
        wrong = max((got[k] - g).abs().max().item() for k, g in _clipped_sum(grads, max_norm).items())
        assert wrong > 1e-3, f"Opacus alone, {mode}"

    cgo.register()
    gsm = GradSampleModule(model, loss_reduction="sum")
    assert not hasattr(model.up, "ft_compute_sample_grad")  # our rule: no functorch fallback
    gsm._close()


class Reused(nn.Module):
    """A conv called twice in the forward (its parameters tied to themselves), and one called once."""

    def __init__(self) -> None:
        super().__init__()
        self.twice = nn.Conv2d(3, 3, 3, padding=1)
        self.once = nn.Conv2d(3, 2, 3, stride=2)
        self.fc = nn.Linear(2 * 2 * 2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 3, 5, 5)
        h = torch.tanh(self.twice(torch.tanh(self.twice(x))))
        return self.fc(torch.tanh(self.once(h)).flatten(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("batch", [1, 4])
def test_ghost_clipping_of_a_conv_called_twice_is_exact(batch: int, reduction: str, dtype: torch.dtype,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: with register(), Opacus's ghost mode raised "Parameter tying is not supported with Ghost
    Clipping" on a conv called twice (convs had a norm sampler now); plain Opacus clips it exactly."""
    torch.manual_seed(19)
    model = Reused().to(dtype)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gen = torch.Generator().manual_seed(batch)
    x, y = torch.randn(batch, 3, 5, 5, dtype=dtype, generator=gen), torch.randint(0, 3, (batch,), generator=gen)
    grads = _per_sample_loop(model, x, y)
    max_norm = 0.5 * float(torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1).min())  # clips all
    expected = {k: g / (batch if reduction == "mean" else 1) for k, g in _clipped_sum(grads, max_norm).items()}
    plain = _private_step(model, x, y, "ghost", max_norm, reduction)
    assert plain.pop("functorch") == []
    assert_matches_autograd(plain, expected, dtype, f"plain Opacus, ghost {reduction}")
    added = []
    monkeypatch.setattr(cgo, "_add_call", lambda p, g, real=cgo._add_call: added.append(p) or real(p, g))
    for mode in ("ghost", "hooks"):
        model.load_state_dict(state)
        cgo.register()
        added.clear()
        got = _private_step(model, x, y, mode, max_norm, reduction)
        assert got.pop("functorch") == []
        assert_matches_autograd(got, expected, dtype, f"Opacus {mode} {reduction} + convgrad")
        if mode == "ghost":  # the reused conv's two calls add up; the conv called once keeps the ghost norm
            assert added == [model.twice.bias, model.twice.weight] * 2, added
        assert not any(hasattr(p, cgo._CALLS_SUM) for p in model.parameters())  # nothing left for the next step


CONVS = [
    ("conv1d-dilation-stride", lambda: nn.Conv1d(3, 4, 3, stride=2, dilation=2, padding=1), (4, 3, 11)),
    ("conv2d-reflect-same-even", lambda: nn.Conv2d(2, 3, (2, 4), padding="same", padding_mode="reflect"),
     (3, 2, 5, 6)),
    ("conv2d-deep-ghost-cheaper", lambda: nn.Conv2d(16, 16, 3, groups=2), (3, 16, 4, 4)),
    ("conv3d-replicate-groups", lambda: nn.Conv3d(4, 2, 2, padding=1, groups=2, padding_mode="replicate"),
     (2, 4, 3, 2, 3)),
    ("T1d-output-padding-dilation", lambda: nn.ConvTranspose1d(2, 4, 3, stride=3, dilation=2, output_padding=2),
     (3, 2, 4)),
    ("T3d-groups", lambda: nn.ConvTranspose3d(4, 2, 2, stride=2, groups=2), (2, 4, 2, 3, 2)),
    ("convgrad.nn-T2d", lambda: cg.nn.ConvTranspose2d(2, 2, 3, stride=2, padding=1), (3, 2, 3, 4)),
    ("batch0", lambda: nn.Conv2d(2, 3, 3), (0, 2, 5, 5)),
    # large kernels: the per-sample race takes fft there (test_large_kernels_run_fft_inside_opacus)
    ("conv2d-depthwise-9x9-large", lambda: nn.Conv2d(3, 3, 9, padding=4, groups=3), (3, 3, 10, 9)),
    ("conv1d-long-groups2", lambda: nn.Conv1d(4, 2, 65, stride=2, padding=32, groups=2), (2, 4, 70)),
    ("T1d-large-output-padding", lambda: nn.ConvTranspose1d(2, 2, 65, stride=2, output_padding=1, groups=2),
     (3, 2, 9)),
]


@pytest.mark.parametrize(("name", "make", "shape"), CONVS, ids=[c[0] for c in CONVS])
@pytest.mark.parametrize("frozen_weight", [False, True])
def test_grad_and_norm_samplers_match_a_loop_per_parameter(name: str, make, shape: tuple[int, ...],
                                                           frozen_weight: bool) -> None:
    torch.manual_seed(3)
    conv = make().to(DT)
    conv.weight.requires_grad_(not frozen_weight)
    x = torch.randn(shape, dtype=DT)
    out = conv(x)
    gy = torch.randn_like(out)
    params = [p for p in conv.parameters() if p.requires_grad]
    loop = [torch.autograd.grad(conv(x[i:i + 1]), params, gy[i:i + 1]) for i in range(shape[0])]
    ref = {p: torch.stack([g[j] for g in loop]) if loop else p.new_zeros(0, *p.shape) for j, p in enumerate(params)}
    grads = cgo.grad_sampler(conv, [x], gy)
    norms = cgo.norm_sampler(conv, [x], gy)
    assert set(grads) == set(norms) == set(params)  # an entry for every trainable parameter, bias included
    for p in params:
        torch.testing.assert_close(grads[p], ref[p], **TOL[DT])
        torch.testing.assert_close(norms[p], ref[p].flatten(1).norm(dim=1), **TOL[DT])


@pytest.mark.parametrize("mode", ["fixed", "tune"])
def test_large_kernels_run_fft_inside_opacus(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Opacus's samplers (hooks and ghost) go through the per-sample race, which takes fft on a large kernel by the
    cost model (fixed) and by timing (tune); a make_private step then clips like the loop."""
    from convgrad.backends import auto
    from convgrad.backends.fft import per_sample as fft

    ran: list[str] = []
    for name in ("weight_grads", "sq_norms"):
        real = getattr(fft, name)
        monkeypatch.setattr(fft, name, lambda *a, real=real, name=name: ran.append(name) or real(*a))
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Conv2d(3, 3, 13, padding=6, groups=3), nn.Tanh(),
                          nn.Flatten(), nn.Linear(3 * 14 * 14, 3)).to(DT)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 2, 14, 14, dtype=DT, generator=gen), torch.randint(0, 3, (4,), generator=gen)
    grads = _per_sample_loop(model, x, y)
    max_norm = _median_norm(grads)
    cgo.register()
    auto.clear()
    with auto.tuning_mode(mode):
        for grad_mode in ("hooks", "ghost"):
            ran.clear()
            got = _private_step(model, x, y, grad_mode, max_norm)
            assert got.pop("functorch") == []
            assert_matches_autograd(got, _clipped_sum(grads, max_norm), DT, f"Opacus {grad_mode} {mode} + fft")
            assert ran, (grad_mode, mode)  # the 13x13 layer's per-sample work ran by fft
    auto.clear()


@pytest.mark.parametrize("ghost", [True, False])
def test_float16_norm_sampler_is_finite_where_the_norm_fits(ghost: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: in float16 a weight norm of about 360 squared to inf in the norm sampler (the ghost norm's Gram
    matrices of an input at 10x scale too), so Opacus clipped that sample to zero. The norms come back in float16,
    finite and close. (A bias that carries the norm: test_per_sample's bias test, through the same rule.)"""
    import copy

    from convgrad.per_sample import rules

    monkeypatch.setattr(rules.ConvLayer, "ghost_cheaper", property(lambda self: ghost))
    conv = nn.Conv2d(8, 16, 3, padding=1).half()
    wide = copy.deepcopy(conv).double()  # the same weights, float64

    def loop(gy: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
        return cgo.grad_sampler(wide, [x.half().double()], gy.half().double())

    g = torch.Generator().manual_seed(18)
    x, gy = torch.randn(4, 8, 8, 8, generator=g) * 10, torch.randn(4, 16, 8, 8, generator=g)
    gy *= 360.0 / float(loop(gy)[wide.weight].flatten(1).norm(dim=1).median())
    wide_grads = loop(gy)
    ref = {p: wide_grads[getattr(wide, k)] for k, p in conv.named_parameters()}
    norms = cgo.norm_sampler(conv, [x.half()], gy.half())
    for p, r in ref.items():
        expected = r.flatten(1).norm(dim=1)
        assert norms[p].dtype == torch.float16 and torch.isfinite(norms[p]).all(), norms[p]
        assert ((norms[p].double() - expected).abs() <= 1e-2 * expected).all(), (norms[p], expected)


def test_the_samplers_leave_no_scratch_buffer_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each sampler call is one layer (``methods.one_layer``): the im2col columns it reused go when it returns."""
    from convgrad.per_sample import methods, rules

    monkeypatch.setattr(rules.tuning, "method_for", lambda *args: "unfold")  # a method that takes the scratch
    taken = []
    scratch = methods.scratch
    monkeypatch.setattr(methods, "scratch", lambda *a, **k: taken.append(1) or scratch(*a, **k))
    conv = nn.Conv2d(3, 4, 3).to(DT)
    x, gy = torch.randn(5, 3, 6, 6, dtype=DT), torch.randn(5, 4, 4, 4, dtype=DT)
    for sampler in (cgo.grad_sampler, cgo.norm_sampler):
        taken.clear()
        with torch.no_grad():  # as in Opacus's backward hooks: the scratch is used outside a graph only
            sampler(conv, [x], gy)
        assert taken and not methods._SCRATCH, sampler.__name__


def test_register_and_unregister_restore_what_was_there() -> None:
    grad, norm = GradSampleHooks.GRAD_SAMPLERS, GradSampleHooksFastGradientClipping.NORM_SAMPLERS
    before = (dict(grad), dict(norm))
    hook = GradSampleHooksFastGradientClipping.capture_activations_hook
    cgo.register()
    cgo.register()  # twice: the entries saved the first time stay the originals
    assert GradSampleHooksFastGradientClipping.capture_activations_hook is cgo._ghost_forward_hook
    for t in (nn.Conv1d, nn.Conv3d, nn.ConvTranspose2d, cg.nn.Conv2d, cg.nn.ConvTranspose3d):
        assert grad[t] is cgo.grad_sampler and norm[t] is cgo.norm_sampler
    assert grad[nn.Linear] is before[0][nn.Linear]  # other layers keep Opacus's rules

    def theirs(*args: object) -> dict:
        return {}

    grad[nn.Conv1d] = theirs  # replaced after register(): unregister leaves it
    cgo.unregister()
    assert grad[nn.Conv1d] is theirs
    del grad[nn.Conv1d]
    grad[nn.Conv1d] = before[0][nn.Conv1d]
    assert (dict(grad), dict(norm)) == before
    assert GradSampleHooksFastGradientClipping.capture_activations_hook is hook
    assert hook.__module__.startswith("opacus."), hook  # Opacus's own, not one a test before left registered
    assert nn.ConvTranspose2d not in grad and nn.Conv2d not in norm  # they had no entry: ours is gone, not kept
    cgo.unregister()  # without register(): nothing changes
    assert (dict(grad), dict(norm)) == before


# ---- examples/dp_sgd_digits.py ------------------------------------------------------------------------------------
def _example() -> object:
    import importlib.util
    from pathlib import Path

    pytest.importorskip("sklearn")
    path = Path(__file__).resolve().parents[1] / "examples" / "dp_sgd_digits.py"
    spec = importlib.util.spec_from_file_location("dp_sgd_digits", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_dp_sgd_example_reports_epsilon_accuracy_and_time_against_a_plain_step(
        capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from opacus.accountants import RDPAccountant

    example = _example()
    assert example.main(["--steps", "3", "--batch-size", "64"]) == 0  # type: ignore[attr-defined]
    out = capsys.readouterr().out
    accountant = RDPAccountant()  # the same (σ, q, steps), accounted here: the example's ε is the accountant's
    for _ in range(3):
        accountant.step(noise_multiplier=2.0, sample_rate=64 / 1347)  # 1347 training images of 1797
    eps = re.search(r"3 steps\): ε = ([\d.]+) at δ = 1e-05; held-out accuracy ([\d.]+) on 450 images "
                    r"\(without privacy: ([\d.]+)\)", out)
    assert eps, out
    assert float(eps[1]) == pytest.approx(accountant.get_epsilon(1e-5), abs=0.006)
    assert 0 <= float(eps[2]) <= 1 and 0 <= float(eps[3]) <= 1
    times = re.search(r"median of 3 paired steps: DP-SGD ([\d.]+) ms, plain ([\d.]+) ms \(([\d.]+)x plain\)", out)
    assert times, out
    assert float(times[3]) == pytest.approx(float(times[1]) / float(times[2]), rel=0.05, abs=0.01)


def test_dp_sgd_example_refuses_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _example().main(["--steps", "0"])  # type: ignore[attr-defined]
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(": error: --steps 0 must be at least 1")
