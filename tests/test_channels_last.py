"""The channels_last backend: its plan, its layouts, oneDNN's float32 path, and when auto races it.

The grid of hard cases (tests/test_grid.py), gradcheck (test_autograd.py), torch.func and torch.compile
(test_ecosystem.py) run over every registered backend, this one included.
"""

from __future__ import annotations

import pytest
import torch

import convgrad as cg
from convgrad.backends import auto, channels_last, get_backend
from convgrad.spec import ConvSpec

FORMATS = {4: torch.channels_last, 5: torch.channels_last_3d}


def test_plan_names_every_step_and_runs_1d_as_2d() -> None:
    spec = ConvSpec.from_shapes((2, 8, 50), (8, 1, 5), stride=2, padding=((1, 2),), groups=8)
    plan = channels_last.plan(spec)
    assert plan.run.spec.input_shape == (2, 8, 1, 50) and plan.run.spec.weight_shape == (8, 1, 1, 5)
    assert plan.run.spec.padding == ((0, 0), (1, 2)) and plan.run.spec.stride == (1, 2)
    assert plan.run.spec.output_shape == (2, 8, 1, spec.output_shape[-1])
    text = plan.describe().splitlines()
    assert len(text) == 4 and "(N, C, 1, L)" in text[0] and "channels-last" in text[1]
    assert "aten.convolution_backward" in text[2] and "drop the unit dim" in text[3]
    assert len(channels_last.plan(ConvSpec.from_shapes((2, 8, 5, 6, 7), (8, 2, 3, 3, 3), groups=4))
               .describe().splitlines()) == 3


@pytest.mark.parametrize("layout", ["contiguous", "input", "weight", "both"])
@pytest.mark.parametrize(("x_shape", "w_shape", "groups"), [((2, 8, 9, 9), (8, 2, 3, 3), 4),
                                                           ((2, 8, 4, 5, 6), (16, 4, 3, 2, 3), 2),
                                                           ((2, 6, 11), (6, 1, 4), 6)])
def test_gradients_come_back_in_torchs_layout(layout: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                              groups: int) -> None:
    """Whatever runs inside, each gradient has the strides torch's own backward gives these operands."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(x_shape, generator=g), torch.randn(w_shape, generator=g)
    fmt = FORMATS.get(x.dim())
    if fmt is None and layout != "contiguous":
        pytest.skip("1d tensors have no channels-last layout")
    if layout in ("input", "both"):
        x = x.contiguous(memory_format=fmt)
    if layout in ("weight", "both"):
        w = w.contiguous(memory_format=fmt)
    spec = ConvSpec.from_shapes(x.shape, w.shape, padding=1, groups=groups)
    gy = torch.randn(spec.output_shape, generator=g)
    ours = get_backend("channels_last").backward(spec, gy, x, w, True, True)
    ref = get_backend("native").backward(spec, gy, x, w, True, True)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        assert a.stride() == b.stride() or all(a.is_contiguous(memory_format=m) == b.is_contiguous(memory_format=m)
                                               for m in (torch.contiguous_format, *([fmt] if fmt else [])))


@pytest.mark.parametrize(("x_shape", "w_shape", "kwargs"), [
    ((2, 16, 5, 9, 9), (16, 2, 3, 3, 3), {"padding": 1, "groups": 8}),  # 3d grouped: oneDNN's channels-last kernels
    ((2, 16, 5, 9, 9), (16, 1, 3, 3, 3), {"stride": (1, 2, 2), "padding": 1, "groups": 16}),  # 3d depthwise, strided
    ((3, 24, 40), (24, 1, 5), {"padding": 4, "dilation": 2, "groups": 24}),  # 1d depthwise, dilated
    ((2, 8, 10, 10), (8, 4, 4, 4), {"stride": 2, "padding": 1, "groups": 2, "transposed": True,
                                    "output_padding": 1}),
])
def test_float32_runs_onednn_channels_last_and_matches_autograd(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                                kwargs: dict) -> None:
    """float32 is where oneDNN runs (the float64 grid takes PyTorch's slow kernels, in either layout)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(x_shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(w_shape, generator=g, dtype=torch.float64, requires_grad=True)
    fn = cg.conv_transpose if kwargs.get("transposed") else cg.conv
    args = {k: v for k, v in kwargs.items() if k != "transposed"}
    y = fn(x, w, **args, backend="native")
    gy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    ref = torch.autograd.grad(y, (x, w), gy)
    ours = cg.conv_backward(gy.float(), x.detach().float(), w.detach().float(), **kwargs, backend="channels_last")
    for a, b in zip(ours[:2], ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)


def test_auto_races_it_only_where_it_can_serve() -> None:
    grouped = ConvSpec.from_shapes((2, 16, 5, 9, 9), (16, 2, 3, 3, 3), padding=1, groups=8)
    dense = ConvSpec.from_shapes((2, 16, 9, 9), (16, 16, 3, 3), padding=1)
    like = torch.zeros(grouped.output_shape)
    names = {b.name for b in auto.candidates(grouped, like)}
    assert {"native", "fwdconv", "channels_last"} <= names
    assert "channels_last" not in {b.name for b in auto.candidates(dense, torch.zeros(dense.output_shape))}
    assert "channels_last" not in {b.name for b in auto.candidates(grouped, like.double())}  # no oneDNN kernels
    cl = like.contiguous(memory_format=torch.channels_last_3d)
    assert "channels_last" not in {b.name for b in auto.candidates(grouped, cl)}  # native is that very call


@pytest.mark.parametrize(("x_shape", "w_shape", "stride", "padding"), [
    ((2, 3, 8, 1), (3, 3, 1, 3), 3, (0, 1)),  # from `convgrad check --random 300 --dtype bfloat16` (seed 0)
    ((1, 3, 1), (1, 3, 4), 3, 2),  # seed 1
    ((1, 6, 4, 2, 1), (2, 3, 1, 4, 3), 3, (0, 1, 1)),  # seed 0, grouped: auto may race this backend here
])
def test_bfloat16_weight_gradient_of_taps_that_read_only_padding(x_shape: tuple[int, ...], w_shape: tuple[int, ...],
                                                                 stride: int, padding: object) -> None:
    """Before: oneDNN's channels-last bfloat16 weight gradient (torch 2.13, CPU) left the taps that meet only
    padding uninitialised: values up to 1e308 where the gradient is exactly 0, differing from run to run."""
    groups = x_shape[1] // w_shape[1]
    spec = ConvSpec.from_shapes(x_shape, w_shape, stride=stride, padding=padding, groups=groups)
    assert spec.reads_only_padding
    g = torch.Generator().manual_seed(0)
    for _ in range(20):  # the garbage depends on what the allocator hands out
        x = torch.randn(spec.input_shape, generator=g).bfloat16()
        gy = torch.randn(spec.output_shape, generator=g).bfloat16()
        ours = get_backend("channels_last").weight_grad(spec, x, gy)
        torch.testing.assert_close(ours, get_backend("native").weight_grad(spec, x, gy), rtol=0, atol=0)


def test_reads_only_padding_is_the_taps_geometry() -> None:
    assert ConvSpec.from_shapes((1, 1, 1), (1, 1, 3), padding=1).reads_only_padding  # taps 0 and 2 meet padding
    assert not ConvSpec.from_shapes((1, 1, 2), (1, 1, 3), padding=1).reads_only_padding
    assert not ConvSpec.from_shapes((1, 1, 8, 8), (1, 1, 3, 3), stride=2, padding=1).reads_only_padding
    assert ConvSpec.from_shapes((1, 1, 5), (1, 1, 3), stride=3, padding=((0, 2),)).reads_only_padding is False
    assert ConvSpec.from_shapes((1, 1, 1), (1, 1, 2), stride=2, padding=((1, 0),)).reads_only_padding  # tap 0
    assert ConvSpec.from_shapes((0, 1, 1), (1, 1, 3), padding=1).reads_only_padding  # geometry, not data
