"""The fft backend's pruned transforms (issue 28): ``forward_transform`` equals rfftn/fftn of the padded data and
``inverse_transform`` equals irfftn/ifftn then the crop, in float64 to 1e-12, on both of the forward's paths (pruned
one dim at a time, or one padded copy and rfftn); the phase split of the pads (``FftDim.phase_pads``); batch 0."""

from __future__ import annotations

import pytest
import torch

import convgrad as cg
from convgrad.backends import get_backend
from convgrad.backends.fft import sizing
from convgrad.backends.fft import transforms as tf
from convgrad.spec import ConvSpec, padded_sizes
from convgrad.tensor_ops import crop, pad
from helpers import Case, assert_gradchecks, make_tensors, reference_forward, reference_grads

EXACT = 1e-12
# (data's trailing shape, transform sizes, pads per dim (None: rfftn(s=)'s (0, L - m)))
FORWARD = [
    ((9,), (16,), None),
    ((7,), (15,), ((3, 5),)),  # 1d: one dim, always the padded copy
    ((5, 7), (12, 16), None),
    ((5, 7), (15, 9), ((4, 6), (1, 1))),  # odd sizes, leading zero rows
    ((13, 13), (20, 20), ((6, 1), (2, 5))),
    ((3, 4, 5), (10, 9, 12), ((2, 5), (0, 5), (4, 3))),
    ((7, 7, 7), (18, 18, 18), None),
    ((14, 5), (10, 12), None),  # data larger than L in a dim: rfftn(s=) cuts it
    ((6, 9, 4), (5, 8, 6), ((1, -2), (-3, 2), (0, 2))),  # crops on either side
]


def _cut_or_pad(t: torch.Tensor, sizes: tuple[int, ...]) -> torch.Tensor:
    """t cut or padded at the end of each trailing dim to ``sizes``: what rfftn(s=) transforms."""
    nd = len(sizes)
    return pad(t, [(0, n - m) for m, n in zip(t.shape[-nd:], sizes)])


def _force(monkeypatch: pytest.MonkeyPatch, pruned: bool) -> None:
    """Every transform pruned (any grid, any fill), or none."""
    monkeypatch.setattr(tf, "PRUNE_MIN_POINTS", 0 if pruned else 2**62)
    monkeypatch.setattr(tf, "PRUNE_FILL", 1.0)


@pytest.fixture(params=["pruned", "one-call"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each transform runs pruned (one call per dim) or as one rfftn/irfftn call."""
    _force(monkeypatch, request.param == "pruned")
    return str(request.param)


@pytest.mark.parametrize("complex_", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize("shape, sizes, pads", FORWARD, ids=str)
def test_forward_transform_equals_rfftn_of_the_padded_data(shape: tuple[int, ...], sizes: tuple[int, ...],
                                                           pads: tuple[tuple[int, int], ...] | None, complex_: bool,
                                                           path: str) -> None:
    torch.manual_seed(0)
    dtype = torch.complex128 if complex_ else torch.float64
    t = torch.randn(2, 3, *shape, dtype=dtype)
    dims = tuple(range(-len(sizes), 0))
    ref = pad(t, list(pads)) if pads is not None else _cut_or_pad(t, sizes)
    want = torch.fft.fftn(ref, dim=dims) if complex_ else torch.fft.rfftn(ref, dim=dims)
    if pads is None:  # the default is rfftn(s=) itself
        same = torch.fft.fftn(t, s=sizes, dim=dims) if complex_ else torch.fft.rfftn(t, s=sizes, dim=dims)
        assert torch.allclose(same, want, rtol=0, atol=EXACT * want.abs().max())
    ours = tf.forward_transform(t, sizes, pads)
    assert ours.shape == want.shape
    assert float((ours - want).abs().max()) <= EXACT * float(want.abs().max()), path


def test_batch_0_never_reaches_the_transforms(monkeypatch: pytest.MonkeyPatch) -> None:
    """MKL's FFT refuses an empty batch (rfftn and ifft alike), so ``execute`` answers batch 0 before any transform:
    the forward and both gradients of a layer whose kernel is pruned (3x3x3 in 8^3) come back empty or zero."""
    _force(monkeypatch, True)
    x, w = torch.randn(0, 2, 6, 6, 6, dtype=torch.float64), torch.randn(2, 1, 3, 3, 3, dtype=torch.float64)
    gy = torch.randn(0, 2, 6, 6, 6, dtype=torch.float64)
    gi, gw, _ = cg.conv_backward(gy, x, w, None, padding=1, groups=2, backend="fft", output_mask=(True, True, False))
    assert gi.shape == x.shape and gw.shape == w.shape and not gw.any()
    assert cg.conv3d(x, w, padding=1, groups=2, backend="fft").shape == (0, 2, 6, 6, 6)


def test_forward_transform_prunes_a_small_kernel_and_not_data_that_fills_l(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rules: two 7x7x7 kernels in 54^3 (315k grid points) are transformed dim by dim (rfftn never runs); 48^3 data
    in 54^3 (fill 0.79 > PRUNE_FILL) by rfftn; so is one 7x7x7 kernel (157k points, under PRUNE_MIN_POINTS) and a 7x7
    kernel in 20x20 (one call's setup costs more than the rows saved)."""
    calls: list[str] = []
    for name in ("rfftn", "rfft"):
        real = getattr(torch.fft, name)
        monkeypatch.setattr(torch.fft, name, lambda *a, _f=real, _n=name, **k: calls.append(_n) or _f(*a, **k))
    for shape, sizes, want in [((2, 1, 7, 7, 7), (54, 54, 54), "rfft"), ((2, 1, 48, 48, 48), (54, 54, 54), "rfftn"),
                               ((1, 1, 7, 7, 7), (54, 54, 54), "rfftn"), ((64, 1, 7, 7), (20, 20), "rfftn")]:
        calls.clear()
        tf.forward_transform(torch.randn(shape), sizes)
        assert calls == [want], (shape, sizes)


INVERSE = [
    ((16,), ((0, 7),)),
    ((15,), ((3, 2),)),
    ((12, 16), ((0, 5), (0, 9))),
    ((15, 9), ((4, 6), (1, 1))),  # odd sizes, rows cut before
    ((20, 20), ((0, 7), (0, 7))),
    ((10, 9, 12), ((2, 5), (0, 5), (4, 3))),
    ((18, 18, 18), ((0, 11), (0, 11), (0, 11))),
    ((8, 6), ((0, 0), (0, 0))),
]


@pytest.mark.parametrize("real", [True, False], ids=["real", "complex"])
@pytest.mark.parametrize("sizes, cuts", INVERSE, ids=str)
def test_inverse_transform_equals_irfftn_then_the_crop(sizes: tuple[int, ...], cuts: tuple[tuple[int, int], ...],
                                                       real: bool, path: str) -> None:
    torch.manual_seed(1)
    nd, dims = len(sizes), tuple(range(-len(sizes), 0))
    data = torch.randn(2, 3, *sizes, dtype=torch.float64 if real else torch.complex128)
    spectrum = torch.fft.rfftn(data, dim=dims) if real else torch.fft.fftn(data, dim=dims)
    full = torch.fft.irfftn(spectrum, s=sizes, dim=dims) if real else torch.fft.ifftn(spectrum, s=sizes, dim=dims)
    want = crop(full, list(cuts))
    ours = tf.inverse_transform(spectrum, sizes, real, cuts)
    assert ours.shape == want.shape == (2, 3, *padded_sizes(sizes, [(-lo, -hi) for lo, hi in cuts]))
    assert ours.dtype == want.dtype and float((ours - want).abs().max()) <= EXACT * float(want.abs().max()), nd
    assert torch.equal(tf.inverse_transform(spectrum, sizes, real), full)  # no cuts: irfftn itself


def test_pruned_transforms_gradcheck_and_gradgradcheck(monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, True)
    t = torch.randn(1, 2, 3, 4, dtype=torch.float64, requires_grad=True)
    s = torch.randn(1, 2, 7, 5, dtype=torch.complex128, requires_grad=True)

    def forward(t: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(tf.forward_transform(t, (7, 8), ((2, 2), (1, 3))))

    def inverse(s: torch.Tensor) -> torch.Tensor:
        return tf.inverse_transform(s, (7, 8), True, ((1, 3), (0, 2)))

    for f, x in ((forward, t), (inverse, s)):
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("i, k, s, d, pads", [
    (28, 31, 1, 1, (15, 15)), (9, 3, 2, 2, (0, 0)), (29, 9, 2, 1, (4, 3)), (37, 21, 3, 1, (13, 10)),
    (30, 5, 4, 2, (3, 3)), (33, 9, 3, 2, (5, 5)), (20, 4, 3, 1, (0, 0)), (64, 64, 1, 1, (63, 0))], ids=str)
def test_phase_pads_split_the_transform_pads_per_phase(i: int, k: int, s: int, d: int, pads: tuple[int, int]
                                                       ) -> None:
    """x padded by the first pair, split into phases, each padded by the second = x padded by ``transform_pads``,
    then split: the phases' zero rows may be left to the transform and cut by the inverse."""
    spec = ConvSpec.from_shapes((1, 1, i), (1, 1, k), stride=s, dilation=d, padding=(pads,))
    dim = sizing.phases(spec)[0]
    whole, zeros = dim.phase_pads(s)
    x = torch.arange(1.0, i + 1).reshape(1, 1, i)
    want = pad(x, [dim.transform_pads]).reshape(dim.size, s).T  # (s, L): phase phi's rows
    ours = pad(pad(x, [whole]).reshape(-1, s).T, [zeros])  # (s, M) padded to (s, L)
    assert torch.equal(ours, want)
    assert all(v >= 0 for v in zeros) and all(v < s for v in whole)


def test_phase_pads_of_every_dim_of_a_2d_strided_spec() -> None:
    spec = ConvSpec.from_shapes((1, 1, 29, 31), (1, 1, 9, 9), stride=2, padding=((4, 3), (2, 5)))
    for dim, s, n in zip(sizing.phases(spec), spec.stride, spec.x_size):
        (a, b), (c, e) = dim.phase_pads(s)
        assert a + s * c == dim.transform_pads[0] and b + s * e == dim.transform_pads[1]
        assert (n + a + b) % s == 0 and (n + a + b) // s + c + e == dim.size


# the backend with every transform pruned: strided (phases with zero rows on both sides), asymmetric pads, 1d and 3d,
# transposed with output_padding, groups, complex
PRUNED = [
    Case((3, 6, 29, 31), (6, 1, 9, 9), stride=2, padding=((4, 3), (2, 5)), groups=6, name="dw-stride2-asym"),
    Case((2, 2, 30, 13), (3, 2, 5, 2), stride=(4, 6), dilation=(2, 4), padding=3, name="2-of-4-live-phases"),
    Case((2, 4, 9, 9, 9), (4, 1, 5, 5, 5), padding=2, groups=4, name="3d-depthwise-5"),
    Case((2, 4, 11, 12), (4, 2, 7, 7), stride=2, padding=3, groups=2, transposed=True, output_padding=1,
         name="transposed-7x7-op1"),
    Case((2, 2, 19, 23), (2, 1, 15, 9), padding=((9, 3), (2, 8)), groups=2, name="uneven-pads-15x9"),
    Case((2, 4, 33), (4, 2, 9), stride=3, dilation=2, padding=5, groups=2, name="1d-stride3-dilation2"),
    Case((1, 6, 10, 9, 8), (6, 2, 3, 4, 3), stride=(2, 1, 3), padding=((2, 0), (1, 2), (1, 1)), groups=3,
         name="3d-grouped-strided"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("case", PRUNED, ids=lambda c: c.name)
def test_backend_with_every_transform_pruned_matches_autograd(case: Case, dtype: torch.dtype, path: str) -> None:
    """Both gradients and the forward, pruned or not, within 1e-10 normwise of torch."""
    t = make_tensors(case, dtype)
    ref = reference_grads(case, t)
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, transposed=case.transposed,
                                 backend="fft", output_mask=(True, True, False), **case.kwargs())
    ref["output"] = reference_forward(case, t["input"], t["weight"], None)
    out = get_backend("fft").forward(case.spec(), t["input"], t["weight"])
    for name, ours in (("grad_input", gi), ("grad_weight", gw), ("output", out)):
        err = float((ours - ref[name]).norm() / ref[name].norm())
        assert ours.shape == ref[name].shape and err <= 1e-10, (name, err)


@pytest.mark.parametrize("xs, ws, kw, transposed", [
    ((1, 2, 9, 8), (2, 1, 5, 4), dict(stride=2, padding=((2, 1), (1, 3)), groups=2), False),
    ((1, 2, 5, 5, 4), (2, 1, 3, 3, 2), dict(padding=1, groups=2), False),
    ((1, 2, 4, 5), (2, 1, 3, 3), dict(stride=2, padding=1, output_padding=1, groups=2), True)], ids=str)
def test_backend_with_every_transform_pruned_gradcheck_and_gradgradcheck(
        xs: tuple[int, ...], ws: tuple[int, ...], kw: dict, transposed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    _force(monkeypatch, True)
    assert_gradchecks("fft", xs, ws, kw, transposed=transposed)


def test_a_phase_with_no_data_rows_runs_both_gradients() -> None:
    """A stride whose phases hold no rows of x at all (M_j = 0: 2 rows, stride 3, padding (3, 0)): the phase split
    must not infer its channels from an empty tensor. Found by `convgrad check --random 20 --seed 0` (to_phases
    reshaped to (n, -1, *M))."""
    kw = dict(stride=(2, 3, 3), padding=((3, 2), (3, 0), (0, 0)), dilation=(2, 2, 1), groups=2)
    x, w = torch.randn(1, 4, 5, 2, 3, dtype=torch.float64), torch.randn(4, 2, 2, 2, 1, dtype=torch.float64)
    gy = torch.randn(cg.ConvSpec.from_shapes(x.shape, w.shape, **kw).output_shape, dtype=torch.float64)
    ref = cg.conv_backward(gy, x, w, **kw, backend="native")
    for mask in ((True, True, False), (False, True, False), (True, False, False)):
        ours = cg.conv_backward(gy, x, w, **kw, output_mask=mask, backend="fft")
        for a, b, wanted in zip(ours, ref, mask):
            if wanted:
                torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
