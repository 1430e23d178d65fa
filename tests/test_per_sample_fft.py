"""Per-sample weight gradients and norms by the convolution theorem (method "fft"), float64 against a loop of torch
autograd over single samples; its chunks, its cost model and its place in the per-sample race."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import convgrad as cg
from convgrad.backends import get_backend
from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft import per_sample as fft
from convgrad.per_sample import methods, tuning
from helpers import TOL, Case, layer_case, make_tensors, per_sample_reference

DT = torch.float64
NORMWISE = 1e-10  # issue 28: float64 within 1e-10 of autograd, normwise


pytestmark = pytest.mark.usefixtures("one_thread")


# the grid, on kernels large enough for fft to be worth it, and small ones (the method serves every layer)
GRID = [
    layer_case("1d-depthwise-long", 3, 3, (40,), (17,), groups=3, padding=8),
    layer_case("2d-depthwise-9x9", 4, 4, (12, 11), (9, 9), groups=4, padding=4),
    layer_case("2d-stride3-rows-unread", 2, 3, (14, 13), (5, 4), stride=3, padding=1),
    layer_case("2d-groups2-of-3", 6, 4, (10, 9), (5, 5), groups=2, padding=2),
    layer_case("2d-depthwise-multiplier", 3, 6, (11, 10), (7, 3), groups=3, padding=(3, 1)),
    layer_case("2d-dilation2-stride2", 2, 4, (15, 14), (4, 3), stride=2, dilation=2, padding=1),
    layer_case("2d-asym-padding", 3, 3, (9, 10), (6, 5), stride=(2, 1), padding=((0, 4), (3, 1)), groups=3),
    layer_case("3d-groups2", 4, 2, (5, 6, 5), (3, 4, 3), groups=2, padding=(1, 2, 1), stride=(1, 2, 1)),
    layer_case("T1d-output-padding-dilation", 2, 4, (6,), (5,), transposed=True, stride=3, dilation=2,
               output_padding=2),
    layer_case("T2d-output-padding-groups2", 4, 6, (4, 5), (5, 4), transposed=True, stride=2, padding=1,
               output_padding=1, groups=2),
    layer_case("batch1", 2, 3, (9, 9), (7, 7), batch=1, padding=3),
    layer_case("batch0", 2, 3, (9, 9), (7, 7), batch=0, stride=2),
]


def _kw(case: Case) -> dict[str, object]:
    return dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups,
                transposed=case.transposed, output_padding=case.output_padding)


def _normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-300)) if b.numel() else 0.0


def _check(case: Case) -> None:
    t = make_tensors(case)
    ref = per_sample_reference(case, t)
    gw = cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"], method="fft", **_kw(case))
    assert gw.shape == ref.shape and gw.dtype == DT
    torch.testing.assert_close(gw, ref, **TOL[DT], msg=lambda m: f"{case} grads: {m}")
    assert _normwise(gw, ref) <= NORMWISE, case
    norms = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, method="fft",
                                     **_kw(case))
    torch.testing.assert_close(norms, ref.flatten(1).norm(dim=1), **TOL[DT], msg=lambda m: f"{case} norms: {m}")


@pytest.mark.parametrize("case", GRID, ids=str)
def test_fft_per_sample_grads_and_norms_match_a_loop_of_autograd(case: Case) -> None:
    _check(case)


@pytest.mark.parametrize("sizes", [(1, 1, 1), (2, 2, 1), (1, 3, 2)], ids=str)
@pytest.mark.parametrize("case", [GRID[3], GRID[4], GRID[6], GRID[9]], ids=str)
def test_every_chunk_of_samples_groups_and_channels_lands_in_its_place(case: Case, sizes: tuple[int, int, int],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of (groups, samples, y channels) cut the work (``chunking.per_sample_chunks``); each chunk's
    gradients and norms go to their own samples, groups and channels."""
    calls: list[tuple[int, int, int]] = []
    monkeypatch.setattr(chunking, "per_sample_chunks", lambda spec, p, budget: calls.append(sizes) or sizes)
    _check(case)
    assert calls  # the chunk sizes were taken from the spec


def test_float32_and_half_precision_accumulate_in_float32() -> None:
    case = GRID[1]
    t = make_tensors(case)
    ref = per_sample_reference(case, t).flatten(1).norm(dim=1)
    for dtype, rtol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        got = cg.per_sample_grad_norms(t["input"].to(dtype), case.weight_shape, t["grad_output"].to(dtype),
                                       bias=False, method="fft", **_kw(case))
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=0)


# ---- memory: norms never hold N x weight --------------------------------------------------------------------------
def _peak_bytes() -> object:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "large_kernels.py"
    spec = importlib.util.spec_from_file_location("large_kernels_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.peak_bytes


def test_fft_norms_of_a_large_kernel_take_less_memory_than_the_plain_backward(monkeypatch: pytest.MonkeyPatch
                                                                              ) -> None:
    """A 31x31 depthwise layer (RepLKNet's, 16 channels, batch 8, float32): per-sample norms peak below the layer's
    plain backward (native grad_input and grad_weight) and below N x weight, which they never hold. unfold and
    ghost would copy 961 x the input per sample (benchmarks/per_sample_memory.py has the full-size layers)."""
    peak_bytes = _peak_bytes()
    # the budget a quarter of the layer's sides, as on a full-size layer, where that quarter is over the floor
    monkeypatch.setattr(chunking, "CHUNK_MIN_REALS", 0)
    spec = cg.ConvSpec.from_shapes((8, 16, 28, 28), (16, 1, 31, 31), padding=15, groups=16)
    x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
    plain = peak_bytes(lambda: get_backend("native").gradients(spec, gy, x, w, True, True))
    norms = peak_bytes(lambda: cg.per_sample_grad_norms(x, w.shape, gy, padding=15, groups=16, method="fft"))
    all_grads = spec.batch * w.numel() * w.element_size()
    assert norms <= plain and norms < all_grads, (norms, plain, all_grads)  # type: ignore[operator]


# ---- the cost model and the race ------------------------------------------------------------------------------------
RESNET18 = [cg.ConvSpec.from_shapes((32, 3, 32, 32), (64, 3, 3, 3), padding=1),
            cg.ConvSpec.from_shapes((32, 64, 32, 32), (64, 64, 3, 3), padding=1),
            cg.ConvSpec.from_shapes((32, 128, 16, 16), (256, 128, 3, 3), stride=2, padding=1),
            cg.ConvSpec.from_shapes((32, 256, 8, 8), (512, 256, 1, 1), stride=2),
            cg.ConvSpec.from_shapes((8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3)]  # the ImageNet stem
LARGE = cg.ConvSpec.from_shapes((8, 16, 28, 28), (16, 1, 31, 31), padding=15, groups=16)


@pytest.mark.parametrize("purpose", tuning.PURPOSES)
def test_small_kernels_never_consider_fft(purpose: str) -> None:
    """ResNet-18's layers (and a 7x7 stem) do not even estimate fft: their first per-sample step is unchanged."""
    for spec in RESNET18:
        for store in (False, True):
            assert not any(k.startswith("fft") for k in tuning.estimates(spec, purpose, store)), spec
        assert methods.choose_method(spec, norms=purpose != "grads") != "fft"


@pytest.mark.parametrize("purpose", tuning.PURPOSES)
def test_a_large_depthwise_kernel_races_fft_alone(purpose: str) -> None:
    """On a 31x31 depthwise layer fft's estimate is the cheapest by more than the prune factor: every other option is
    pruned before any timing, and the cost model (fixed mode) picks it."""
    from convgrad.tuning.tuner import prune

    store = purpose == "clip"
    est = tuning.estimates(LARGE, purpose, store)
    best = "fft+store" if store else "fft"
    assert min(est, key=est.__getitem__) == best
    dropped = prune(est, keep=(best,))
    assert [n for n in tuning.raced(LARGE, purpose, store) if n not in dropped] == [best]
    assert methods.choose_method(LARGE, norms=purpose != "grads") == "fft"


def test_fft_estimate_follows_its_transforms_and_products() -> None:
    """The estimate counts 3 transforms and one product per (sample, channel) of a depthwise layer."""
    dims = sizing.phases(LARGE)
    v = dims[0].size * dims[1].size
    bins = dims[0].size * (dims[1].size // 2 + 1)
    pairs = LARGE.batch * LARGE.y_channels
    expected = 2.5 * v * math.log2(v) * 3 * pairs + 6.0 * pairs * bins
    assert fft.estimate_flops(LARGE) == pytest.approx(expected)


def test_tuning_a_large_kernel_picks_fft_for_every_purpose(tuned: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race (auto's tuning mode) picks fft on the 31x31 layer and remembers it, running nothing but fft (where
    the cost model prunes every other option, fft is chosen untimed and nothing runs at all)."""
    spec = LARGE.with_batch(3)
    x, y = torch.randn(spec.x_shape, dtype=DT), torch.randn(spec.y_shape, dtype=DT)
    ran: list[str] = []
    real_grads, real_norms = methods.weight_grad, methods.materialised_sq_norms
    monkeypatch.setattr(methods, "weight_grad", lambda s, a, b, m: ran.append(m) or real_grads(s, a, b, m))
    monkeypatch.setattr(methods, "materialised_sq_norms", lambda s, a, b, m: ran.append(m) or real_norms(s, a, b, m))
    for purpose, store, best in (("grads", False, "fft"), ("norms", False, "fft"), ("clip", True, "fft+store"),
                                 ("clip", False, "fft")):
        assert tuning.method_for(spec, x, y, purpose, store) == best
        assert set(ran) <= {"fft"}, (purpose, store, ran)  # unfold's im2col would be 961 x the input per sample
        ran.clear()
    assert tuning.chosen(spec, "norms", x).backend == "fft"  # type: ignore[union-attr]


def test_a_dp_step_of_a_large_kernel_net_clips_like_a_loop(tuned: None) -> None:
    """PerSampleGrads (norms_only, clip) on a net with a 31x31 depthwise conv: fft is chosen for it (the others are
    pruned by the cost model, so no timing decides) and the clipped sum equals the loop's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.Conv2d(4, 4, 31, padding=15, groups=4), nn.Tanh(),
                          nn.Flatten(), nn.Linear(4 * 28 * 28, 3)).to(DT)
    x, y = torch.randn(5, 2, 28, 28, dtype=DT), torch.randint(0, 3, (5,))
    loop = [torch.autograd.grad(nn.functional.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
            for i in range(5)]
    per = [torch.stack([g[j] for g in loop]) for j in range(len(loop[0]))]
    norms = torch.cat([g.flatten(1) for g in per], 1).norm(dim=1)
    factors = (float(norms.median()) / (norms + 1e-6)).clamp(max=1.0)
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    got = psg.clip_and_accumulate(float(norms.median()))
    torch.testing.assert_close(got, norms, **TOL[DT])
    for p, g in zip(model.parameters(), per, strict=True):
        torch.testing.assert_close(p.grad, torch.tensordot(factors, g, dims=1), **TOL[DT])
    spec = cg.ConvSpec.from_shapes((5, 4, 28, 28), (4, 1, 31, 31), padding=15, groups=4)
    choice = tuning.chosen(spec, "clip", x, store=True) or tuning.chosen(spec, "clip", x)
    assert choice is not None and choice.backend.startswith("fft"), choice
