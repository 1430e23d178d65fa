"""The fft backend's fused backward (issue 28): both gradients in one pass, grad_output's spectrum made once per chunk.

Each test counts the calls of ``fft.execute_backward`` (the ``fused`` fixture), so that what it checks is the fused
pass and not the two single-gradient paths it falls back to (batch 0, a dense layer sliced by kernel rows).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import convgrad as cg
from convgrad import tuning
from convgrad.backends import auto, fft, get_backend
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec
from convgrad.tuning import tuner
from helpers import Case, assert_gradchecks, grid_cases, make_tensors
from test_fft import LARGE, ROW_CHUNKED

NORMWISE_F64 = 1e-10
Grads = tuple[torch.Tensor, torch.Tensor]


@pytest.fixture
def fused(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of the fused pass from here on (each still runs)."""
    calls: list[int] = []
    real = fft.execute_backward

    def counted(*a: object) -> Grads:
        calls.append(1)
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(fft, "execute_backward", counted)
    return calls


def _both(case: Case, t: dict[str, torch.Tensor], backend: str) -> Grads:
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, case.stride, case.padding,
                                 case.dilation, case.transposed, case.output_padding, case.groups,
                                 output_mask=(True, True, False), backend=backend)
    return gi, gw


def _shares(case: Case) -> bool:
    spec = case.spec()
    return fft.shares_spectra(fft.plan(spec, "grad_input"), fft.plan(spec, "grad_weight"))


def _assert_equals_native(case: Case, t: dict[str, torch.Tensor]) -> None:
    ours, ref = _both(case, t, "fft"), _both(case, t, "native")
    for name, a, b in zip(("grad_input", "grad_weight"), ours, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, (str(case), name)
        if b.numel() and b.norm() > 0:
            err = float((a - b).norm() / b.norm())
            assert err <= NORMWISE_F64, f"{case}: {name} normwise error {err:.2e}"
        else:
            assert not a.any(), f"{case}: {name} must be zero"


# the grid's tiny shapes run in about a second: the fast tier has them all (batch 0 falls back to the single paths)
@pytest.mark.parametrize("case", grid_cases() + LARGE, ids=str)
def test_fused_backward_equals_natives_both_gradients_float64(case: Case, fused: list[int]) -> None:
    _assert_equals_native(case, make_tensors(case))
    assert len(fused) == (case.spec().batch > 0), "the fused pass serves every non-empty batch of these layers"


@pytest.mark.parametrize("case", [c for c in grid_cases() if c.name.endswith((
    "groups2-cin4", "-depthwise", "stride2-op1", "dilation2-stride2", "asym-padding", "batch1"))] + LARGE[5:12:3],
    ids=str)
def test_fused_backward_complex_follows_torchs_conjugate_convention(case: Case, fused: list[int]) -> None:
    """Complex data: conj(weight) for grad_input and conj(input) for grad_weight, and ~Y a flip and roll of the one
    spectrum of grad_output (not a conj)."""
    t = {k: torch.complex(v, v.flip(0) if v.dim() else v) for k, v in make_tensors(case).items()}
    _assert_equals_native(case, t)
    assert fused == [1]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", [LARGE[0], LARGE[10]], ids=str)
def test_fused_backward_half_precision_runs_in_float32(case: Case, dtype: torch.dtype, fused: list[int]) -> None:
    t = make_tensors(case, dtype)
    ours = _both(case, t, "fft")
    ref = _both(case, {k: v.float() for k, v in t.items()}, "native")
    for a, b in zip(ours, ref):
        assert a.dtype == dtype and float((a.float() - b).norm() / b.norm()) < 1e-2
    assert fused == [1]


CHUNKED = [
    Case((5, 6, 14, 14), (6, 2, 9, 9), stride=2, padding=4, groups=3, name="2d-grouped-strided"),
    Case((5, 4, 30), (4, 1, 11), padding=((6, 3),), groups=4, name="1d-depthwise"),
    Case((5, 6, 11, 12), (6, 2, 7, 7), stride=2, padding=3, groups=3, transposed=True, output_padding=1,
         name="transposed-strided-op1"),
    Case((5, 4, 20), (4, 1, 7), padding=2, groups=4, transposed=True, name="transposed-depthwise"),  # B = 1
]


@pytest.mark.parametrize("case", CHUNKED, ids=lambda c: c.name)
def test_fused_backward_in_several_chunks_of_groups_and_samples(case: Case, fused: list[int],
                                                                fft_plan_constants: Callable[..., None]) -> None:
    """A tiny budget: several chunks of groups, or of samples; each chunk's spectrum of grad_output feeds both
    gradients of that chunk, real and complex."""
    # grad_weight's own cap (twice native's scratch) must not cut its samples below grad_input's: with a budget of 1
    # it would (a depthwise budget holds the smaller side, 5 samples; the cap 4), and the plans would not share
    fft_plan_constants(CHUNK_MIN_REALS=1, WEIGHT_SCRATCH_RATIO=2**40)
    spec = case.spec()
    p = fft.plan(spec, "grad_input")
    assert p.chunks[0] < spec.groups or p.chunks[1] < spec.batch, p.chunks
    assert _shares(case)
    t = make_tensors(case)
    _assert_equals_native(case, t)
    _assert_equals_native(case, {k: torch.complex(v, v.flip(0) if v.dim() else v) for k, v in t.items()})
    assert fused == [1, 1]


@pytest.mark.parametrize("case", ROW_CHUNKED[:3], ids=lambda c: c.name)
def test_a_layer_sliced_by_kernel_rows_falls_back_to_the_two_single_paths(
        case: Case, fused: list[int], fft_plan_constants: Callable[..., None]) -> None:
    fft_plan_constants(CHUNK_MIN_REALS=1)
    assert fft.plan(case.spec(), "grad_input").row_chunk < case.spec().y_channels // case.groups
    assert not _shares(case)
    _assert_equals_native(case, make_tensors(case))
    assert fused == []


@pytest.mark.parametrize("xs,ws,kw,transposed", [
    ((2, 4, 5, 6), (4, 2, 3, 3), dict(stride=2, padding=1, groups=2), False),
    ((1, 2, 6, 5), (3, 2, 3, 2), dict(stride=(2, 1), padding=((1, 0), (0, 2)), dilation=(1, 2)), False),
    ((2, 4, 3, 4), (4, 1, 3, 3), dict(stride=2, padding=1, output_padding=1, groups=2), True),
    ((2, 2, 9), (2, 1, 4), dict(stride=2, dilation=2, padding=2, groups=2), False),
])
def test_fused_backward_gradcheck_and_gradgradcheck(xs: tuple[int, ...], ws: tuple[int, ...], kw: dict,
                                                    transposed: bool, fused: list[int]) -> None:
    """Through cg.conv (conv2d, conv1d) and cg.conv_transpose with backend="fft": autograd reaches the fused pass."""
    assert_gradchecks("fft", xs, ws, kw, transposed)
    assert fused, "gradcheck never reached FftBackend.backward's fused pass"


def test_conv2d_backward_reaches_the_fused_pass_once(fused: list[int]) -> None:
    x = torch.randn(2, 4, 12, 12, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 1, 7, 7, dtype=torch.float64, requires_grad=True)
    cg.conv2d(x, w, padding=3, groups=4, backend="fft").square().sum().backward()
    assert fused == [1]
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    torch.nn.functional.conv2d(x2, w2, padding=3, groups=4).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(w.grad, w2.grad, rtol=1e-10, atol=1e-12)


def test_auto_tune_both_offers_ffts_own_backward_on_a_large_depthwise_layer(fused: list[int],
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """fft overrides Backend.backward, so auto screens its own backward for both gradients and can pick it."""
    case = Case((8, 8, 40, 40), (8, 1, 31, 31), padding=15, groups=8, name="depthwise-31x31")
    spec, t = case.spec(), make_tensors(case, torch.float32)
    backend = get_backend("fft")
    assert backend in auto.candidates(spec, t["grad_output"]) and auto._shares_work(backend)
    offered: list[dict[str, object]] = []
    screens = iter([tuner.Screen({"native": 4.0, "fft": 1.0}), tuner.Screen({"native": 4.0, "fft": 1.0}),
                    tuner.Screen({"native": 8.0, "fft": 1.5})])

    def screen(options: dict[str, object], *a: object, **k: object) -> tuner.Screen:
        offered.append(options)
        return next(screens)

    monkeypatch.setattr(tuning, "screen", screen)
    choice = auto._tune_both(spec, t["grad_output"], t["input"], t["weight"])
    assert "fft" in offered[2], sorted(offered[2])
    gi, gw = offered[2]["fft"](4)  # type: ignore[operator]  # the option: fft's own backward on 4 samples
    assert fused == [1] and gi.shape == (4, 8, 40, 40) and gw.shape == (8, 1, 31, 31)
    assert choice.backend == "fft"


def test_fft_execute_and_execute_backward_refuse_mismatched_plans_and_shapes_with_a_value_error() -> None:
    """Swapped plans ran silently through the wrong pass, plans of a dense layer sliced by kernel rows failed with an
    AttributeError deep in the product, and a tensor of another shape in a reshape: each is a ValueError naming the
    function and the parameter."""
    spec = ConvSpec.from_shapes((2, 4, 30), (4, 1, 9), padding=4, groups=4)
    pi, pw = fft.plan(spec, "grad_input"), fft.plan(spec, "grad_weight")
    gy, x, w = torch.randn(2, 4, 30), torch.randn(2, 4, 30), torch.randn(4, 1, 9)
    kernel_7 = fft.plan(ConvSpec.from_shapes((2, 4, 30), (4, 1, 7), padding=3, groups=4), "grad_weight")
    dense = ConvSpec.from_shapes((2, 64, 28, 28), (64, 64, 31, 31), padding=15)
    sliced = fft.plan(dense, "grad_input"), fft.plan(dense, "grad_weight")
    for a, b in [(pw, pi), (pi, kernel_7), sliced]:
        with pytest.raises(ConvgradValueError, match=r"fft\.execute_backward: pi="):
            fft.execute_backward(a, b, gy, x, w)
    with pytest.raises(ConvgradValueError, match=r"fft\.execute_backward: weight.shape=\(4, 1, 7\)"):
        fft.execute_backward(pi, pw, gy, x, w[..., :7])
    with pytest.raises(ConvgradValueError, match=r"fft\.execute: data.shape=\(2, 4, 29\)"):
        fft.execute(pi, gy[..., :29], w)
    with pytest.raises(ConvgradValueError, match=r"fft\.execute: other.shape=\(2, 4, 29\)"):
        fft.execute(pw, x, gy[..., :29])
