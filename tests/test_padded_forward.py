"""fwdconv's forward: torch's convolution on the input padded beforehand (padding 0), which auto races against
native's forward where ``worth_padding`` admits it (a large last-dim padding sends oneDNN from its jit kernels to
im2col + gemm; benchmarks/results/padded_forward.md). It equals native's forward; the rule admits the large-padding
layers and never a ResNet's or ConvNeXt's; gradients through it are right (the backward is unchanged)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad.autograd import function
from convgrad.backends import auto, fwdconv, get_backend
from convgrad.backends.native import forward as native_forward
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec
from helpers import TOL, Case, assert_gradchecks, grid_cases, make_tensors

pytestmark = pytest.mark.usefixtures("one_thread")

# the forward-conv cases of the grid (batched; unbatched inputs reach a backend batched), and large paddings
SERVED = [c for c in grid_cases() if not c.transposed and c.spec().batch == c.input_shape[0]] + [
    Case((2, 6, 20, 21), (6, 1, 13, 12), padding=((6, 6), (6, 5)), groups=6, name="2d-depthwise-13x12-asym"),
    Case((2, 6, 23, 20), (6, 1, 11, 11), stride=2, padding=((5, 6), (7, 5)), groups=6, name="2d-dw-stride2-asym"),
    Case((2, 16, 40), (16, 8, 9), stride=2, dilation=2, padding=8, groups=2, name="1d-8-per-group-s2-d2"),
    Case((1, 8, 8, 9, 7), (8, 8, 5, 4, 5), padding=((2, 3), (4, 4), (4, 5)), name="3d-dense-asym-batch1"),
    Case((0, 4, 30), (4, 1, 13), padding=6, groups=4, name="1d-depthwise-batch0"),
    Case((1, 4, 30, 30), (4, 1, 5, 31), padding=(2, 15), groups=4, name="2d-depthwise-5x31-batch1"),
]


@pytest.mark.parametrize("case", SERVED, ids=str)
def test_padded_forward_equals_native_forward_float64(case: Case) -> None:
    t = make_tensors(case, bias=False)
    spec = case.spec()
    ours = fwdconv.padded_forward(spec, t["input"], t["weight"])
    ref = native_forward(spec, t["input"], t["weight"], None)
    assert ours.shape == ref.shape == spec.output_shape and ours.dtype == ref.dtype
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-12)


def test_padded_forward_refuses_transposed_and_complex() -> None:
    x, w = torch.randn(1, 2, 9), torch.randn(2, 2, 3)
    with pytest.raises(ConvgradValueError, match=r"fwdconv.forward: transposed=True"):
        fwdconv.padded_forward(ConvSpec.from_shapes(x.shape, w.shape, padding=1, transposed=True), x, w)
    xc, wc = x.to(torch.complex64), w.to(torch.complex64)
    with pytest.raises(ConvgradTypeError, match=r"fwdconv.forward: input dtype torch.complex64"):
        fwdconv.padded_forward(ConvSpec.from_shapes(x.shape, w.shape, padding=1), xc, wc)


def test_padded_forward_refuses_a_complex_weight_beside_a_real_input() -> None:
    """review5: a real input with a complex weight reached aten, whose RuntimeError named neither function nor
    parameter; it is the TypeError of a complex input."""
    x, w = torch.randn(1, 2, 9), torch.randn(2, 2, 3, dtype=torch.complex64)
    with pytest.raises(ConvgradTypeError, match=r"fwdconv.forward: weight dtype torch.complex64 is not served"):
        fwdconv.padded_forward(ConvSpec.from_shapes(x.shape, w.shape, padding=1), x, w)


def _spec(input_shape: tuple[int, ...], weight_shape: tuple[int, ...], **kw: object) -> ConvSpec:
    return ConvSpec.from_shapes(input_shape, weight_shape, **kw)  # type: ignore[arg-type]


# (spec, the like tensor's (dtype, channels last), admitted): the large-kernel layers of `convgrad bench`'s large
# suite and the cut's edges (benchmarks/results/padded_forward.md)
ADMITTED = [
    ("replknet.dw31", _spec((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256), True),
    ("unireplknet.dw13", _spec((8, 320, 14, 14), (320, 1, 13, 13), padding=6, groups=320), True),
    ("wav2vec2.posconv, 48 per group", _spec((2, 768, 500), (768, 48, 128), padding=64, groups=16), True),
    ("depthwise 5x51: width pads 25", _spec((2, 32, 56, 56), (32, 1, 5, 51), padding=(2, 25), groups=32), True),
    ("depthwise 11x11 p5", _spec((2, 32, 28, 28), (32, 1, 11, 11), padding=5, groups=32), True),
    ("depthwise 9x9 p4: jit_dw takes it", _spec((2, 32, 28, 28), (32, 1, 9, 9), padding=4, groups=32), False),
    ("depthwise, width pads (5, 4): aten gets 4", _spec((2, 8, 20, 20), (8, 1, 13, 10), padding=((6, 6), (5, 4)),
                                                        groups=8), False),
    ("SLaK 51x5: width pads 2", _spec((2, 96, 56, 56), (96, 1, 51, 5), padding=(25, 2), groups=96), False),
    ("dense 9x9 p4", _spec((2, 16, 28, 28), (16, 16, 9, 9), padding=4), True),
    ("3d dense 9x9x9 p4", _spec((1, 16, 16, 16, 16), (16, 16, 9, 9, 9), padding=4), True),
    ("3d depthwise 9x9x9 p4: brdgmm_dw either way", _spec((1, 16, 16, 16, 16), (16, 1, 9, 9, 9), padding=4,
                                                          groups=16), False),
    ("4 per group, 13x13 p6: gemm either way", _spec((2, 32, 28, 28), (32, 4, 13, 13), padding=6, groups=8), False),
    ("channel multiplier 2, 13x13 p6", _spec((2, 32, 28, 28), (64, 1, 13, 13), padding=6, groups=32), False),
    ("transposed", _spec((2, 16, 20), (16, 16, 9), padding=4, transposed=True), False),
    ("ConvNeXt depthwise 7x7 p3", _spec((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96), False),
    ("ResNet 3x3 p1", _spec((8, 128, 28, 28), (128, 128, 3, 3), padding=1), False),
    ("ResNet 7x7 stem p3", _spec((8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3), False),
    ("ResNet 1x1", _spec((8, 256, 28, 28), (128, 256, 1, 1)), False),
]


@pytest.mark.parametrize(("name", "spec", "admitted"), ADMITTED, ids=[a[0] for a in ADMITTED])
def test_worth_padding_admits_large_last_dim_paddings_only(name: str, spec: ConvSpec, admitted: bool) -> None:
    like = torch.empty(0).new_empty(spec.input_shape)
    assert fwdconv.worth_padding(spec, like) is admitted, name
    if admitted:  # float32 on the CPU, not channels last: float64, complex and channels last are refused
        assert not fwdconv.worth_padding(spec, like.double())
        assert not fwdconv.worth_padding(spec, like.to(torch.complex64))
        assert not fwdconv.worth_padding(spec, like.movedim(1, -1).contiguous().movedim(-1, 1)), "channels last"
        assert not fwdconv.worth_padding(spec, like.to("meta"))


@pytest.fixture
def forwards(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[ConvSpec]]:
    """The specs fwdconv's forward is called with from here on (each call still runs)."""
    calls: list[ConvSpec] = []
    backend = get_backend("fwdconv")
    original = backend.forward  # type: ignore[attr-defined]

    def spy(spec: ConvSpec, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        calls.append(spec)
        return original(spec, x, w)  # type: ignore[no-any-return]

    monkeypatch.setattr(backend, "forward", spy)
    yield calls


@pytest.mark.usefixtures("tuned")
def test_auto_races_the_padded_forward_where_the_rule_admits(forwards: list[ConvSpec]) -> None:
    """A depthwise 13x13 layer (padding 6) and a 1d 8-per-group layer (padding 4): auto's forward tries fwdconv's
    (and its output is torch's); an explicit backend="fwdconv" keeps native's forward, bit for bit."""
    layers = [(torch.randn(4, 16, 20, 20), torch.randn(16, 1, 13, 13), torch.randn(16), dict(padding=6, groups=16)),
              (torch.randn(4, 16, 60), torch.randn(16, 8, 9), None, dict(padding=4, groups=2))]
    for x, w, b, kw in layers:
        conv = cg.conv2d if x.dim() == 4 else cg.conv1d
        ref = (torch.nn.functional.conv2d if x.dim() == 4 else torch.nn.functional.conv1d)(x, w, b, **kw)
        forwards.clear()
        for _ in range(8):  # the screening, then the rounds that settle the choice (fft's forward may race too)
            torch.testing.assert_close(conv(x, w, b, **kw), ref, **TOL[torch.float32])
        assert forwards and all(s.kernel_size == w.shape[2:] for s in forwards), "fwdconv's forward must be raced"
        assert auto.chosen(ConvSpec.from_shapes(x.shape, w.shape, **kw), "forward", x) is not None  # type: ignore[arg-type]
        forwards.clear()
        assert torch.equal(conv(x, w, b, backend="fwdconv", **kw), ref)
        assert forwards == []


@pytest.mark.usefixtures("tuned")
def test_auto_never_races_the_padded_forward_on_resnet_or_convnext_layers(forwards: list[ConvSpec]) -> None:
    """The control: on a ResNet's 3x3 (p1), 1x1 and 7x7 stem (p3) and a ConvNeXt's depthwise 7x7 (p3) no forward is
    tuned (no choice stored); on SLaK's 51x5 (width pads 2) fft's forward may be, not fwdconv's."""
    layers: list[tuple[torch.Tensor, torch.Tensor, dict[str, Any]]] = [
        (torch.randn(4, 16, 14, 14), torch.randn(16, 16, 3, 3), dict(padding=1)),
        (torch.randn(4, 16, 14, 14), torch.randn(32, 16, 1, 1), dict(stride=2)),
        (torch.randn(2, 3, 32, 32), torch.randn(16, 3, 7, 7), dict(stride=2, padding=3)),
        (torch.randn(4, 16, 14, 14), torch.randn(16, 1, 7, 7), dict(padding=3, groups=16)),
        (torch.randn(2, 8, 30, 30), torch.randn(8, 1, 51, 5), dict(padding=(25, 2), groups=8))]
    for x, w, kw in layers:
        for _ in range(3):
            out = cg.conv2d(x, w, **kw)
        torch.testing.assert_close(out, torch.nn.functional.conv2d(x, w, **kw), **TOL[torch.float32])
        if w.shape[2] != 51:
            assert auto.chosen(ConvSpec.from_shapes(x.shape, w.shape, **kw), "forward", x) is None  # type: ignore[arg-type]
    assert forwards == []


@pytest.mark.parametrize(("xs", "ws", "kw"), [
    ((2, 3, 9, 8), (3, 1, 5, 6), dict(padding=((2, 3), (3, 2)), groups=3)),
    ((1, 4, 11), (4, 2, 3), dict(stride=2, dilation=2, padding=((3, 2),), groups=2)),
    ((1, 2, 4, 4, 5), (2, 2, 3, 2, 3), dict(padding=((2, 1), (1, 2), (2, 2)))),
], ids=["2d-depthwise-asym", "1d-groups-stride-dilation", "3d-dense-asym"])
def test_gradients_through_the_padded_forward(monkeypatch: pytest.MonkeyPatch, xs: tuple[int, ...],
                                              ws: tuple[int, ...], kw: dict[str, object]) -> None:
    """gradcheck/gradgradcheck (float64) of cg.conv whose forward is fwdconv's: the numerical Jacobian of the padded
    forward against the unchanged analytic backward. Per-side paddings: auto in fixed mode sends a symmetric one
    to torch's own convolution (the native shortcut), past the Function."""
    calls: list[ConvSpec] = []

    def padded(spec: ConvSpec, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(spec)
        out = get_backend("fwdconv").forward(spec, x, w)  # type: ignore[attr-defined]
        return out if b is None else out + b.reshape(-1, *(1,) * spec.n)  # (C_out, 1, ..., 1)

    monkeypatch.setattr(function, "auto_forward", padded)
    assert_gradchecks("auto", xs, ws, kw)
    assert calls, "the padded forward must have run"


@pytest.mark.usefixtures("tuned")
@pytest.mark.parametrize("name", ["fft", "fwdconv"])
@pytest.mark.parametrize("last", ["input", "weight", "both"])
@pytest.mark.parametrize("n", [2, 3])
def test_auto_forward_keeps_torchs_memory_format_whichever_candidate_serves(name: str, last: str, n: int) -> None:
    """review5: once auto's forward had chosen fft's, a channels-last input (or weight) gave a contiguous output where
    torch's convolution gives channels last (fft's transforms lay out their own result). The candidate's output is
    laid out as torch's; the values stay the same."""
    x = torch.randn(2, 4, *(9,) * n)
    w, b = torch.randn(4, 1, *(7,) * n), torch.randn(4)
    fmt = torch.channels_last if n == 2 else torch.channels_last_3d
    x, w = (t.contiguous(memory_format=fmt) if last in (which, "both") else t for t, which in ((x, "input"),
                                                                                            (w, "weight")))
    spec = ConvSpec.from_shapes(x.shape, w.shape, padding=3, groups=4)
    auto._choices.remember(auto._key(spec, "forward", x), auto.Choice(name, {}))
    ours = auto.forward(spec, x, w, b)
    ref = (torch.nn.functional.conv2d if n == 2 else torch.nn.functional.conv3d)(x, w, b, padding=3, groups=4)
    if last != "weight":  # torch's layout here: channels last (with the weight alone, its kernel's choice)
        assert ref.is_contiguous(memory_format=fmt) and not ref.is_contiguous()
    assert ours.stride() == ref.stride(), (name, last)
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])


@pytest.mark.usefixtures("tuned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])
@pytest.mark.parametrize("transposed", [False, True])
def test_auto_forward_keeps_torchs_memory_format_complex_and_transposed(dtype: torch.dtype, transposed: bool) -> None:
    """review5: fft's forward chosen on a channels-last input, complex or transposed: torch's convolution gives channels
    last there too (a complex one although its gradients come out contiguous)."""
    x = torch.randn(2, 4, 9, 9, dtype=dtype).contiguous(memory_format=torch.channels_last)
    w, kw = torch.randn(4, 1, 7, 7, dtype=dtype), dict(padding=3, groups=4, stride=2)
    spec = ConvSpec.from_shapes(x.shape, w.shape, transposed=transposed, **kw)  # type: ignore[arg-type]
    auto._choices.remember(auto._key(spec, "forward", x), auto.Choice("fft", {}))
    ours = auto.forward(spec, x, w, None)
    ref = (torch.nn.functional.conv_transpose2d if transposed else torch.nn.functional.conv2d)(x, w, **kw)
    assert ref.is_contiguous(memory_format=torch.channels_last) and not ref.is_contiguous()
    assert ours.stride() == ref.stride()
    torch.testing.assert_close(ours, ref, **TOL[torch.float32])
