"""The fft backend: normwise float64 agreement on the grid and on large kernels, gradcheck/gradgradcheck, complex,
half precision, chunking, its geometry (fft.sizing, fft.chunking), and auto's pruning."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad.backends import auto, fft, get_backend
from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft import transforms as fft_transforms
from convgrad.backends.fft.execute import run
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import crop
from helpers import Case, assert_gradchecks, grid_cases, make_tensors, random_cases, reference_forward, reference_grads

NORMWISE_F64 = 1e-10


def _normwise(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours - ref).norm() / max(float(ref.norm()), 1e-300))


def _ours(case: Case, t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, transposed=case.transposed,
                                 backend="fft", output_mask=(True, True, False),
                                 **{**case.kwargs(), "output_padding": case.output_padding})
    return gi, gw


def _assert_normwise(case: Case, dtype: torch.dtype = torch.float64, bound: float = NORMWISE_F64) -> None:
    t = make_tensors(case, dtype)
    ref = reference_grads(case, t)
    gi, gw = _ours(case, t)
    for name, ours in (("grad_input", gi), ("grad_weight", gw)):
        assert ours.shape == ref[name].shape and ours.dtype == ref[name].dtype, name
        if ref[name].numel() and ref[name].norm() > 0:
            err = _normwise(ours, ref[name])
            assert err <= bound, f"{case}: {name} normwise error {err:.2e} > {bound:.0e}"
        else:
            assert not ours.any(), f"{case}: {name} must be zero"


LARGE = [
    Case((2, 6, 30, 30), (6, 1, 13, 13), padding=6, groups=6, name="depthwise-13x13"),
    Case((2, 4, 21, 25), (4, 1, 11, 5), padding=(5, 2), groups=4, name="depthwise-11x5"),
    Case((2, 4, 40), (4, 1, 33), padding=16, groups=4, name="1d-depthwise-k33"),
    Case((2, 8, 40), (8, 2, 17), padding=8, groups=4, name="1d-grouped-k17"),  # A*B = 4: the broadcast product
    Case((2, 12, 40), (12, 4, 17), padding=8, groups=3, name="1d-grouped-4-per-group"),  # A*B = 16: the matmul
    Case((3, 6, 29, 31), (6, 1, 9, 9), stride=2, padding=((4, 3), (2, 5)), groups=6, name="dw-stride2-asym"),
    Case((2, 4, 33), (4, 2, 9), stride=3, dilation=2, padding=5, groups=2, name="1d-stride3-dilation2"),
    Case((2, 3, 26), (2, 3, 7), stride=2, dilation=4, padding=1, name="1d-stride2-dilation4"),  # gcd 2: 1 live phase
    Case((2, 2, 30, 13), (3, 2, 5, 2), stride=(4, 6), dilation=(2, 4), padding=3, name="2-of-4-live-phases"),
    Case((2, 4, 9, 9, 9), (4, 1, 5, 5, 5), padding=2, groups=4, name="3d-depthwise-5"),
    Case((2, 4, 11, 12), (4, 2, 7, 7), stride=2, padding=3, groups=2, transposed=True, output_padding=1,
         name="transposed-7x7-op1"),
    Case((2, 3, 9), (3, 2, 15), stride=3, padding=2, dilation=2, transposed=True, output_padding=1,
         name="1d-transposed-dilated"),
    # one channel on a side (B = 1 or A = 1): the broadcast products
    Case((2, 1, 200), (6, 1, 31), name="1d-front-end-one-input-channel"),
    Case((2, 4, 40), (1, 4, 17), padding=8, name="1d-one-output-channel"),
    # transform lengths below U: causal (no trailing zeros, L = U), uneven pads, stride with pads
    Case((2, 3, 64), (3, 1, 64), padding=((63, 0),), groups=3, name="1d-causal-k-equals-length"),
    Case((2, 2, 19, 23), (2, 1, 15, 9), padding=((9, 3), (2, 8)), groups=2, name="uneven-pads-15x9"),
    Case((2, 2, 37), (2, 1, 21), stride=3, padding=((13, 10),), groups=2, name="1d-stride3-wide-pads"),
]


# the grid (which test_grid.py also runs element-wise in the fast tier) in the full tier; the large cases in both
GRID = [pytest.param(c, marks=pytest.mark.slow) for c in grid_cases() + random_cases(40, seed=1234)]


@pytest.mark.parametrize("case", GRID + LARGE, ids=str)
def test_fft_within_1e10_normwise_of_autograd_float64(case: Case) -> None:
    _assert_normwise(case)


@pytest.mark.parametrize("case", LARGE[:6], ids=str)
def test_fft_float32_within_its_normwise_bound(case: Case) -> None:
    """float32: normwise error of a few units of roundoff times log2 of the transform size (docs/numerics.md)."""
    sizes = [d.size for d in sizing.phases(case.spec())]
    _assert_normwise(case, torch.float32, 8 * 2.0**-24 * math.log2(math.prod(sizes)) * 4)


def test_fft_forward_matches_torch() -> None:
    for case in LARGE:
        t = make_tensors(case)
        spec = case.spec()
        ours = get_backend("fft").forward(spec, t["input"], t["weight"])
        ref = reference_forward(case, t["input"], t["weight"], None)
        assert _normwise(ours, ref) <= NORMWISE_F64, str(case)


@pytest.mark.parametrize("case", [c for c in grid_cases() if c.name.endswith(("groups2-cin4", "-depthwise",
                                                                               "stride2-op1"))], ids=str)
def test_fft_complex_matches_autograd(case: Case) -> None:
    t = {k: torch.complex(v, v.flip(0) if v.dim() else v) for k, v in make_tensors(case).items()}
    ref = reference_grads(case, t)
    gi, gw = _ours(case, t)
    assert _normwise(gi, ref["grad_input"]) <= NORMWISE_F64
    assert _normwise(gw, ref["grad_weight"]) <= NORMWISE_F64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fft_half_precision_runs_in_float32_and_returns_its_dtype(dtype: torch.dtype) -> None:
    case = LARGE[0]
    t = make_tensors(case, dtype)
    gi, gw = _ours(case, t)
    ref = reference_grads(case, {k: v.double() for k, v in t.items()})
    assert gi.dtype == dtype and gw.dtype == dtype
    assert _normwise(gi.double(), ref["grad_input"]) < 1e-2
    assert _normwise(gw.double(), ref["grad_weight"]) < 1e-2


@pytest.mark.parametrize("xs,ws,kw,transposed", [
    ((2, 4, 5, 6), (4, 2, 3, 3), dict(stride=2, padding=1, groups=2), False),
    ((1, 2, 6, 5), (3, 2, 3, 2), dict(stride=(2, 1), padding=((1, 0), (0, 2)), dilation=(1, 2)), False),
    ((2, 4, 3, 4), (4, 1, 3, 3), dict(stride=2, padding=1, output_padding=1, groups=2), True),
])
def test_fft_gradcheck_and_gradgradcheck(xs: tuple[int, ...], ws: tuple[int, ...], kw: dict, transposed: bool) -> None:
    assert_gradchecks("fft", xs, ws, kw, transposed)


def test_fft_gradcheck_1d_and_3d() -> None:
    assert_gradchecks("fft", (2, 2, 9), (2, 1, 4), dict(stride=2, dilation=2, padding=2, groups=2))
    assert_gradchecks("fft", (1, 1, 4, 3, 4), (2, 1, 2, 2, 3), dict(stride=(1, 2, 1), padding=1))


def test_fft_chunks_over_groups_and_samples_give_the_same_result(fft_plan_constants: Callable[..., None]) -> None:
    """A tiny budget forces several chunks of groups and of samples; the result does not change."""
    case = Case((5, 6, 14, 14), (6, 2, 9, 9), stride=2, padding=4, groups=3, name="chunked")
    t = make_tensors(case)
    whole = _ours(case, t)
    fft_plan_constants(CHUNK_MIN_REALS=1)
    p = fft.plan(case.spec(), "grad_input")
    assert p.chunks[0] < 3 and p.chunks[1] < 5, p.chunks
    for a, b in zip(_ours(case, t), whole):
        assert _normwise(a, b) <= NORMWISE_F64



@pytest.mark.parametrize("case", [Case((5, 1, 40), (6, 1, 9), padding=3, name="1d-one-input-channel"),
                                  Case((4, 3, 10, 10), (3, 1, 5, 4), padding=((2, 1), (1, 2)), groups=3,
                                       name="2d-depthwise")], ids=lambda c: c.name)
def test_fft_forward_in_sample_chunks_shares_one_kernel_spectrum(case: Case, fft_plan_constants: Callable[..., None]
                                                                 ) -> None:
    """Several sample chunks read one kernel spectrum W(-f), its lazy conj resolved once (one x channel per group:
    the broadcast product); real and complex data give torch's forward."""
    fft_plan_constants(CHUNK_MIN_REALS=1)
    spec = case.spec()
    assert fft.plan(spec, "output").chunks[1] < spec.batch
    t = make_tensors(case)
    for x, w in ((t["input"], t["weight"]), (torch.complex(t["input"], t["input"].flip(0)), t["weight"] + 1j)):
        ours = get_backend("fft").forward(spec, x, w)
        assert _normwise(ours, reference_forward(case, x, w, None)) <= NORMWISE_F64, (str(case), x.dtype)


ROW_CHUNKED = [
    Case((3, 6, 20), (7, 6, 9), padding=4, name="1d-dense"),
    Case((1, 5, 13, 11), (6, 5, 5, 4), stride=2, dilation=(1, 2), padding=((2, 1), (3, 0)), name="2d-dense-strided"),
    Case((2, 6, 9), (6, 5, 8), stride=4, padding=2, transposed=True, output_padding=1, name="transposed-up-s4"),
    Case((2, 4, 17), (10, 2, 7), stride=3, padding=3, groups=2, name="grouped-5-rows-per-group"),
    Case((2, 3, 5, 4, 6), (4, 3, 3, 2, 3), padding=1, name="3d-dense"),
]


@pytest.mark.parametrize("case", ROW_CHUNKED, ids=lambda c: c.name)
def test_fft_kernel_spectra_held_a_slice_of_rows_at_a_time_give_the_same_result(
        case: Case, fft_plan_constants: Callable[..., None]) -> None:
    """A tiny budget splits a group's kernel spectra into several chunks of rows (y channels), with samples chunked
    too: the forward and both gradients still match torch autograd in float64 (a dense layer's fft memory, issue 28)."""
    fft_plan_constants(CHUNK_MIN_REALS=1)
    spec = case.spec()
    a = spec.y_channels // spec.groups
    for gradient in ("grad_input", "grad_weight", "output"):
        p = fft.plan(spec, gradient)
        assert 1 <= p.row_chunk < a and p.chunks[0] == 1, (gradient, p.row_chunk, p.chunks)
    _assert_normwise(case)
    t = make_tensors(case)
    ref = reference_forward(case, t["input"], t["weight"], None)
    assert _normwise(get_backend("fft").forward(spec, t["input"], t["weight"]), ref) <= NORMWISE_F64


@pytest.mark.parametrize("case", [ROW_CHUNKED[1], ROW_CHUNKED[2]], ids=lambda c: c.name)
def test_fft_kernel_rows_in_slices_complex(case: Case, fft_plan_constants: Callable[..., None]) -> None:
    """Complex data through the row slices: the reversed spectrum of a complex kernel is a flip and roll, not conj."""
    fft_plan_constants(CHUNK_MIN_REALS=1)
    assert fft.plan(case.spec(), "grad_input").row_chunk < case.spec().y_channels
    t = {k: torch.complex(v, v.flip(0) if v.dim() else v) for k, v in make_tensors(case).items()}
    ref = reference_grads(case, t)
    gi, gw = _ours(case, t)
    assert _normwise(gi, ref["grad_input"]) <= NORMWISE_F64
    assert _normwise(gw, ref["grad_weight"]) <= NORMWISE_F64


def test_fft_kernel_rows_split_evenly_within_the_kernel_budget() -> None:
    """hifigan.up16s8's sizes: one group, A = 512 rows of B = 256 * 8 phases, spectra far over the weight's size:
    the rows held at once fit the chunk budget."""
    spec = ConvSpec.from_shapes((4, 512, 200), (512, 256, 16), stride=8, padding=4, transposed=True)
    p = fft.plan(spec, "grad_weight")
    bins = 2 * (p.sizes[-1] // 2 + 1)
    a, _, b = p.group_channels
    assert (a, b) == (512, 2048)
    budget = chunking.chunk_budget(spec, chunking.CHUNK_MIN_REALS)
    assert 1 <= p.row_chunk < a and p.row_chunk * b * bins <= budget  # a slice within the chunk budget
    depthwise = ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256)
    assert fft.plan(depthwise, "grad_weight").row_chunk == 1  # A = 1: all rows, chunked as before
    assert fft.plan(depthwise, "grad_weight").chunks == chunking.chunks(depthwise, 1,
                                                                        chunking.chunk_budget(depthwise, 1))


def test_fft_plan_lists_its_steps_in_order() -> None:
    spec = ConvSpec.from_shapes((2, 8, 28, 28), (8, 1, 31, 31), stride=2, padding=15, groups=8)
    p = fft.plan(spec, "grad_weight")
    names = [(s.depth, s.name) for s in p.steps]  # x's spectra once per group chunk: the samples are one chunk
    assert names == [(0, "start"), (1, "transform"), (2, "start"), (3, "transform"), (3, "product"), (3, "sum"),
                     (2, "inverse"), (2, "collect"), (0, "taps")]
    assert [loop.name for loop in p.loops] == ["groups", "kernel rows", "samples"] and p.chunks == (8, 2)
    assert fft.plan(spec, "grad_input").steps[-1].shape == spec.input_shape


def test_fft_plan_is_cached_and_a_bad_gradient_still_raises() -> None:
    """plan() runs 2-3 times a backward: a second call returns the very plan of the first (an equal spec built
    afresh too); an unknown gradient raises every time (an lru_cache caches no exception)."""
    spec = ConvSpec.from_shapes((2, 8, 28, 28), (8, 1, 31, 31), stride=2, padding=15, groups=8)
    again = ConvSpec.from_shapes(spec.input_shape, spec.weight_shape, 2, 15, groups=8, memo=False)
    assert again is not spec and fft.plan(spec, "grad_input") is fft.plan(again, "grad_input")
    assert fft.plan(spec, "grad_input") is not fft.plan(spec, "grad_weight")
    for _ in range(2):
        with pytest.raises(ValueError, match=r"fft.plan: gradient='grad_bias' must be one of"):
            fft.plan(spec, "grad_bias")


@pytest.mark.parametrize("case", [LARGE[5], LARGE[8], LARGE[10], LARGE[14]], ids=str)
def test_fft_plan_code_runs_and_gives_what_execute_gives(case: Case) -> None:
    """Each plan's script (its steps' ``code()`` lines, chunk loops and all, as explain shows them) run on real data
    gives exactly what execute() gives: the same calls in the same order. The fused backward's too, both outputs."""
    spec, t = case.spec(), make_tensors(case)
    x, y = (t["grad_output"], t["input"]) if spec.transposed else (t["input"], t["grad_output"])
    given = {"grad_input": (t["grad_output"], t["weight"]), "grad_weight": (x, y), "output": (t["input"], t["weight"])}
    for gradient, (data, other) in given.items():
        p = fft.plan(spec, gradient)
        scope = {**dict(zip(p.inputs, (data, other))), "real": True}
        exec("\n".join(p.code()), scope)
        assert torch.equal(scope["out"], fft.execute(p, data, other)), (str(case), gradient)
    both = fft.backward_plan(spec)
    assert both is not None, str(case)
    scope = {"x": x, "y": y, "w": t["weight"], "real": True}
    exec("\n".join(both.code()), scope)
    ours = fft.execute_backward(both.parts[0], both.parts[1], t["grad_output"], t["input"], t["weight"])
    assert torch.equal(scope["grad_input"], ours[0]) and torch.equal(scope["grad_weight"], ours[1]), str(case)


def test_auto_never_times_fft_on_3x3_and_7x7_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Counted candidates: the cost model leaves fft out of ResNet's 3x3 and ConvNeXt's 7x7 depthwise, and takes it
    in on a 31x31 depthwise layer."""
    calls: list[str] = []
    backend = get_backend("fft")
    for name in ("input_grad", "weight_grad"):
        original = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    with auto.tuning_mode("tune"):
        auto.clear()
        for x, w, kw in [((8, 64, 14, 14), (64, 64, 3, 3), dict(padding=1)),
                         ((8, 96, 14, 14), (96, 1, 7, 7), dict(padding=3, groups=96))]:
            xt = torch.randn(*x, requires_grad=True)
            wt = torch.randn(*w, requires_grad=True)
            cg.conv2d(xt, wt, **kw).sum().backward()
        assert calls == []
        xt, wt = torch.randn(4, 8, 28, 28, requires_grad=True), torch.randn(8, 1, 31, 31, requires_grad=True)
        cg.conv2d(xt, wt, padding=15, groups=8).sum().backward()
        auto.clear()
    assert calls, "fft must be a candidate on a 31x31 depthwise layer"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_check_judges_fft_by_its_normwise_bound_and_fails_a_lossy_inverse(
        dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`convgrad check` passes fft on large, strided and grouped kernels, and fails it when the inverse transform
    loses a column (the mutant)."""
    from convgrad.cli.check import check_config

    configs = [dict(input_size=(2, 4, 20, 20), weight_size=(4, 1, 9, 9), padding=4, groups=4),
               dict(input_size=(2, 4, 31), weight_size=(6, 2, 9), stride=2, dilation=2, padding=3, groups=2)]
    for config in configs:
        _, results = check_config(**config, dtype=dtype, backends=["fft"])
        assert [r.status for r in results] == ["pass"] * 3, results
    inverse = fft_transforms.inverse_transform

    def lossy(t: torch.Tensor, sizes: tuple[int, ...], real: bool, cuts: Any = None) -> torch.Tensor:
        out = inverse(t, sizes, real).clone()  # all L rows, then the cuts
        out[..., [2, sizes[-1] // 2]] = 0  # a kernel slot (grad_weight's crop keeps it) and a data row
        return out if cuts is None else crop(out, cuts)

    monkeypatch.setattr(fft_transforms, "inverse_transform", lossy)
    for config in configs:
        _, results = check_config(**config, dtype=dtype, backends=["fft"])
        assert {r.gradient for r in results if r.failed} == {"grad_input", "grad_weight"}, results


def test_auto_runs_the_forward_through_fft_on_a_large_kernel_and_native_on_3x3(monkeypatch: pytest.MonkeyPatch
                                                                                 ) -> None:
    """convgrad.conv2d with backend="auto" tunes its forward: fft is tried (and its output is torch's) on a 31x31
    depthwise layer, never on a 3x3 one; in "fixed" mode the forward is torch's, bit for bit."""
    calls: list[ConvSpec] = []
    backend = get_backend("fft")
    original = backend.forward  # type: ignore[attr-defined]
    monkeypatch.setattr(backend, "forward", lambda spec, x, w: (calls.append(spec), original(spec, x, w))[1])
    big = (torch.randn(4, 8, 28, 28, dtype=torch.float64), torch.randn(8, 1, 31, 31, dtype=torch.float64),
           torch.randn(8, dtype=torch.float64))
    small = (torch.randn(4, 8, 14, 14), torch.randn(8, 8, 3, 3), None)
    with auto.tuning_mode("tune"):
        auto.clear()
        out = cg.conv2d(small[0], small[1], padding=1)
        assert calls == [] and torch.equal(out, torch.nn.functional.conv2d(small[0], small[1], padding=1))
        for _ in range(8):  # the screening, then the rounds that settle the choice
            out = cg.conv2d(*big, padding=15, groups=8)
            ref = torch.nn.functional.conv2d(*big, padding=15, groups=8)
            assert _normwise(out, ref) <= NORMWISE_F64
        assert calls, "fft's forward must be tried on a 31x31 depthwise layer"
        auto.clear()
    calls.clear()
    with auto.tuning_mode("fixed"):
        assert torch.equal(cg.conv2d(*big, padding=15, groups=8), torch.nn.functional.conv2d(*big, padding=15,
                                                                                              groups=8))
    assert calls == []


def _causal_long_conv() -> tuple[torch.Tensor, torch.Tensor, dict[str, Any]]:
    """A Hyena-style causal long conv (depthwise, 1024 taps, padded on the left only) on an input with a spike of 1e6
    at position 3 (issue 40, item 6)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 8, 1024, generator=g), torch.randn(8, 1, 1024, generator=g) / 32
    x[:, :, 3] = 1e6
    return x, w, dict(padding=((1023, 0),), groups=8)


def test_fft_forward_of_a_causal_conv_moves_the_outputs_before_a_spike() -> None:
    """What docs/numerics.md says of auto's forward: fft's error is normwise, so outputs 0-2 of a causal conv, which
    never read position 3, move with a spike there (by far more than float32's rounding), where native's do not."""
    x, w, kw = _causal_long_conv()
    spec = ConvSpec.from_shapes(tuple(x.shape), tuple(w.shape), **kw)
    exact = torch.nn.functional.conv1d(torch.nn.functional.pad(x.double(), (1023, 0)), w.double(), groups=8)
    early = exact[..., :3]  # outputs 0-2: x[0:3] times the last taps only

    def moved(y: torch.Tensor) -> float:
        return float(((y[..., :3].double() - early).abs() / early.abs()).max())

    assert moved(get_backend("fft").forward(spec, x, w)) > 1e-2  # type: ignore[attr-defined]
    assert moved(cg.conv1d(x, w, **kw, backend="native")) < 1e-5


def test_forward_mode_native_keeps_autos_forward_torchs_and_tunes_the_gradients(monkeypatch: pytest.MonkeyPatch
                                                                                ) -> None:
    """auto.set_forward_mode("native") (CONVGRAD_AUTOTUNE_FORWARD=native): on the causal long conv, auto's forward is
    torch's convolution bit for bit and fft's forward never runs, while the gradients are still tuned (fft among
    the candidates). In the default mode fft's forward is raced there."""
    x, w, kw = _causal_long_conv()
    backend = get_backend("fft")
    forwards: list[ConvSpec] = []
    gradients: list[ConvSpec] = []
    original = backend.forward  # type: ignore[attr-defined]
    monkeypatch.setattr(backend, "forward", lambda spec, a, b: (forwards.append(spec), original(spec, a, b))[1])
    for name in ("input_grad", "weight_grad", "backward"):  # which of them the race runs depends on its timings
        method = getattr(backend, name)
        monkeypatch.setattr(backend, name, lambda spec, *a, m=method: (gradients.append(spec), m(spec, *a))[1])
    want = torch.nn.functional.conv1d(torch.nn.functional.pad(x, (1023, 0)), w, groups=8)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    with auto.tuning_mode("tune"):
        auto.clear()
        previous = auto.set_forward_mode("native")
        try:
            for _ in range(3):
                y = cg.conv1d(xr, wr, **kw)
                assert torch.equal(y, want)
                torch.autograd.grad(y.square().sum(), (xr, wr))
            spec = ConvSpec.from_shapes(tuple(x.shape), tuple(w.shape), **kw)
            assert not forwards and gradients and auto.chosen(spec, "both", x) is not None
            # an inference call (no gradient) takes torch's convolution with its own node (the native shortcut)
            assert auto.settled_native(spec, x, w, False, False)
        finally:
            auto.set_forward_mode(previous)
        auto.clear()
        assert auto.get_forward_mode() == "tune" and not auto.settled_native(spec, x, w, False, False)
        cg.conv1d(x, w, **kw)
        assert forwards, "fft's forward is raced in the default mode"
        auto.clear()


def test_forward_mode_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from convgrad.tuning import modes

    monkeypatch.setattr(modes, "_forward_mode", None)
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_FORWARD", " Native ")
    assert auto.get_forward_mode() == "native" and auto.forward_fixed()
    monkeypatch.setattr(modes, "_forward_mode", None)
    monkeypatch.delenv("CONVGRAD_AUTOTUNE_FORWARD")
    with auto.tuning_mode("tune"):
        assert auto.get_forward_mode() == "tune" and not auto.forward_fixed()
    with auto.tuning_mode("fixed"):
        assert auto.forward_fixed()  # the fixed mode runs native for everything
    monkeypatch.setattr(modes, "_forward_mode", None)
    monkeypatch.setenv("CONVGRAD_AUTOTUNE_FORWARD", "fft")
    with pytest.raises(ValueError, match=r"CONVGRAD_AUTOTUNE_FORWARD='fft' must be one of \('tune', 'native'\)"):
        auto.get_forward_mode()
    with pytest.raises(ValueError, match=r"set_forward_mode: mode='exact' must be one of \('tune', 'native'\)"):
        auto.set_forward_mode("exact")
    monkeypatch.setattr(modes, "_forward_mode", None)
    monkeypatch.delenv("CONVGRAD_AUTOTUNE_FORWARD")


def test_auto_forward_with_no_candidate_asks_the_cost_models_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no backend but native may serve the forward (here a strided 1d layer whose 250 taps fft's cost model
    judges, wav2letter's front end in small), auto remembers that: the candidates' cost models run on the first
    call, not on every call (each asked fft_phases of 250 taps: on a 3 ms layer auto's forward ran at 0.77x native,
    benchmarks/results/large_kernels.md). Nothing is stored as a choice (no measurement was made), and a clear of the
    choices asks again."""
    asked: list[ConvSpec] = []
    backend = get_backend("fft")
    original = backend.can_serve
    monkeypatch.setattr(backend, "can_serve", lambda spec, like: (asked.append(spec), original(spec, like))[1])
    x, w = torch.randn(2, 1, 2000), torch.randn(8, 1, 250)
    with auto.tuning_mode("tune"):
        auto.clear()
        for _ in range(5):
            spec = ConvSpec.from_shapes(tuple(x.shape), tuple(w.shape), stride=160)
            assert torch.equal(auto.forward(spec, x, w, None), torch.nn.functional.conv1d(x, w, stride=160))
        assert len(asked) == 1, asked
        assert auto.chosen(spec, "forward", x) is None
        other = ConvSpec.from_shapes(tuple(x.shape), tuple(w.shape), stride=150)
        auto.forward(other, x, w, None)
        auto.clear()  # every layer is asked again after a clear, whichever comes first
        auto.forward(other, x, w, None)
        auto.forward(spec, x, w, None)
        assert len(asked) == 4, asked
        auto.clear()


@pytest.mark.parametrize("case", [LARGE[0], LARGE[4], LARGE[5], LARGE[10]], ids=str)
def test_per_sample_fft_matches_a_loop_over_samples(case: Case) -> None:
    """method="fft": per-sample weight gradients and their norms equal autograd's, one sample at a time."""
    t = make_tensors(case)
    kw = {**case.kwargs(), "transposed": case.transposed}
    if case.transposed:
        kw["output_padding"] = case.output_padding
    gw = cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"], method="fft", **kw)
    norms = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, method="fft", **kw)
    for n in range(case.input_shape[0]):
        one = Case((1, *case.input_shape[1:]), case.weight_shape, case.stride, case.padding, case.dilation,
                   case.groups, case.transposed, case.output_padding)
        ref = reference_grads(one, {"input": t["input"][n:n + 1], "weight": t["weight"],
                                    "grad_output": t["grad_output"][n:n + 1]})["grad_weight"]
        assert _normwise(gw[n], ref) <= NORMWISE_F64
        assert abs(float(norms[n]) - float(ref.norm())) <= NORMWISE_F64 * float(ref.norm())


def test_a_mutated_step_changes_the_run_the_text_and_the_code_together() -> None:
    """One step object is what runs, what explain says and what its script writes: the inverse of a forward conv's
    plan told to cut one more row off the end gives a result one row short when run, says the new cuts in the
    text, writes them in the code, and the code run gives exactly what the interpreter gives. The plan's other steps
    and the unmutated plan are untouched (its run still equals torch's conv)."""
    spec = ConvSpec.from_shapes((2, 4, 30), (4, 1, 9), padding=4, groups=4)
    p = fft.plan(spec, "output")
    j = next(i for i, s in enumerate(p.steps) if s.op == "inverse")
    step = p.steps[j]
    ((lo, hi),) = step.kwargs["cuts"]
    cuts = ((lo, hi + 1),)
    mutated = dataclasses.replace(p, steps=(*p.steps[:j], dataclasses.replace(step, args=tuple(
        (k, cuts if k == "cuts" else v) for k, v in step.args)), *p.steps[j + 1:]))
    x, w = torch.randn(spec.input_shape, dtype=torch.float64), torch.randn(spec.weight_shape, dtype=torch.float64)
    ran, = run(mutated, {"x": x, "w": w}, True)
    before, = run(p, {"x": x, "w": w}, True)
    assert before.shape == spec.output_shape and ran.shape == (*spec.output_shape[:-1], spec.output_shape[-1] - 1)
    assert torch.allclose(before, torch.nn.functional.conv1d(x, w, padding=4, groups=4))
    assert torch.equal(ran, before[..., :-1])  # the same values: only the cut moved
    text, old_text = mutated.describe().splitlines(), p.describe().splitlines()
    changed = [(a, b) for a, b in zip(old_text, text, strict=True) if a != b]
    assert len(changed) == 1 and f"cut {cuts}" in changed[0][1] and f"cut {((lo, hi),)}" in changed[0][0]
    code, old_code = mutated.code(), p.code()
    changed_code = [(a, b) for a, b in zip(old_code, code, strict=True) if a != b]
    assert len(changed_code) == 1 and f"cuts={cuts!r}" in changed_code[0][1]
    scope = {"x": x, "w": w, "real": True}
    exec("\n".join(code), scope)
    assert torch.equal(scope["out"], ran)


def test_every_step_writes_the_shape_it_declares() -> None:
    """Each step's declared shape is what it writes for the first chunk of real data (traced by ``run``), on plans
    of every kind, chunked over groups, samples and kernel rows too (the shapes ``explain`` prints)."""
    cases = [((2, 4, 30), (4, 1, 9), dict(padding=4, groups=4)),
             ((3, 6, 17, 13), (6, 2, 5, 4), dict(stride=(2, 3), padding=((2, 1), (0, 3)), dilation=(1, 2), groups=3)),
             ((2, 4, 9, 10), (4, 3, 3, 4), dict(transposed=True, stride=2, padding=1, output_padding=1, groups=2)),
             ((2, 64, 28, 28), (64, 64, 31, 31), dict(padding=15))]  # dense: a kernel row a chunk
    checked = 0
    for xs, ws, kw in cases:
        spec = ConvSpec.from_shapes(xs, ws, **kw)
        t = {"input": torch.randn(spec.input_shape), "weight": torch.randn(spec.weight_shape),
             "grad_output": torch.randn(spec.output_shape)}
        x, y = (t["grad_output"], t["input"]) if spec.transposed else (t["input"], t["grad_output"])
        given = {"x": x, "y": y, "w": t["weight"]}
        plans = [fft.plan(spec, g) for g in ("output", "grad_input", "grad_weight")]
        plans += [b for b in [fft.backward_plan(spec)] if b is not None]
        for p in plans:
            seen: dict[int, tuple[int, ...]] = {}

            def trace(step: fft.FftStep, value: object, seen: dict[int, tuple[int, ...]] = seen) -> None:
                if id(step) not in seen and isinstance(value, torch.Tensor):
                    seen[id(step)] = tuple(value.shape)

            run(p, {name: given[name] for name in p.inputs}, True, trace)
            for step in p.steps:
                if id(step) in seen:
                    assert seen[id(step)] == step.shape, (p.gradient, step.name, step.op, seen[id(step)], step.shape)
                    checked += 1
    assert checked > 60


# convs whose window never reaches x's rows in one dim (a row of x behind more padding than the kernel's reach):
# grad_input is zeros of x's shape, grad_weight zeros, the forward reads zeros only
PADDING_ONLY = [Case((2, 2, 1), (2, 2, 2), stride=2, dilation=3, padding=((6, 0),), name="1d-s2-d3-pad6"),
                Case((2, 2, 1), (2, 2, 6), stride=3, padding=((9, 1),), name="1d-s3-k6-pad9"),
                Case((1, 2, 3, 1), (2, 2, 3, 4), stride=2, padding=((1, 1), (6, 0)), name="2d-second-dim-pad6"),
                Case((2, 2, 2), (2, 2, 2), stride=2, dilation=3, padding=((6, 0),), transposed=True, output_padding=1,
                     name="T-1d")]


@pytest.mark.parametrize("case", PADDING_ONLY, ids=lambda c: c.name)
def test_fft_of_a_conv_that_reads_only_padding_has_the_input_shape(case: Case) -> None:
    """Where the transform length is shorter than the zero rows before x's data (the conv reads none of x's rows),
    each phase's zero rows are at most the transform length: the gradients keep x's shape. Before, the split of the
    pads gave a negative number of rows per phase and grad_input came back 3 rows long for 1 row of x."""
    spec = case.spec()
    dims = sizing.phases(spec)
    assert all(0 <= d.whole_rows(s) for d, s in zip(dims, spec.stride))
    _assert_normwise(case)
    t = make_tensors(case)
    assert get_backend("fft").forward(spec, t["input"], t["weight"]).shape == spec.output_shape
