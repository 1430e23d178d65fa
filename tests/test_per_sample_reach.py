"""PerSampleGrads reaches every trainable parameter however it reaches its layer (issue 38), and its state belongs to
its context (issue 40): float64, against a loop over single samples. The layer patterns are tests/patterns.py's
small copies of timm's; timm itself runs in the full tier (tests/test_timm.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convgrad as cg
from helpers import TOL, assert_matches_autograd, assert_per_sample_matches_the_loop, per_sample_loop
from patterns import Block, LayerNorm2d, LayerScale, LoRALinear, ModulatedConv, ScaledStdConv, TimmLinear, network

DT = torch.float64

pytestmark = pytest.mark.usefixtures("one_thread")


def _loss(out: torch.Tensor) -> torch.Tensor:
    """A summed loss whose per-sample part depends on every output."""
    out = out.flatten(1)
    return ((out * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype)).sum(1) + out.square().sum(1)).sum()


def _loop(model: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    return per_sample_loop(model, _loss, *inputs)


def _check(model: nn.Module, inputs: tuple[torch.Tensor, ...], norms_only: bool) -> cg.PerSampleGrads:
    return assert_per_sample_matches_the_loop(model, inputs, _loss, norms_only)


@pytest.mark.parametrize("patched", [False, True])
@pytest.mark.parametrize("norms_only", [False, True])
def test_every_parameter_of_the_patterns_network_matches_the_loop(norms_only: bool, patched: bool) -> None:
    """Before issue 38: TimmLinear, LayerNorm2d, the subclasses and the block's gamma were refused; once patched,
    StdConv's per-sample gradients were off by 0.85 and SameConv raised a reshape's RuntimeError."""
    torch.manual_seed(0)
    model = network().to(DT)
    if patched:
        cg.patch(model, backend="fwdconv")
    psg = _check(model, (torch.randn(3, 3, 12, 12, dtype=DT),), norms_only)
    how = psg.report()
    assert how["0.weight"] == "conv2d"  # SameConv: its own forward's F.conv2d
    assert how["2.weight"] == how["3.weight"] == "conv2d through a transform (its weight computed from it)"
    assert how["3.gain"] == "conv2d through a transform (its weight computed from it)"
    assert how["5.gamma"] == "rerun of module '5' (Block) per sample (mul)"
    assert how["6.gamma"] == "rerun of module '6' (LayerScale) per sample (mul)"
    assert how["5.norm.weight"] == "layer_norm" and how["9.weight"] == "linear"
    assert how["11.a"] == how["11.b"] == "linear through a transform (its weight computed from it)"


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_parameter_used_in_a_rule_and_outside_one_in_the_same_forward_counts_once(norms_only: bool) -> None:
    """The block's gamma is rerun per sample; a rule inside the same forward that reads gamma must not add its
    own share again (the rerun's gradient already holds it)."""

    class Both(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.layer_norm(x * self.gamma, (4,), self.gamma, None)

    torch.manual_seed(1)
    _check(nn.Sequential(nn.Linear(3, 4), Both()).to(DT), (torch.randn(3, 3, dtype=DT),), norms_only)


@pytest.mark.parametrize("norms_only", [False, True])
def test_embeddings_rms_norm_and_functional_batch_norm_have_rules(norms_only: bool) -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(7, 4, padding_idx=2)
            self.norm = nn.RMSNorm(4)
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 4))
            self.register_buffer("mean", torch.linspace(-0.2, 0.2, 4))
            self.register_buffer("var", torch.linspace(0.5, 1.5, 4))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            h = self.norm(self.emb(idx))  # (N, P, 4)
            return F.batch_norm(h.transpose(1, 2), self.mean, self.var, self.weight, None, False)

    torch.manual_seed(2)
    idx = torch.randint(0, 7, (4, 5))
    idx[0, :2] = 2  # padding_idx: no gradient
    idx[1] = 3  # one index repeated: the ghost norm's cross terms
    psg = _check(Net().to(DT), (idx,), norms_only)
    assert psg.report() == {"emb.weight": "embedding", "norm.weight": "rms_norm", "weight": "batch_norm"}


@pytest.mark.parametrize("norms_only", [False, True])
def test_a_modulated_conv_that_folds_the_batch_is_rerun_per_sample(norms_only: bool) -> None:
    """StyleGAN's modulated conv: its weight meets the samples' styles in a multiplication, so the module runs
    again per sample (a batch of one folds nothing); the affine's linear keeps its rule."""
    torch.manual_seed(6)
    model = ModulatedConv(4, 3, 3, 5).to(DT)
    psg = _check(model, (torch.randn(3, 4, 6, 6, dtype=DT), torch.randn(3, 5, dtype=DT)), norms_only)
    assert psg.report() == {"weight": "rerun of module '(the model itself)' (ModulatedConv) per sample (mul)",
                            "affine.weight": "linear", "affine.bias": "linear"}


@pytest.mark.parametrize(("module", "match"), [
    (nn.Sequential(nn.Dropout(0.5), LayerScale(3)), None),  # the dropout is outside the module rerun: accepted
    (nn.Sequential(Block(3)).train(), None),
])
def test_a_rerun_module_outside_its_random_numbers_is_accepted(module: nn.Module, match: str | None) -> None:
    x = torch.randn(2, 3, 4, 4, dtype=DT)
    with cg.PerSampleGrads(module.to(DT)) as psg:
        _loss(module(x)).backward()
    assert psg.norms().shape == (2,)


def test_what_a_rerun_cannot_see_is_refused_by_name() -> None:
    class Dropped(LayerScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.dropout(super().forward(x), 0.5, self.training)

    class Pair(LayerScale):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
            return super().forward(x), x

    class InPlace(LayerScale):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = super().forward(x)
            x.zero_()
            return out

    x = torch.randn(2, 3, 4, 4, dtype=DT)
    cases = [(Dropped(3), r"module '\(the model itself\)' \(Dropped\) must run its forward again per sample for "
                          r"parameters \['gamma'\] \(they meet the samples in mul, .*draws random numbers \(dropout\)"),
             (Pair(3), r"returns tuple, not one tensor"),
             (InPlace(3), r"changes its input in place")]
    for module, match in cases:
        with pytest.raises(ValueError, match=match), cg.PerSampleGrads(module.to(DT)):
            module(x.clone())
    Dropped(3).eval()  # eval mode: no random numbers, accepted
    module = Dropped(3).to(DT).eval()
    with cg.PerSampleGrads(module) as psg:
        _loss(module(x)).backward()
    assert psg.norms().shape == (2,)


# ---- state belongs to its context (issue 40, item 5) --------------------------------------------------------------
def test_a_context_never_entered_reports_nothing_of_another_contexts_batch() -> None:
    """Regression: cg.PerSampleGrads(m).norms() of a new object returned the previous context's norms, and
    clip_and_accumulate clipped with them."""
    model = nn.Linear(3, 2).to(DT)
    with cg.PerSampleGrads(model):
        _loss(model(torch.randn(4, 3, dtype=DT))).backward()
    fresh = cg.PerSampleGrads(model)
    with pytest.raises(RuntimeError, match="this context recorded no per-sample gradient"):
        fresh.norms()
    with pytest.raises(RuntimeError, match="this context recorded no per-sample gradient"):
        fresh.clip_and_accumulate(1.0)
    assert model.weight.grad_sample is not None  # building a context leaves the last one's results alone


@pytest.mark.parametrize("norms_only", [False, True])
def test_two_models_and_two_contexts_interleaved_keep_their_own_samples(norms_only: bool) -> None:
    torch.manual_seed(3)
    a, b = nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(9, 2)).to(DT), TimmLinear(4, 2).to(DT)
    xa, xb = torch.randn(3, 2, 5, dtype=DT), torch.randn(5, 4, dtype=DT)
    ref_a, ref_b = _loop(a, xa), _loop(b, xb)
    psg_a = cg.PerSampleGrads(a, loss_reduction="sum", norms_only=norms_only)
    psg_b = cg.PerSampleGrads(b, loss_reduction="sum", norms_only=norms_only)
    with psg_a:
        out_a = _loss(a(xa))
        with psg_b:
            _loss(b(xb)).backward()
        out_a.backward()
    for psg, ref in ((psg_a, ref_a), (psg_b, ref_b)):
        norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
        torch.testing.assert_close(psg.norms(), norms, **TOL[DT])
    with psg_b:  # b's next batch: a's results stay a's
        _loss(b(xb[:2])).backward()
    assert psg_a.norms().shape == (3,) and psg_b.norms().shape == (2,)


# ---- no_weight_gradients (issue 40, item 6) -----------------------------------------------------------------------
@pytest.mark.parametrize("scope", ["forward", "backward"])
@pytest.mark.parametrize("norms_only", [False, True])
def test_no_weight_gradients_holds_inside_per_sample_grads(scope: str, norms_only: bool) -> None:
    """Regression: PerSampleGrads inside no_weight_gradients() still wrote the conv weights' gradients."""
    model = nn.Sequential(nn.Conv2d(2, 3, 3), ScaledStdConv(3, 2, 1), nn.Flatten(), nn.Linear(2 * 9, 2)).to(DT)
    x = torch.randn(3, 2, 5, 5, dtype=DT)
    with cg.PerSampleGrads(model, norms_only=norms_only) as psg:
        if scope == "forward":
            with cg.no_weight_gradients():
                loss = _loss(model(x))
            loss.backward()
        else:
            loss = _loss(model(x))
            with cg.no_weight_gradients():
                loss.backward()
    psg.clip_and_accumulate(1.0)
    for k, p in model.named_parameters():
        skipped = k in ("0.weight", "1.weight", "1.gain")  # the convs' weight operands
        assert (p.grad_sample is None) == (skipped or norms_only), k
        assert bool(p.grad.abs().sum() == 0) == skipped, k  # clipped sums: zeros added where nothing came


# ---- torch.compile (issue 40, item 1) ------------------------------------------------------------------------------
@pytest.mark.slow  # torch.compile: Dynamo
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_compiled_forward_inside_the_context_is_refused_and_leaves_the_model_as_it_was(fullgraph: bool) -> None:
    """Regression: around torch.compile(m), Dynamo traced the context's hooks, a graph break lost track of the
    swapped parameters, and every later layer got no per-sample gradient, was left out of the norms, and kept
    detached plain tensors as its parameters, so the optimizer never trained it again. No error."""
    torch._dynamo.reset()
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.ReLU(), nn.Conv2d(3, 2, 3)).to(DT)
    x = torch.randn(4, 2, 6, 6, dtype=DT)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(Exception, match=r"torch\.compile") as raised, cg.PerSampleGrads(model):
        torch.compile(model, fullgraph=fullgraph)(x).sum().backward()
    # eager after a graph break: our ValueError itself; traced (fullgraph): Dynamo's error, caused by ours
    chain = [raised.value, raised.value.__cause__]
    assert any("per-sample gradients are captured from the eager forward" in str(e) for e in chain)
    assert all(p is q and type(p) is nn.Parameter for p, q in zip(model.parameters(), params, strict=True))
    assert optimizer.param_groups[0]["params"] == params
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    ref = _loop(model, x)
    with cg.PerSampleGrads(model, loss_reduction="sum") as psg:  # the eager forward, afterwards: exact
        _loss(model(x)).backward()
    torch.testing.assert_close(psg.norms(), torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1),
                               **TOL[DT])


def test_a_reparametrised_lora_linear_and_a_copy_share_nothing() -> None:
    """Two copies of a model with a transform (LoRA): each context pulls back through its own forward's graph."""
    torch.manual_seed(5)
    model = nn.Sequential(LoRALinear(3, 4, 2), nn.Tanh(), LayerNorm2d(4) if False else nn.Linear(4, 2)).to(DT)
    twin = copy.deepcopy(model)
    x = torch.randn(3, 3, dtype=DT)
    ref = _loop(model, x)
    for m in (model, twin):
        with cg.PerSampleGrads(m, loss_reduction="sum"):
            _loss(m(x)).backward()
        assert_matches_autograd({k: p.grad_sample for k, p in m.named_parameters() if p.requires_grad}, ref, DT,
                                "LoRA")
