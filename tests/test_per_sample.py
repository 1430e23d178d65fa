"""Per-sample gradients, norms and clipped sums, float64, against a loop over single samples and torch.func."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

import convgrad as cg
from convgrad.per_sample import methods, rules, session
from convgrad.tuning import Choice
from convgrad.tuning.tuner import PRUNE_ESTIMATE
from helpers import (
    TOL,
    Case,
    assert_matches_autograd,
    assert_per_sample_matches_the_loop,
    layer_case,
    make_tensors,
    reference_forward,
    reference_grads,
)

DT = torch.float64


pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:Using padding=.same. with even kernel:UserWarning")]


# ---- layer level ---------------------------------------------------------------------------------------------------
LAYER_CASES = [
    layer_case("groups2-cin4-cout6", 4, 6, (7, 6), (3, 3), groups=2, stride=2, padding=1),
    layer_case("depthwise", 4, 4, (6, 6), (3, 3), groups=4, padding=1),
    layer_case("depthwise-multiplier-1d", 3, 6, (9,), (3,), groups=3, stride=2),
    layer_case("kernel3x1-padding1x0", 2, 3, (6, 5), (3, 1), padding=(1, 0)),
    layer_case("same-even-kernel", 2, 3, (7, 6), (4, 2), padding="same"),
    layer_case("dilation2-stride2", 2, 4, (9, 8), (3, 3), stride=2, dilation=2, padding=1),
    layer_case("3d-groups2-padding-ge-kernel", 4, 2, (3, 4, 3), (2, 2, 2), groups=2, padding=2, stride=(1, 2, 1)),
    layer_case("asym-padding-leftover", 3, 3, (8, 7), (2, 3), stride=3, padding=((0, 2), (1, 0)), groups=3),
    layer_case("T-output-padding-groups2", 4, 6, (3, 4), (3, 2), transposed=True, stride=2, padding=1,
               output_padding=1, groups=2),
    layer_case("T-dilation3-op2", 2, 3, (3,), (3,), transposed=True, stride=2, dilation=3, output_padding=2),
    layer_case("batch1", 2, 3, (5, 5), (3, 3), batch=1, padding=1),
    layer_case("batch0", 2, 3, (5, 5), (3, 3), batch=0, stride=2),
]


def _loop_reference(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample grad_weight and grad_bias by torch autograd, one sample at a time."""
    n = case.input_shape[0]
    one = dataclasses.replace(case, input_shape=(1, *case.input_shape[1:]))
    grads = [reference_grads(one, {**t, "input": t["input"][i:i + 1], "grad_output": t["grad_output"][i:i + 1]})
             for i in range(n)]
    spec = case.spec()
    if n == 0:
        return {"grad_weight": t["input"].new_zeros(0, *case.weight_shape),
                "grad_bias": t["input"].new_zeros(0, spec.out_channels)}
    return {k: torch.stack([g[k] for g in grads]) for k in ("grad_weight", "grad_bias")}


def _vmap_reference(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-sample grad_weight and grad_bias by torch.func: vmap over grad of <forward(x_n), grad_output_n>."""
    one = dataclasses.replace(case, input_shape=(1, *case.input_shape[1:]))

    def inner(w: torch.Tensor, b: torch.Tensor, x: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        return (reference_forward(one, x.unsqueeze(0), w, b) * gy.unsqueeze(0)).sum()

    gw, gb = vmap(grad(inner, argnums=(0, 1)), in_dims=(None, None, 0, 0))(t["weight"], t["bias"], t["input"],
                                                                          t["grad_output"])
    return {"grad_weight": gw, "grad_bias": gb}


def _kw(case: Case) -> dict[str, object]:
    return dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups,
                transposed=case.transposed, output_padding=case.output_padding)


@pytest.mark.parametrize("case", LAYER_CASES, ids=str)
def test_per_sample_weight_and_bias_grads_match_loop_and_vmap(case: Case) -> None:
    t = make_tensors(case)
    refs = [_loop_reference(case, t)] + ([_vmap_reference(case, t)] if case.input_shape[0] else [])
    for method in ("unfold", "conv", "native", "fft", "auto"):
        ours = {"grad_weight": cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"],
                                                         method=method, **_kw(case)),
                "grad_bias": cg.per_sample_bias_grad(t["grad_output"])}
        for ref, source in zip(refs, ("loop", "vmap"), strict=False):
            assert_matches_autograd(ours, ref, DT, f"{case} method={method} vs {source}")


@pytest.mark.parametrize("case", LAYER_CASES, ids=str)
def test_per_sample_grad_norms_match_loop_for_every_method(case: Case) -> None:
    t = make_tensors(case)
    ref = _loop_reference(case, t)
    expected = torch.cat([ref["grad_weight"].flatten(1), ref["grad_bias"]], 1).norm(dim=1)
    no_bias = ref["grad_weight"].flatten(1).norm(dim=1)
    for method in ("ghost", "unfold", "conv", "native", "fft", "auto"):
        got = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], method=method, **_kw(case))
        torch.testing.assert_close(got, expected, **TOL[DT], msg=lambda m, k=method: f"{case} {k}: {m}")
        got = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, method=method,
                                       **_kw(case))
        torch.testing.assert_close(got, no_bias, **TOL[DT], msg=lambda m, k=method: f"{case} {k} no bias: {m}")


# gradcheck's fast mode (one random direction) in the fast tier; the full Jacobian, 1,080 inputs, in the slow tier.
GRADCHECK_MODES = [pytest.param(True, id="fast_mode"), pytest.param(False, id="full", marks=pytest.mark.slow)]


@pytest.mark.parametrize("fast_mode", GRADCHECK_MODES)
@pytest.mark.parametrize("method", ["unfold", "conv", "native", "fft"])
def test_per_sample_weight_grad_in_a_graph_and_under_vmap(method: str, fast_mode: bool) -> None:
    """Inputs that require grad give a differentiable result (gradcheck), and vmap batches it. Before, "unfold"
    raised torch's "bmm(): functions with out=... don't support automatic differentiation" in the first case and
    "Batching rule not implemented for aten::bmm.out" in the second."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 4, 6, 6, generator=g, dtype=DT, requires_grad=True)
    gy = torch.randn(3, 6, 6, 6, generator=g, dtype=DT, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cg.per_sample_weight_grad(a, (6, 2, 3, 3), b, padding=1, groups=2, method=method)

    assert torch.autograd.gradcheck(f, (x, gy), fast_mode=fast_mode)
    xs, gys = torch.stack([x.detach(), -x.detach()]), torch.stack([gy.detach(), 2 * gy.detach()])  # (2, N, ...)
    batched = torch.func.vmap(f)(xs, gys)
    torch.testing.assert_close(batched, torch.stack([f(a, b) for a, b in zip(xs, gys, strict=True)]))


@pytest.mark.parametrize("case", [c for c in LAYER_CASES if c.input_shape[0] > 1], ids=str)
def test_every_method_in_chunks_of_two_samples_matches_the_loop(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of the batch (``methods.layer_chunks``) cut each method's work; chunks of two samples of a batch of
    three cross a boundary and keep an order within. The spy shows that "native" ran per chunk."""
    calls = []
    native_call = methods._native_call
    monkeypatch.setattr(methods, "layer_chunks", lambda spec, per_sample, sides=1.0: methods.sample_chunks(
        spec.batch, per_sample, 2 * per_sample))
    monkeypatch.setattr(methods, "_native_call", lambda *a: calls.append(a[0].batch) or native_call(*a))
    t = make_tensors(case)
    ref = _loop_reference(case, t)
    for method in ("unfold", "conv", "native"):
        got = cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"], method=method, **_kw(case))
        torch.testing.assert_close(got, ref["grad_weight"], **TOL[DT], msg=lambda m, k=method: f"{case} {k}: {m}")
    for method in ("ghost", "unfold", "conv", "native"):
        got = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, method=method,
                                       **_kw(case))
        torch.testing.assert_close(got, ref["grad_weight"].flatten(1).norm(dim=1), **TOL[DT])
    assert sorted(set(calls)) == [1, 2]  # (2, 1) per call of a batch of three


@pytest.mark.parametrize("fast_mode", GRADCHECK_MODES)
def test_native_in_chunks_stays_differentiable_and_batches_under_vmap(monkeypatch: pytest.MonkeyPatch,
                                                                      fast_mode: bool) -> None:
    monkeypatch.setattr(methods, "layer_chunks", lambda spec, per_sample, sides=1.0: methods.sample_chunks(
        spec.batch, per_sample, per_sample))
    g = torch.Generator().manual_seed(6)
    x = torch.randn(3, 4, 5, 5, generator=g, dtype=DT, requires_grad=True)
    gy = torch.randn(3, 6, 5, 5, generator=g, dtype=DT, requires_grad=True)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cg.per_sample_weight_grad(a, (6, 2, 3, 3), b, padding=1, groups=2, method="native")

    assert torch.autograd.gradcheck(f, (x, gy), fast_mode=fast_mode)
    xs, gys = torch.stack([x.detach(), -x.detach()]), torch.stack([gy.detach(), 2 * gy.detach()])  # (2, N, ...)
    batched = torch.func.vmap(f)(xs, gys)
    torch.testing.assert_close(batched, torch.stack([f(a, b) for a, b in zip(xs, gys, strict=True)]))


def test_a_layers_chunks_hold_at_most_its_own_sides_or_one_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer whose input and grad_output (x + y) are smaller than CHUNK_ELEMENTS gets chunks of at most x + y;
    with sides=2 (the native kernel) at most 2(x + y), but never below one CHUNK_ELEMENTS."""
    monkeypatch.setattr(methods, "CHUNK_ELEMENTS", 1000)
    small = cg.ConvSpec.from_shapes((8, 2, 4, 4), (3, 2, 3, 3), 1, 1)  # x + y = 8 * (32 + 48) = 640
    assert [c.stop - c.start for c in methods.layer_chunks(small, 100)] == [6, 2]  # 640 // 100
    assert [c.stop - c.start for c in methods.layer_chunks(small, 100, sides=2.0)] == [8]  # 1280 // 100 > 8
    big = cg.ConvSpec.from_shapes((8, 4, 8, 8), (4, 4, 3, 3), 1, 1)  # x + y = 4096
    assert [c.stop - c.start for c in methods.layer_chunks(big, 300)] == [3, 3, 2]  # 1000 // 300
    assert [c.stop - c.start for c in methods.layer_chunks(big, 3000, sides=2.0)] == [2, 2, 2, 2]  # 8192 // 3000
    assert [c.stop - c.start for c in methods.layer_chunks(big, 5000)] == [1] * 8  # one sample at least


def test_ghost_norm_keeps_groups_apart_backpack_batchl2grad_bug() -> None:
    """BackPACK's BatchL2Grad sums the Gram matrices over groups before the inner product; that is wrong."""
    case = layer_case("groups2", 4, 4, (6, 6), (3, 3), groups=2, padding=1, batch=2)
    t = make_tensors(case, seed=3)
    spec = case.spec()
    ghost = methods.ghost_sq_norms(spec, t["input"], t["grad_output"])
    materialised = _loop_reference(case, t)["grad_weight"].flatten(1).square().sum(1)
    torch.testing.assert_close(ghost, materialised, **TOL[DT])
    u = methods.im2col(spec, t["input"])  # (N, g, C_in/g·T, P)
    yr = t["grad_output"].reshape(2, 2, 2, -1)  # (N, g, C_out/g, P)
    summed = torch.einsum("ngcp,ngcq->npq", u, u) * torch.einsum("ngcp,ngcq->npq", yr, yr)  # Gram summed over g
    assert not torch.allclose(summed.sum((1, 2)), materialised, rtol=1e-3)


@pytest.mark.parametrize("case", [c for c in LAYER_CASES if c.input_shape[0]][:6], ids=str)
def test_auto_choice_follows_the_stated_cost_model(case: Case) -> None:
    s = case.spec()
    p, t, g, cx, cy = s.positions, s.taps, s.groups, s.x_channels, s.y_channels
    ghost = p * p * (cy + cx * t) < p * cy * cx * t // g
    assert (methods.choose_method(s, norms=True) == "ghost") == ghost
    assert methods.choose_method(s, norms=False) == ("conv" if cy * cx * t < methods.MIN_TILE * g * g else "unfold")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    (dict(method="ghost"), ValueError, "norms only"),
    (dict(method="im2col"), ValueError, "method='im2col'"),
    (dict(input=torch.randn(2, 5, 5, dtype=DT)), ValueError, "no batch dim"),
    (dict(grad_output=torch.randn(2, 3, 4, 4, dtype=DT)), ValueError, "grad_output.shape"),
    (dict(grad_output=torch.randn(2, 3, 3, 3)), TypeError, "dtype"),
    (dict(input=torch.randint(0, 3, (2, 2, 5, 5))), TypeError, "dtype"),
    # the validation path shared with conv_backward (convgrad.checks): the same message for the same mistake
    (dict(input=None), TypeError, "per_sample_weight_grad: input is None, but a tensor is required"),
    (dict(weight_size="abc"), TypeError, "per_sample_weight_grad: weight_size='abc' must be a sequence of ints"),
    (dict(weight_size=(3, 2, -3, 3)), ValueError, r"weight_size=\(3, 2, -3, 3\) must be >= 0"),
])
def test_per_sample_weight_grad_refuses_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    args = dict(input=torch.randn(2, 2, 5, 5, dtype=DT), weight_size=(3, 2, 3, 3),
                grad_output=torch.randn(2, 3, 3, 3, dtype=DT))
    with pytest.raises(error, match=match):
        cg.per_sample_weight_grad(**{**args, **kwargs})


# ---- model level -----------------------------------------------------------------------------------------------------
class Mixed(nn.Module):
    """Every supported module kind, the awkward settings included."""

    def __init__(self, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, (4, 2), padding="same", padding_mode=padding_mode)
        self.gn = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 6, (3, 1), padding=(1, 0), groups=2, padding_mode=padding_mode)
        self.c3 = nn.Conv2d(6, 6, 3, stride=2, dilation=2, padding=2, groups=6, bias=False)
        self.t1 = nn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2)
        self.ln = nn.LayerNorm(4)
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.gn(self.c1(x)))
        h = self.c3(torch.relu_(self.c2(h)))  # in place on a hooked output
        h = self.t1(h, output_size=[h.shape[2] * 2 - 1, h.shape[3] * 2])  # output_size overrides output_padding
        h = self.ln(h.permute(0, 2, 3, 1))  # (N, H, W, 4): positions before features
        return self.fc(h).mean((1, 2))


class Conv3dNet(nn.Module):
    def __init__(self, padding_mode: str = "zeros") -> None:
        super().__init__()
        self.c = nn.Conv3d(4, 2, 2, padding=2, groups=2, padding_mode=padding_mode)
        self.t = nn.ConvTranspose1d(2, 2, 3, stride=2, output_padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.t(self.c(x).flatten(2)).sum(2)


def _loss(out: torch.Tensor, reduction: str) -> torch.Tensor:
    per_sample = (out * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype)).sum(1) + out.square().sum(1)
    return per_sample.mean() if reduction == "mean" else per_sample.sum()


def _model_references(model: nn.Module, x: torch.Tensor, use_vmap: bool = True) -> list[dict[str, torch.Tensor]]:
    """Per-sample gradients of each sample's own loss: a loop, and torch.func vmap over grad."""
    loop = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(_loss(model(x[i:i + 1]), "sum"), list(model.parameters()))
        for (k, _), g in zip(model.named_parameters(), grads, strict=True):
            loop[k].append(g)
    params = {k: p.detach() for k, p in model.named_parameters()}
    if x.shape[0] == 0:
        return [{k: p.new_zeros(0, *p.shape) for k, p in params.items()}]
    out = [{k: torch.stack(v) for k, v in loop.items()}]
    if not use_vmap:
        return out
    per = vmap(grad(lambda p, xi: _loss(functional_call(model, p, (xi.unsqueeze(0),)), "sum")), in_dims=(None, 0))
    out.append(per(params, x))
    return out


class WithBatchNorm(nn.Module):
    """BatchNorm1d on (N, C) and (N, C, L), BatchNorm2d, SyncBatchNorm; random running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.bn_l = nn.SyncBatchNorm(4)  # without a process group, it runs as BatchNorm in eval mode
        self.fc = nn.Linear(4 * 16, 3)
        self.bn_c = nn.BatchNorm1d(3)
        gen = torch.Generator().manual_seed(5)
        for bn in (self.bn, self.bn_l, self.bn_c):
            for t in (bn.running_mean, bn.weight, bn.bias):
                t.data.copy_(torch.rand(t.shape, generator=gen) * 2 - 1)
            bn.running_var.copy_(torch.rand(bn.running_var.shape, generator=gen) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.bn_l(torch.tanh(self.bn(self.c(x))).flatten(2))  # (N, 4, 16)
        return self.bn_c(self.fc(h.flatten(1)))


MODELS = [("mixed-zeros", lambda: Mixed(), (4, 2, 7, 6)), ("mixed-reflect", lambda: Mixed("reflect"), (3, 2, 7, 6)),
          ("mixed-circular", lambda: Mixed("circular"), (3, 2, 7, 6)),
          ("conv3d-groups-padding-ge-kernel", lambda: Conv3dNet(), (3, 4, 3, 2, 3)),
          ("conv3d-replicate", lambda: Conv3dNet("replicate"), (2, 4, 3, 2, 3)),
          ("batch1", lambda: Mixed("circular"), (1, 2, 7, 6)), ("batch0", lambda: Conv3dNet(), (0, 4, 3, 2, 3)),
          ("batch0-mixed", lambda: Mixed("reflect"), (0, 2, 7, 6)),
          ("batchnorm-eval", lambda: WithBatchNorm().eval(), (3, 2, 4, 4))]
CLIP_MODELS = [*MODELS[:4], MODELS[-1]]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(("name", "make", "shape"), MODELS, ids=[m[0] for m in MODELS])
def test_grad_sample_matches_loop_and_vmap(name: str, make, shape: tuple[int, ...], reduction: str) -> None:
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(shape, dtype=DT)
    refs = _model_references(model, x)
    with cg.PerSampleGrads(model, loss_reduction=reduction) as psg:
        _loss(model(x), reduction).backward()
    ours = {k: p.grad_sample for k, p in model.named_parameters()}
    for ref, source in zip(refs, ("loop", "vmap"), strict=False):
        assert_matches_autograd(ours, ref, DT, f"{name} {reduction} vs {source}")
    ordinary = {k: p.grad for k, p in model.named_parameters()}  # backward still yields the ordinary .grad
    expected = {k: g.sum(0) / (max(shape[0], 1) if reduction == "mean" else 1) for k, g in refs[0].items()}
    if shape[0]:
        assert_matches_autograd(ordinary, expected, DT, f"{name} {reduction} .grad")
    norms = torch.cat([g.flatten(1) for g in refs[0].values()], 1).norm(dim=1)
    torch.testing.assert_close(psg.norms(), norms, **TOL[DT])


@pytest.mark.parametrize(("name", "make", "shape"), [MODELS[0], MODELS[-1]], ids=[MODELS[0][0], MODELS[-1][0]])
def test_normalisations_recomputed_a_sample_at_a_time_match_the_loop(name: str, make, shape: tuple[int, ...],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """GroupNorm, LayerNorm and BatchNorm's x̂ in chunks of one sample (NORM_CHUNK_ELEMENTS=1): each chunk's
    gradients land on its own samples."""
    monkeypatch.setattr(rules, "NORM_CHUNK_ELEMENTS", 1)
    torch.manual_seed(0)
    model = make().to(DT)
    x = torch.randn(shape, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]
    with cg.PerSampleGrads(model, loss_reduction="sum"):
        _loss(model(x), "sum").backward()
    assert_matches_autograd({k: p.grad_sample for k, p in model.named_parameters()}, ref, DT, name)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize(("name", "make", "shape"), CLIP_MODELS, ids=[m[0] for m in CLIP_MODELS])
def test_norms_only_and_clip_and_accumulate_match_materialised(name: str, make, shape: tuple[int, ...],
                                                               reduction: str) -> None:
    torch.manual_seed(1)
    model = make().to(DT)
    x = torch.randn(shape, dtype=DT)
    with cg.PerSampleGrads(model, loss_reduction=reduction) as full:
        _loss(model(x), reduction).backward()
    grads = {k: p.grad_sample.clone() for k, p in model.named_parameters()}
    norms = full.norms()
    max_norm = float(norms.median())  # clips some samples and not others
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in grads.items()}
    full.clip_and_accumulate(max_norm)  # the materialised path
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, f"{name} clipped full")
    model.zero_grad()  # clip_and_accumulate adds: a new logical batch starts from no .grad
    with cg.PerSampleGrads(model, loss_reduction=reduction, norms_only=True) as psg:
        _loss(model(x), reduction).backward()
    assert all(p.grad_sample is None for p in model.parameters())
    torch.testing.assert_close(psg.norms(), norms, **TOL[DT])
    psg.clip_and_accumulate(max_norm)  # one weight-gradient call per layer where nothing was materialised
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, f"{name} clipped")


def test_norms_only_on_an_empty_batch_gives_zero_gradients() -> None:
    model = Mixed("circular").to(DT)
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        _loss(model(torch.randn(0, 2, 7, 6, dtype=DT)), "sum").backward()
    assert psg.clip_and_accumulate(1.0).shape == (0,)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_ghost_paths_run_on_layers_where_ghost_is_cheaper() -> None:
    """Deep, small-spatial layers take the ghost path in norms_only mode, and still match."""
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(8, 64, 3, groups=2), nn.ReLU(), nn.Conv2d(64, 32, 2, groups=2),
                          nn.Flatten(1), nn.Unflatten(1, (2, 16)), nn.Linear(16, 40), nn.Flatten(1)).to(DT)
    x = torch.randn(3, 8, 4, 4, dtype=DT)
    specs = [cg.ConvSpec.from_shapes((3, 8, 4, 4), (64, 4, 3, 3), groups=2),
             cg.ConvSpec.from_shapes((3, 64, 2, 2), (32, 32, 2, 2), groups=2)]
    assert all(methods.choose_method(s, norms=True) == "ghost" for s in specs)
    ref = torch.cat([g.flatten(1) for g in _model_references(model, x)[0].values()], 1).norm(dim=1)
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        _loss(model(x), "sum").backward()
    torch.testing.assert_close(psg.norms(), ref, **TOL[DT])


def test_a_module_called_twice_sums_its_calls() -> None:
    torch.manual_seed(3)
    conv = nn.Conv1d(2, 2, 3, padding=1).to(DT)
    model = nn.Sequential(conv, nn.Tanh(), conv, nn.Flatten(1))
    x = torch.randn(3, 2, 5, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]  # functional_call leaves a shared module's tensors swapped
    for norms_only in (False, True):
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
            _loss(model(x), "sum").backward()
        expected = torch.cat([ref["0.weight"].flatten(1), ref["0.bias"]], 1).norm(dim=1)
        torch.testing.assert_close(psg.norms(), expected, **TOL[DT])
        if not norms_only:
            assert_matches_autograd({"w": conv.weight.grad_sample}, {"w": ref["0.weight"]}, DT, "shared conv")


def _check_against_the_loop(model: nn.Module, x: torch.Tensor, norms_only: bool = False) -> cg.PerSampleGrads:
    """PerSampleGrads over ``model`` (this file's summed loss) against a loop over single samples."""
    return assert_per_sample_matches_the_loop(model, (x,), lambda out: _loss(out, "sum"), norms_only)


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_module_without_a_rule_gets_its_per_sample_gradients_from_its_own_forward(norms_only: bool) -> None:
    """PReLU has no rule (its weight meets the samples in prelu): refused before issue 38, now rerun per sample."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sequential(nn.PReLU(2)), nn.Flatten(), nn.Linear(2 * 4 * 4, 2))
    psg = _check_against_the_loop(model.to(DT), torch.randn(3, 1, 6, 6, dtype=DT), norms_only)
    assert psg.report()["1.0.weight"] == "rerun of module '1.0' (PReLU) per sample (prelu)"
    assert psg.report()["0.weight"] == "conv2d"


class Scaled(nn.Conv2d):
    """A conv subclass with a forward of its own (timm's Conv2dSame, StdConv2d are such)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


class Standardised(nn.Conv2d):
    """timm's StdConv2d: the weight standardised in the forward, by batch_norm over the weight itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


@pytest.mark.parametrize("norms_only", [False, True])
@pytest.mark.parametrize("cls", [Scaled, Standardised])
def test_a_subclass_with_its_own_forward_follows_the_functions_it_calls(cls: type, norms_only: bool) -> None:
    """Refused before issue 38 (and, once patched, Standardised's per-sample gradients were off by 0.85)."""
    torch.manual_seed(4)
    model = nn.Sequential(cls(2, 3, 3, stride=2, padding=1), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 3 * 3, 2))
    x = torch.randn(4, 2, 6, 6, dtype=DT)
    psg = _check_against_the_loop(model.to(DT), x, norms_only)
    if cls is Standardised:
        assert psg.report()["0.weight"] == "conv2d through a transform (its weight computed from it)"
    _check_against_the_loop(cg.patch(model, backend="fwdconv"), x, norms_only)  # patched: the same


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect"])
def test_convgrad_nn_modules_and_patched_models_are_supported(padding_mode: str) -> None:
    cgnn = pytest.importorskip("convgrad.nn")
    if not hasattr(cgnn, "Conv2d") or not hasattr(cg, "patch"):
        pytest.skip("convgrad.nn is not available")
    torch.manual_seed(4)
    x = torch.randn(3, 2, 6, 6, dtype=DT)
    built = Mixed(padding_mode).to(DT)
    patched = Mixed(padding_mode).to(DT)
    cg.patch(patched)  # every conv becomes a convgrad.nn subclass, same Parameters
    assert isinstance(patched.c1, cgnn.Conv2d) and isinstance(patched.t1, cgnn.ConvTranspose2d)
    built.c1 = cgnn.Conv2d(2, 4, (4, 2), padding="same", padding_mode=padding_mode, backend="fwdconv").to(DT)
    built.t1 = cgnn.ConvTranspose2d(6, 4, 3, stride=2, padding=1, output_padding=1, groups=2).to(DT)
    for model in (built, patched):
        refs = _model_references(model, x, use_vmap=False)
        with cg.PerSampleGrads(model, loss_reduction="sum"):
            _loss(model(x), "sum").backward()
        assert_matches_autograd({k: p.grad_sample for k, p in model.named_parameters()}, refs[0], DT,
                                f"convgrad.nn {padding_mode}")


def test_bad_arguments_and_misuse_are_refused() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="loss_reduction='avg'"):
        cg.PerSampleGrads(model, loss_reduction="avg")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        cg.PerSampleGrads(lambda x: x)  # type: ignore[arg-type]
    psg = cg.PerSampleGrads(model, loss_reduction="sum")
    with pytest.raises(RuntimeError, match="no per-sample gradient"):
        psg.norms()
    with psg:
        model(torch.randn(2, 2)).sum().backward()
    with pytest.raises(ValueError, match="max_norm=0"):
        psg.clip_and_accumulate(0)


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_parameter_shared_by_two_modules_sums_its_calls_before_its_norm(norms_only: bool) -> None:
    """Refused with norms_only before issue 38: each call's norm was kept apart and norms do not add."""
    torch.manual_seed(12)
    tied = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3), nn.Conv1d(1, 2, 2)).to(DT)
    tied[2].weight = tied[0].weight

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = tied

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body(x).flatten(1)

    _check_against_the_loop(Net(), torch.randn(4, 1, 3, dtype=DT), norms_only)


# ---- BatchNorm, micro-batches, shared parameters, wrappers --------------------------------------------------------
def test_batchnorm_that_mixes_the_samples_is_refused_at_each_forward() -> None:
    torch.manual_seed(6)
    model = WithBatchNorm().to(DT)  # training mode
    x = torch.randn(3, 2, 4, 4, dtype=DT)
    psg = cg.PerSampleGrads(model, loss_reduction="sum")  # accepted: the mode is checked at the forward
    with pytest.raises(ValueError, match=r"'bn' \(BatchNorm2d\) normalises with the statistics of the batch "
                                         r"\(training mode\)"), psg:
        model(x)
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing left swapped
    model.eval()
    with psg:
        _loss(model(x), "sum").backward()
    assert model.bn.weight.grad_sample.shape == (3, 4)
    model.bn_c.train().requires_grad_(False)  # frozen, but it still mixes the samples the other layers see
    with pytest.raises(ValueError, match=r"'bn_c' \(BatchNorm1d\)"), psg:
        model(x)
    with psg, torch.no_grad():
        model(x)  # no backward can follow: nothing to refuse
    model.bn_c = nn.BatchNorm1d(3, track_running_stats=False).to(DT).eval()
    with pytest.raises(ValueError, match=r"track_running_stats=False"), cg.PerSampleGrads(model):
        model(x)


@pytest.mark.parametrize("norms_only", [False, True])
def test_micro_batches_accumulate_into_grad_like_one_logical_batch(norms_only: bool) -> None:
    torch.manual_seed(7)
    model = Mixed("circular").to(DT)
    x = torch.randn(6, 2, 7, 6, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    factors = (float(norms.median()) / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}
    model.zero_grad()  # the documented reset, once per logical batch
    for chunk in x.split([2, 1, 3]):
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
            _loss(model(chunk), "sum").backward()
        psg.clip_and_accumulate(float(norms.median()))
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, "micro-batches")
    psg.clip_and_accumulate(float(norms.median()))  # a second call on the last micro-batch does not add it twice
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, "called twice")


def test_a_parameter_shared_by_two_modules_counts_once() -> None:
    torch.manual_seed(8)
    first, second = nn.Linear(3, 3), nn.Linear(3, 3)
    second.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second).to(DT)
    x = torch.randn(4, 3, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]  # named_parameters lists the shared weight once
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    with cg.PerSampleGrads(model, loss_reduction="sum") as psg:
        _loss(model(x), "sum").backward()
    torch.testing.assert_close(psg.norms(), norms, **TOL[DT])
    model.zero_grad()
    psg.clip_and_accumulate(float(norms.median()))
    factors = (float(norms.median()) / (norms + 1e-6)).clamp(max=1.0)
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, "shared weight")


class KeywordInput(nn.Module):
    """A conv and a Linear called as module(input=x): forward pre-hooks without kwargs see no positional args."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 5 * 5, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(input=torch.tanh(self.c(input=x)).flatten(1))


@pytest.mark.parametrize("norms_only", [False, True])
def test_modules_called_with_a_keyword_input_keep_their_per_sample_gradients(norms_only: bool) -> None:
    """Regression: module(input=x) used to leave that module's parameters out of every norm, silently."""
    torch.manual_seed(9)
    model = KeywordInput().to(DT)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    factors = (float(norms.median()) / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
        _loss(model(x), "sum").backward()
    torch.testing.assert_close(psg.norms(), norms, **TOL[DT])
    psg.clip_and_accumulate(float(norms.median()))
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, "keyword input")


class DirectUse(nn.Module):
    """A conv's weight used by F.conv2d outside the conv's forward, and a weight penalty in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Conv2d(2, 3, 3)
        self.fc = nn.Linear(3 * 3 * 3, 2)

    def forward(self, x: torch.Tensor, direct: bool) -> torch.Tensor:
        h = F.conv2d(x, self.c.weight, self.c.bias) if direct else self.c(x)
        return self.fc(torch.tanh(h).flatten(1))


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_gradient_from_outside_the_models_forward_is_refused_not_left_out(norms_only: bool) -> None:
    """Regression: such a gradient went into .grad unclipped, or was dropped, and no norm included it."""
    torch.manual_seed(10)
    model = DirectUse().to(DT)
    x = torch.randn(3, 2, 5, 5, dtype=DT)
    with pytest.raises(ValueError, match=r"parameter 'fc\.weight' received a gradient from outside the model's"), \
            cg.PerSampleGrads(model, norms_only=norms_only):
        (_loss(model(x, direct=False), "sum") + model.fc.weight.square().sum()).backward()


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("norms_only", [False, True])
def test_a_parameter_used_by_a_function_outside_its_modules_forward_is_reached(norms_only: bool,
                                                                               direct: bool) -> None:
    """F.conv2d(x, self.c.weight) in the parent's forward: refused before issue 38, now the conv rule's."""
    torch.manual_seed(10)
    model = DirectUse().to(DT)

    class Call(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = model

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(x, direct=direct)

    _check_against_the_loop(Call(), torch.randn(3, 2, 5, 5, dtype=DT), norms_only)


@pytest.mark.parametrize("norms_only", [False, True])
def test_an_unbatched_input_is_one_sample_under_a_mean_loss(norms_only: bool) -> None:
    """Regression: with loss_reduction="mean", an unbatched input was scaled by its first dim (C_in), not 1."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Tanh(), nn.Flatten(0), nn.Linear(2 * 4 * 4, 2)).to(DT)
    x = torch.randn(3, 6, 6, dtype=DT)  # (C, H, W): one sample
    ref = dict(zip([k for k, _ in model.named_parameters()],
                   torch.autograd.grad(model(x).square().sum(), list(model.parameters())), strict=True))
    norm = torch.cat([g.flatten() for g in ref.values()]).norm()
    model.zero_grad()
    with cg.PerSampleGrads(model, loss_reduction="mean", norms_only=norms_only) as psg:
        model(x).square().sum().backward()
    torch.testing.assert_close(psg.norms(), norm.reshape(1), **TOL[DT])
    if not norms_only:
        assert_matches_autograd({k: p.grad_sample[0] for k, p in model.named_parameters()}, ref, DT, "unbatched")
        assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, ref, DT, "unbatched .grad")
    model.zero_grad()
    psg.clip_and_accumulate(float(norm) / 2)
    factor = float(norm) / 2 / (norm + 1e-6)  # Opacus's factor: about 1/2
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, {k: g * factor for k, g in ref.items()},
                            DT, "unbatched clipped")


def test_a_module_called_on_part_of_the_batch_is_refused() -> None:
    """Regression: per-sample results of batch 4 and batch 1 broadcast into a wrong sum."""
    conv = nn.Conv2d(2, 2, 3, padding=1).to(DT)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    for norms_only in (False, True):
        with pytest.raises(ValueError, match=r"'\(the model itself\)' \(Conv2d\) saw a batch of 4 samples "
                                             r"along dim 0, but another call of it saw 1"), \
                cg.PerSampleGrads(conv, loss_reduction="sum", norms_only=norms_only):
            (conv(x).sum() + conv(x[:1]).sum()).backward()


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
@pytest.mark.parametrize("norms_only", [False, True])
@pytest.mark.parametrize("wrap", [nn.utils.spectral_norm, nn.utils.weight_norm, nn.utils.parametrizations.weight_norm,
                                  nn.utils.parametrizations.spectral_norm])
@pytest.mark.parametrize("nested", [False, True])
def test_a_reparametrised_weight_gets_its_layers_gradient_pulled_back(wrap, nested: bool, norms_only: bool) -> None:
    """Refused before issue 38 (hook-style spectral_norm and weight_norm failed in the backward with KeyError).
    The per-sample gradient of weight_g, weight_v (or original0/1, weight_orig) is the conv's pulled back through
    the parametrisation; spectral_norm's power iteration runs in eval mode, so the loop sees the same sigma."""
    torch.manual_seed(13)
    conv = wrap(nn.Conv1d(2, 2, 3)).to(DT)
    if nested:
        _check_against_the_loop(nn.Sequential(conv, nn.Flatten(), nn.Linear(2 * 3, 2)).to(DT).eval(),
                                torch.randn(3, 2, 5, dtype=DT), norms_only)
    else:  # the conv is the model: its own pre-hook computes the weight, after the context's (which runs first)
        _check_against_the_loop(conv.eval(), torch.randn(3, 2, 3, dtype=DT), norms_only)


def test_data_parallel_is_refused() -> None:
    with pytest.raises(TypeError, match=r"the model itself is a torch\.nn\.DataParallel"):
        cg.PerSampleGrads(nn.DataParallel(nn.Linear(2, 2)))


# ---- the measured choice of the per-sample method (convgrad.per_sample.tuning) -------------------------------
def test_tuned_methods_give_the_same_per_sample_results(tuned: None) -> None:
    from convgrad.per_sample import tuning

    for case in [c for c in LAYER_CASES if c.input_shape[0]][:6]:
        t = make_tensors(case, DT)
        ref = _loop_reference(case, t)["grad_weight"]
        s = case.spec()
        gw = cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"], **_kw(case))
        torch.testing.assert_close(gw, ref, **TOL[DT])
        norms = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, **_kw(case))
        torch.testing.assert_close(norms, ref.flatten(1).norm(dim=1), **TOL[DT])
        for purpose in ("grads", "norms"):
            choice = tuning.chosen(s, purpose, t["input"])
            assert choice is not None and choice.backend in tuning.estimates(s, purpose, False), (case, purpose)
            assert not choice.pending and not choice.rejected


@pytest.mark.parametrize("wrong", [0, 1, 3, 5, 6])
def test_the_screening_rejects_a_method_wrong_on_one_screened_sample(tuned: None, wrong: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The screening compares four samples of each "grads" result (first two, middle, last; batch 7: 0, 1, 3, 6),
    not the whole: a method wrong there is rejected, and the chosen one is right on every sample."""
    from convgrad.per_sample import tuning

    real = methods.weight_grad

    def conv_off_by_one_sample(spec: cg.ConvSpec, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
        gw = real(spec, x, y, method)
        return gw.index_add(0, torch.tensor([wrong]), torch.ones_like(gw[:1])) if method == "conv" else gw

    monkeypatch.setattr(methods, "weight_grad", conv_off_by_one_sample)
    x, gy = torch.randn(7, 4, 6, 6, dtype=DT), torch.randn(7, 4, 6, 6, dtype=DT)
    spec = cg.ConvSpec.from_shapes(x.shape, (4, 4, 3, 3), 1, 1)
    assert tuning._fixed(spec, "grads", False) == "unfold"  # the screening's reference, so "conv" is checked
    choice = tuning.method_for(spec, x, gy, "grads")
    rejected = tuning.chosen(spec, "grads", x).rejected  # type: ignore[union-attr]
    assert ("conv" in rejected) == (wrong in (0, 1, 3, 6))
    assert wrong == 5 or choice != "conv"


def test_a_method_the_cost_model_puts_far_behind_is_never_run(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from convgrad.per_sample import tuning

    calls: list[str] = []
    real = methods.ghost_sq_norms
    monkeypatch.setattr(methods, "ghost_sq_norms", lambda *a: calls.append("ghost") or real(*a))
    x, gy = torch.randn(4, 8, 16, 16), torch.randn(4, 8, 16, 16)  # P = 256: ghost has 8.9x unfold's multiply-adds
    spec = cg.ConvSpec.from_shapes(x.shape, (8, 8, 3, 3), 1, 1)
    est = tuning.estimates(spec, "norms", False)
    assert est["ghost"] > 4 * est["unfold"]
    cg.per_sample_grad_norms(x, (8, 8, 3, 3), gy, padding=1)
    assert calls == [] and "ghost" not in tuning.chosen(spec, "norms", x).times  # type: ignore[union-attr]
    x, gy = torch.randn(4, 64, 2, 2), torch.randn(4, 64, 2, 2)  # P = 4: ghost is the cheap one, and it runs
    cg.per_sample_grad_norms(x, (64, 64, 3, 3), gy, padding=1)
    assert calls


@pytest.mark.parametrize("purpose", ["grads", "norms", "clip"])
def test_an_option_estimated_over_prune_times_the_cheapest_is_never_run(tuned: None, purpose: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """``PRUNE`` (3x), not the tuner's default of 4x: "native" on a 6x6 output (P = 36) is estimated at 128/36 = 3.6x
    unfold's multiply-adds, so it never runs, for any purpose (benchmarks/results/per_sample_prune.md)."""
    from convgrad.per_sample import tuning

    calls: list[str] = []
    real_grad, real_sq = methods.weight_grad, methods.materialised_sq_norms
    monkeypatch.setattr(methods, "weight_grad", lambda s, x, y, m: calls.append(m) or real_grad(s, x, y, m))
    monkeypatch.setattr(methods, "materialised_sq_norms", lambda s, x, y, m: calls.append(m) or real_sq(s, x, y, m))
    x, gy = torch.randn(8, 4, 6, 6, dtype=DT), torch.randn(8, 4, 6, 6, dtype=DT)
    spec = cg.ConvSpec.from_shapes(x.shape, (4, 4, 3, 3), 1, 1)
    est = tuning.estimates(spec, "norms" if purpose == "clip" else purpose, False)
    assert tuning.PRUNE < est["native"] / est["unfold"] <= PRUNE_ESTIMATE
    tuning.method_for(spec, x, gy, purpose)
    assert "native" not in calls and calls, calls
    assert "native" not in tuning.chosen(spec, purpose, x).times  # type: ignore[union-attr]


@pytest.mark.parametrize("store", [False, True])
def test_clip_options_agree_and_storing_is_offered_only_within_the_memory_rule(store: bool) -> None:
    from convgrad.per_sample import tuning

    spec = cg.ConvSpec.from_shapes((5, 4, 7, 7), (6, 2, 3, 3), 2, 1, groups=2)
    x, y = torch.randn(spec.input_shape, dtype=DT), torch.randn(spec.output_shape, dtype=DT)
    opts = tuning.options(spec, x, y, "clip", store)
    stored = {"unfold+store", "conv+store", "native+store"}
    assert set(opts) == ({"ghost"} | stored if store else {"ghost", "unfold", "conv", "native"})
    results = {n: run(5) for n, run in opts.items()}
    gw = methods.weight_grad(spec, x, y, "unfold")
    for name, (sq, summed) in results.items():  # the squared norms and the clipped sum with factors 1
        torch.testing.assert_close(sq, gw.flatten(1).square().sum(1), **TOL[DT], msg=name)
        torch.testing.assert_close(summed, gw.sum(0), **TOL[DT], msg=name)


@pytest.mark.parametrize("case", ["all-end-with-the-pass", "mixed", "store-only"])
def test_a_clip_tuning_runs_the_book_keeping_pass_only_where_it_can_change_the_ranking(
        tuned: None, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Book-Keeping pass is the same for every "clip" option without "+store". Where such options race "+store"
    ones (mixed: ghost beside m+store, P = 4), the tuning runs it twice (a warm-up, a timed call), not once per
    option call, and adds its time to each of those options' times (here a pass made 0.2 s slower). Where every
    option raced ends with it (no storing), or none does (storing, ghost pruned: P = 36, 11x unfold's
    multiply-adds), it cannot change the ranking and is not run."""
    from convgrad.per_sample import tuning

    calls: list[int] = []
    real = tuning.book_keeping

    def slow(s: cg.ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        calls.append(s.batch)
        time.sleep(0.2)
        return real(s, x, y)

    monkeypatch.setattr(tuning, "book_keeping", slow)
    c, size = (16, 2) if case == "mixed" else (4, 6)
    x, gy = torch.randn(8, c, size, size, dtype=DT), torch.randn(8, c, size, size, dtype=DT)
    spec = cg.ConvSpec.from_shapes(x.shape, (c, c, 3, 3), 1, 1)
    store = case != "all-end-with-the-pass"
    method = tuning.method_for(spec, x, gy, "clip", store)
    choice = tuning.chosen(spec, "clip", x, store)
    assert choice is not None and choice.backend == method
    without = [n for n in choice.times if "+" not in n]
    if case == "mixed":
        assert without == ["ghost"] and len(choice.times) >= 3, choice.times  # native+store: pruned (P = 4)
        assert calls == [8, 8], calls
        assert choice.times["ghost"] >= 0.2, choice.times
    else:
        assert calls == [], calls
        # ghost: pruned; without storing, native too (P = 36: 3.6x the others' multiply-adds, over PRUNE)
        assert len(without) == (2 if case == "all-end-with-the-pass" else 0), choice.times


def test_without_storing_clip_prunes_on_the_norms_cost_not_the_shared_pass(tuned: None,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every "clip" option without "+store" ends with the same Book-Keeping pass; a cost they all share cannot rank
    them, so the cost model prunes on the norms' alone: P = 4, 32 channels, ghost 1/7 of unfold's multiply-adds
    (with the pass: 1/1.8, nothing pruned). No materialising option runs, and ghost, left alone, is not timed."""
    from convgrad.per_sample import tuning

    calls: list[str] = []
    real, real_ghost = methods.materialised_sq_norms, methods.ghost_sq_norms
    monkeypatch.setattr(methods, "materialised_sq_norms", lambda s, x, y, m: calls.append(m) or real(s, x, y, m))
    monkeypatch.setattr(methods, "ghost_sq_norms", lambda s, x, y: calls.append("ghost") or real_ghost(s, x, y))
    x, gy = torch.randn(4, 32, 2, 2, dtype=DT), torch.randn(4, 32, 2, 2, dtype=DT)
    spec = cg.ConvSpec.from_shapes(x.shape, (32, 32, 3, 3), 1, 1)
    est = tuning.estimates(spec, "clip", False)
    assert est["unfold"] < 4 * est["ghost"]  # the shared pass alone would keep every option
    assert tuning.method_for(spec, x, gy, "clip", False) == "ghost" and calls == [], calls
    assert tuning.chosen(spec, "clip", x) == Choice("ghost", {}, (), 4)


def test_a_clip_option_far_behind_after_its_checking_call_is_not_timed(tuned: None,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``BEHIND``: "conv" made 0.3 s slower than unfold's few ms runs once (its checking call), not three times
    (a timed call and a re-time of an option over SCREEN_DROP x the fastest), and is not chosen; unfold, then the
    only option within BEHIND of the fastest checking call, is not timed again either (native: pruned, P = 36)."""
    from convgrad.per_sample import tuning

    calls: list[str] = []
    real = methods.materialised_sq_norms

    def slow_conv(spec: cg.ConvSpec, x: torch.Tensor, y: torch.Tensor, method: str) -> torch.Tensor:
        calls.append(method)
        if method == "conv":
            time.sleep(0.3)
        return real(spec, x, y, method)

    monkeypatch.setattr(methods, "materialised_sq_norms", slow_conv)
    x, gy = torch.randn(8, 4, 6, 6, dtype=DT), torch.randn(8, 4, 6, 6, dtype=DT)
    spec = cg.ConvSpec.from_shapes(x.shape, (4, 4, 3, 3), 1, 1)
    method = tuning.method_for(spec, x, gy, "clip", False)
    assert calls == ["unfold", "conv"], calls
    assert method != "conv" and tuning.chosen(spec, "clip", x).times["conv"] >= 0.3  # type: ignore[union-attr]


def test_clip_options_run_in_a_lower_precision_dtype() -> None:
    """Regression: the Book-Keeping option multiplied grad_output by float32 ones on the CPU (a dtype mismatch in
    bfloat16/float16, a device mismatch on CUDA)."""
    from convgrad.per_sample import tuning

    spec = cg.ConvSpec.from_shapes((5, 4, 7, 7), (6, 4, 3, 3), 1, 1)
    x, y = torch.randn(spec.input_shape, dtype=DT), torch.randn(spec.output_shape, dtype=DT)
    gw = methods.weight_grad(spec, x, y, "unfold")
    for name, run in tuning.options(spec, x.bfloat16(), y.bfloat16(), "clip", True).items():
        sq, summed = run(5)
        assert summed.dtype == torch.bfloat16, name
        assert (summed.double() - gw.sum(0)).norm() <= 2e-2 * gw.sum(0).norm(), name  # bfloat16: 8 bits
        sq_ref = gw.flatten(1).square().sum(1)
        assert (sq.double() - sq_ref).abs().max() <= 4e-2 * sq_ref.max(), name


@pytest.mark.parametrize("norms_only", [False, True])
def test_autocast_gives_float32_gradients_close_to_float32(tuned: None, norms_only: bool) -> None:
    """Under torch.autocast the input arrives in float32 and grad_output in bfloat16: the rules run in bfloat16 (as
    Opacus's do) and .grad keeps the parameter's dtype."""
    torch.manual_seed(12)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.GroupNorm(2, 8), nn.Flatten(), nn.Linear(8 * 4 * 4, 2))
    x = torch.randn(6, 3, 6, 6)
    results = []
    for autocast in (False, True):
        model.zero_grad()
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg, \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(x).float().square().sum().backward()
        norms = psg.norms()
        model.zero_grad()
        psg.clip_and_accumulate(1.0)
        results.append((norms, [p.grad.clone() for p in model.parameters()]))
    (ref_norms, ref), (norms, grads) = results
    assert all(g.dtype == torch.float32 for g in grads)
    assert ((norms - ref_norms).abs() <= 5e-2 * ref_norms).all()
    for g, r in zip(grads, ref, strict=True):
        assert (g - r).norm() <= 5e-2 * r.norm()


def test_norms_only_clips_per_the_measured_plan_and_matches(tuned: None) -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Conv2d(2, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1, groups=2),
                          nn.ReLU(), nn.Conv2d(8, 16, 3, stride=2), nn.Flatten(), nn.Linear(16 * 3 * 3, 3)).to(DT)
    x = torch.randn(6, 2, 8, 8, dtype=DT)
    with cg.PerSampleGrads(model, loss_reduction="sum") as full:
        model(x).square().sum().backward()
    grads = {k: p.grad_sample.clone() for k, p in model.named_parameters()}
    norms = full.norms()
    factors = (1.0 / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        model(x).square().sum().backward()
    torch.testing.assert_close(psg.norms(), norms, **TOL[DT])
    psg.clip_and_accumulate(1.0)
    for k, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.tensordot(factors, grads[k], dims=1), **TOL[DT], msg=k)


def test_layers_of_one_shape_share_one_per_sample_tuning(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from convgrad.per_sample import tuning

    seen: list[str] = []
    real = tuning._tune
    monkeypatch.setattr(tuning, "_tune", lambda spec, x, y, purpose, store: seen.append(purpose) or real(
        spec, x, y, purpose, store))
    for layers in (1, 5):
        tuning._choices.reset()
        seen.clear()
        model = nn.Sequential(*[nn.Conv2d(4, 4, 3, padding=1) for _ in range(layers)])
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
            model(torch.randn(8, 4, 6, 6)).sum().backward()
        psg.clip_and_accumulate(1.0)
        assert len(seen) == 1, layers  # one "clip" tuning, whatever the number of layers of that shape


def test_fixed_mode_takes_the_cost_model_and_times_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    from convgrad.backends import auto
    from convgrad.per_sample import tuning

    monkeypatch.setattr(tuning, "_tune", lambda *a: pytest.fail("timed in fixed mode"))
    auto.clear()
    with auto.tuning_mode("fixed"):
        for spec in (cg.ConvSpec.from_shapes((4, 8, 16, 16), (8, 8, 3, 3), 1, 1),  # materialise: unfold
                     cg.ConvSpec.from_shapes((4, 64, 2, 2), (64, 64, 3, 3), 1, 1),  # ghost is cheaper
                     cg.ConvSpec.from_shapes((4, 8, 9, 9), (8, 1, 3, 3), groups=8)):  # depthwise: conv
            x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)
            grads, norms = methods.choose_method(spec, norms=False), methods.choose_method(spec, norms=True)
            assert tuning.method_for(spec, x, y, "grads") == grads
            assert tuning.method_for(spec, x, y, "norms") == norms
            assert tuning.method_for(spec, x, y, "clip", store=False) == norms
            stored = norms if norms == "ghost" else f"{norms}+store"
            assert tuning.method_for(spec, x, y, "clip", store=True) == stored
            assert tuning.chosen(spec, "grads", x) is None  # nothing remembered either


def test_batches_of_one_bucket_share_one_per_sample_tuning(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from convgrad.per_sample import tuning

    seen: list[int] = []
    real = tuning._tune
    monkeypatch.setattr(tuning, "_tune", lambda spec, *a: seen.append(spec.batch) or real(spec, *a))
    for n in (5, 7, 8, 9):  # buckets 8, 8, 8, 16 (Poisson sampling draws a new batch size every step)
        x, gy = torch.randn(n, 4, 6, 6, dtype=DT), torch.randn(n, 4, 6, 6, dtype=DT)
        cg.per_sample_grad_norms(x, (4, 4, 3, 3), gy, padding=1)
    assert seen == [5, 9]


def test_storing_per_sample_gradients_for_the_clip_is_allowed_only_within_the_memory_rule(
        tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """ConvLayer lets "clip" store the per-sample gradients only where they take at most STORE_GROWTH (2) times the
    memory of the (input, grad_output) that one more weight-gradient pass would keep (the absolute floor set to 0
    here; the next test checks it)."""
    from convgrad.per_sample import rules, tuning

    monkeypatch.setattr(rules, "STORE_FLOOR_BYTES", 0)

    asked: list[tuple[int, bool]] = []
    real = tuning.method_for
    monkeypatch.setattr(tuning, "method_for", lambda spec, x, y, purpose, store=False: (
        asked.append((spec.x_channels, store)) if purpose == "clip" else None) or real(spec, x, y, purpose, store))
    model = nn.Sequential(nn.Conv2d(2, 2, 3, padding=1),  # 38 entries per sample against 2·256 + 2·256 kept: store
                          nn.Conv2d(2, 64, 3, padding=1, stride=8),  # 1216 against 2·256 + 64·4 = 768 (1.6x): store
                          nn.Conv2d(64, 128, 1),  # 8320 against 64·4 + 128·4 = 768 (10.8x): no
                          nn.Flatten(), nn.Linear(128 * 2 * 2, 2)).to(DT)
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True):
        model(torch.randn(3, 2, 16, 16, dtype=DT)).sum().backward()
    assert asked == [(64, False), (2, True), (2, True)], asked  # the backward reaches the last conv first


def test_small_per_sample_gradients_may_be_stored_whatever_their_ratio_to_the_state(
        tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under STORE_FLOOR_BYTES in all, a layer's per-sample gradients may be stored for the clip even at 10.8x its
    state (the third conv of the test above); over the floor the ratio rule decides again."""
    from convgrad.per_sample import rules, tuning

    asked: list[tuple[int, bool]] = []
    real = tuning.method_for
    monkeypatch.setattr(tuning, "method_for", lambda spec, x, y, purpose, store=False: (
        asked.append((spec.x_channels, store)) if purpose == "clip" else None) or real(spec, x, y, purpose, store))
    model = nn.Sequential(nn.Conv2d(64, 128, 1), nn.Flatten(), nn.Linear(128 * 2 * 2, 2)).to(DT)
    x = torch.randn(3, 64, 2, 2, dtype=DT)  # grads 3 x 8320 x 8 bytes = 195 KiB, 10.8x the state
    for floor, store in ((8 * 2**20, True), (3 * 8320 * 8 - 1, False), (3 * 8320 * 8, True)):
        monkeypatch.setattr(rules, "STORE_FLOOR_BYTES", floor)
        asked.clear()
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True):
            model(x).sum().backward()
        assert asked == [(64, store)], (floor, asked)


def test_per_sample_choices_persist_in_autos_cache_file(tuned: None, tmp_path, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import json

    from convgrad.backends import auto
    from convgrad.per_sample import tuning

    path = tmp_path / "autotune.json"
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_CACHE", str(path))
    x, gy = torch.randn(8, 4, 6, 6, dtype=DT), torch.randn(8, 4, 6, 6, dtype=DT)
    cg.per_sample_grad_norms(x, (4, 4, 3, 3), gy, padding=1)
    keys = [k for k in json.loads(path.read_text())["choices"] if k.startswith("per_sample|")]
    assert len(keys) == 1 and "|norms|" in keys[0]
    auto.clear()  # a new process: the choice comes from the file
    monkeypatch.setattr(tuning, "_tune", lambda *a: pytest.fail("tuned although the cache file has the choice"))
    cg.per_sample_grad_norms(x, (4, 4, 3, 3), gy, padding=1)


def test_scratch_columns_are_reused_but_results_never_alias() -> None:
    spec = cg.ConvSpec.from_shapes((3, 4, 6, 6), (5, 4, 3, 3), 1, 1)
    x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)
    a, b = methods.im2col(spec, x, reuse=True), methods.im2col(spec, 2 * x, reuse=True)
    assert a.data_ptr() == b.data_ptr()  # one buffer: no fresh memory to page-fault per call
    torch.testing.assert_close(b, methods.im2col(spec, 2 * x))
    with torch.no_grad():
        g1 = methods.weight_grad(spec, x, y, "unfold")
        g2 = methods.weight_grad(spec, x, 2 * y, "unfold")
        norms = methods.materialised_sq_norms(spec, x, y, "unfold")
    assert g1.data_ptr() != g2.data_ptr()
    torch.testing.assert_close(2 * g1, g2)
    torch.testing.assert_close(norms, g1.flatten(1).square().sum(1))


@pytest.mark.parametrize("norms_only", [False, True])
def test_the_scratch_buffers_are_released_when_the_backward_ends(norms_only: bool) -> None:
    """The reused buffers (methods.scratch) serve the chunks of one layer: none is left when the next layer's part
    of the backward starts, nor after the backward (kept, they sat beside the next layer's transients)."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3), nn.Flatten(), nn.Linear(8 * 4 * 4, 2)).to(DT)
    seen, left = [], []
    scratch, layer_backward = methods.scratch, session.Session._layer_backward
    methods.release_scratch()  # what the functional calls of other tests left

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(True)
        return scratch(*args, **kwargs)

    def entry(*args: object) -> object:
        left.append(len(methods._SCRATCH))  # buffers left by the layers before
        return layer_backward(*args)

    with pytest.MonkeyPatch.context() as mp, \
            cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
        mp.setattr(methods, "scratch", spy)
        mp.setattr(session.Session, "_layer_backward", entry)
        mp.setattr(rules.tuning, "method_for", lambda *args: "unfold")  # a method that takes the scratch
        model(torch.randn(4, 3, 8, 8, dtype=DT)).sum().backward()
    assert seen and left == [0, 0, 0] and not methods._SCRATCH
    if norms_only:
        psg.clip_and_accumulate(1.0)


@pytest.mark.parametrize("method", ["unfold", "ghost", "auto"])
def test_a_functional_call_leaves_no_scratch_buffer_behind(method: str) -> None:
    x, gy = torch.randn(5, 3, 6, 6, dtype=DT), torch.randn(5, 4, 4, 4, dtype=DT)
    with torch.no_grad():  # the scratch is used outside a graph only
        if method != "ghost":
            cg.per_sample_weight_grad(x, (4, 3, 3, 3), gy, method=method)
            assert not methods._SCRATCH
        methods.scratch((4,), x)
        cg.per_sample_grad_norms(x, (4, 3, 3, 3), gy, method=method)
    assert not methods._SCRATCH


def test_a_layers_input_changed_in_place_after_its_forward_is_refused_not_used() -> None:
    """The input is saved on the layer's node: autograd's version check catches a later in-place change (before,
    the per-sample gradient silently came from the changed input)."""
    lin = nn.Linear(3, 4).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    with cg.PerSampleGrads(lin, loss_reduction="sum"):
        y = lin(x)
        x.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_a_second_backward_through_a_retained_graph_adds_its_per_sample_gradients() -> None:
    lin = nn.Linear(3, 4).to(DT)
    x = torch.randn(5, 3, dtype=DT)
    with cg.PerSampleGrads(lin, loss_reduction="sum"):
        loss = lin(x).square().sum()
        loss.backward(retain_graph=True)
        first = lin.weight.grad_sample.clone()
        loss.backward()
    torch.testing.assert_close(lin.weight.grad_sample, 2 * first)


def test_the_scratch_is_released_again_after_a_backward_that_raised() -> None:
    """A layer whose part of the backward raises still releases the buffers it took."""
    conv = nn.Conv2d(2, 2, 3, padding=1).to(DT)
    x = torch.randn(4, 2, 5, 5, dtype=DT)
    psg = cg.PerSampleGrads(conv, loss_reduction="sum")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rules.tuning, "method_for", lambda *args: "unfold")  # a method that takes the scratch
        with pytest.raises(ValueError, match="saw a batch"), psg:
            (conv(x).sum() + conv(x[:1]).sum()).backward()
        with psg:
            conv(x).sum().backward()
    assert not methods._SCRATCH


def test_the_default_loss_reduction_gives_each_samples_own_gradient_under_a_mean_loss() -> None:
    """Regression: PerSampleGrads defaulted to loss_reduction="sum" while F.cross_entropy (and Opacus) default to
    the mean, so a default loss inside a default context gave per-sample gradients divided by N."""
    torch.manual_seed(13)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 4 * 4, 4)).to(DT)
    x, y = torch.randn(6, 2, 6, 6, dtype=DT), torch.randint(0, 4, (6,))
    ref = {k: torch.stack([torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), p)[0]
                           for i in range(6)]) for k, p in model.named_parameters()}
    for norms_only in (False, True):
        with cg.PerSampleGrads(model, norms_only=norms_only) as psg:
            F.cross_entropy(model(x), y).backward()
        if not norms_only:
            assert_matches_autograd({k: p.grad_sample for k, p in model.named_parameters()}, ref, DT, "default")
        norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
        torch.testing.assert_close(psg.norms(), norms, **TOL[DT])


@pytest.mark.parametrize("norms_only", [False, True])
@pytest.mark.parametrize("order", ["forward-backward twice", "two forwards, then two backwards"])
def test_a_second_micro_batch_in_one_context_is_refused_not_merged(norms_only: bool, order: str) -> None:
    """Regression: two backwards of 4 samples each gave .grad_sample of 4 rows, row i the sum of sample i of both
    batches, and 4 norms for 8 samples; batches of unequal size were refused already."""
    torch.manual_seed(14)
    model = Mixed("circular").to(DT)
    x = torch.randn(8, 2, 7, 6, dtype=DT)
    with pytest.raises(ValueError, match=r"module '\w+' \(\w+\) received a second backward through a forward "
                                         r"that the first backward did not reach"), \
            cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only):
        if order == "forward-backward twice":
            _loss(model(x[:4]), "sum").backward()
            _loss(model(x[4:]), "sum").backward()
        else:
            first, second = _loss(model(x[:4]), "sum"), _loss(model(x[4:]), "sum")
            first.backward()
            second.backward()


@pytest.mark.parametrize("norms_only", [False, True])
def test_clear_starts_the_next_micro_batch_in_the_same_context(norms_only: bool) -> None:
    """The issue's comparison: the clipped sum over two micro-batches of 4 equals clipping the 8 samples of a loop."""
    torch.manual_seed(14)
    model = Mixed("circular").to(DT)
    x = torch.randn(8, 2, 7, 6, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    factors = (0.5 / (norms + 1e-6)).clamp(max=1.0)
    model.zero_grad()
    seen = []
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
        for part in (x[:4], x[4:]):
            _loss(model(part), "sum").backward()
            seen.append(psg.clip_and_accumulate(0.5))
            psg.clear()
    torch.testing.assert_close(torch.cat(seen), norms, **TOL[DT])
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}
    assert_matches_autograd({k: p.grad for k, p in model.named_parameters()}, expected, DT, "cleared micro-batches")


@pytest.mark.parametrize("segment", [(2, 4), (2, 7)], ids=["middle", "last layers"])
@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing_is_one_backward_and_matches_the_loop(reentrant: bool, segment: tuple[int, int]
                                                                     ) -> None:
    """A reentrant checkpoint back-propagates its recomputed forward in a nested backward, after the layers behind
    it or before any other: that is still the first batch, not a second one."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(15)
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Conv2d(3, 3, 3), nn.Tanh(), nn.Conv2d(3, 2, 1),
                          nn.Flatten(), nn.Linear(2 * 2 * 2, 2)).to(DT)
    x = torch.randn(4, 2, 6, 6, dtype=DT)
    ref = _model_references(model, x, use_vmap=False)[0]
    a, b = segment
    for norms_only in (False, True):
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
            h = checkpoint(model[a:b], model[:a](x), use_reentrant=reentrant)
            _loss(model[b:](h), "sum").backward()
        torch.testing.assert_close(psg.norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1),
                                   **TOL[DT])
        if not norms_only:
            assert_matches_autograd({k: p.grad_sample for k, p in model.named_parameters()}, ref, DT, "checkpoint")


# ---- half precision ---------------------------------------------------------------------------------------------
HALF_TOL = {torch.float16: 1e-2, torch.bfloat16: 5e-2}  # relative, of a norm or of a whole gradient


def _half_model() -> nn.Module:
    """Convs (one with a bias, one without), a GroupNorm and a Linear whose ghost norm is cheaper (P = 1)."""
    torch.manual_seed(16)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.GroupNorm(2, 8), nn.Tanh(),
                         nn.Conv2d(8, 16, 3, stride=2, bias=False), nn.Flatten(), nn.Linear(16 * 3 * 3, 4))


@pytest.mark.parametrize("input_scale", [1.0, 10.0])
@pytest.mark.parametrize("method", ["ghost", "unfold", "conv", "native"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_norms_accumulate_wide_and_never_overflow(dtype: torch.dtype, method: str, input_scale: float,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: float16 per-sample norms of about 360 (which float16 holds; their squares do not) came out inf
    with every method, so clip_and_accumulate added zeros; at 10x the input the ghost norm was NaN."""
    monkeypatch.setattr(rules.tuning, "method_for", lambda spec, x, y, purpose, store=False: (
        "unfold" if method == "ghost" and purpose == "grads" else method))
    ref_model = _half_model().to(DT)
    model = _half_model().to(dtype)
    x = (torch.randn(6, 3, 8, 8) * input_scale).to(dtype)
    direction = torch.linspace(-1, 1, 4, dtype=DT)
    per = [torch.autograd.grad((ref_model(x[i:i + 1].to(DT)) @ direction).sum(), list(ref_model.parameters()))
           for i in range(6)]
    unit = torch.stack([torch.cat([g.flatten() for g in gs]).norm() for gs in per])
    c = 360.0 / float(unit[unit.argsort()[3]])  # a linear loss: norms scale with c; the median sample's is 360
    ref = {k: c * torch.stack([gs[j] for gs in per]) for j, (k, _) in enumerate(ref_model.named_parameters())}
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    assert 300 < float(norms.median()) < 400 * input_scale and float(norms.max()) < 65504
    factors = (200.0 / (norms + 1e-6)).clamp(max=1.0)  # clips every sample
    expected = {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}
    tol = HALF_TOL[dtype]
    for norms_only in (False, True):
        model.zero_grad()
        with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
            (c * (model(x) @ direction.to(dtype))).sum().backward()
        got = psg.clip_and_accumulate(200.0)
        assert torch.isfinite(got).all() and ((got.double() - norms).abs() <= tol * norms).all(), (got, norms)
        for k, p in model.named_parameters():
            assert (p.grad.double() - expected[k]).norm() <= tol * expected[k].norm(), (norms_only, k)


@pytest.mark.parametrize("input_scale", [1.0, 10.0])
@pytest.mark.parametrize("method", ["ghost", "unfold", "conv", "native"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_layer_norms_are_finite_and_close(dtype: torch.dtype, method: str, input_scale: float) -> None:
    """per_sample_grad_norms in half precision: norms of about 360 (and 10x the input) are finite and close to
    float64's, and come back in the input's dtype."""
    g = torch.Generator().manual_seed(17)
    x = torch.randn(4, 8, 8, 8, generator=g, dtype=DT) * input_scale
    gy = torch.randn(4, 16, 8, 8, generator=g, dtype=DT)
    gy *= 360.0 / float(cg.per_sample_grad_norms(x, (16, 8, 3, 3), gy, padding=1, method="unfold").median())
    x, gy = x.to(dtype), gy.to(dtype)  # the values the low-precision call sees, and the reference too
    ref = cg.per_sample_grad_norms(x.double(), (16, 8, 3, 3), gy.double(), padding=1, method="unfold")
    got = cg.per_sample_grad_norms(x, (16, 8, 3, 3), gy, padding=1, method=method)
    assert got.dtype == dtype and torch.isfinite(got).all()
    assert ((got.double() - ref).abs() <= HALF_TOL[dtype] * ref).all(), (got, ref)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_bias_norms_accumulate_wide(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A conv whose bias gradient carries the norm (768, whose square float16 cannot hold): the bias's squares
    accumulate in float32 too, in per_sample_grad_norms and in PerSampleGrads."""
    x = torch.full((3, 2, 8, 8), 0.01, dtype=dtype)
    gy = torch.full((3, 16, 8, 8), 3.0, dtype=dtype)  # each bias entry 192; 16 of them: a norm of 768
    ref = cg.per_sample_grad_norms(x.double(), (16, 2, 1, 1), gy.double())
    assert 700 < float(ref[0]) < 800
    for method in ("ghost", "unfold"):
        got = cg.per_sample_grad_norms(x, (16, 2, 1, 1), gy, method=method)
        assert ((got.double() - ref).abs() <= HALF_TOL[dtype] * ref).all(), (method, got)
    conv = nn.Conv2d(2, 16, 1).to(dtype)
    for method, norms_only in (("unfold", False), ("unfold", True), ("ghost", True)):
        monkeypatch.setattr(rules.tuning, "method_for", lambda spec, x, y, purpose, store=False, m=method: (
            "unfold" if purpose == "grads" else m))
        with cg.PerSampleGrads(conv, loss_reduction="sum", norms_only=norms_only) as psg:
            (conv(x) * 3.0).sum().backward()
        got = psg.norms()
        assert torch.isfinite(got).all() and ((got.double() - ref).abs() <= HALF_TOL[dtype] * ref).all(), got


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_tuned_depthwise_layer_with_a_1x1_output_clips_without_a_key_error(tuned: None, norms_only: bool) -> None:
    """Regression (issue 38, F3): where storing is allowed, raced() drops "unfold" for "unfold+store", yet the
    tuning took "unfold" as its reference and raised KeyError: 'unfold' in the backward (efficientnet_b0,
    mobilenetv3, convnext_atto at 32x32: their depthwise convs reach a 1x1 output)."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Flatten(), nn.Linear(8, 2)).to(DT)
    _check_against_the_loop(model, torch.randn(4, 8, 3, 3, dtype=DT), norms_only)
