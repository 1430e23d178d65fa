"""The native backend: aten.convolution_backward with zero-stride placeholders for unwanted tensors."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import convgrad as cg
from convgrad.backends import get_backend
from convgrad.backends.native import zero_padding_only_taps
from convgrad.spec import ConvSpec


class _RecordConvBackward(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.inputs: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten.convolution_backward.default:
            self.inputs.append(args[1])
            self.weights.append(args[2])
        return func(*args, **(kwargs or {}))


def test_input_grad_passes_a_zero_stride_placeholder_input() -> None:
    w, gy = torch.randn(4, 3, 3, 3), torch.randn(2, 4, 3, 3)
    with _RecordConvBackward() as mode:
        gi = cg.conv_input_grad((2, 3, 8, 8), w, gy, stride=2, backend="native")
    assert len(mode.inputs) == 1
    assert mode.inputs[0].shape == (2, 3, 8, 8) and mode.inputs[0].stride() == (0, 0, 0, 0)
    torch.testing.assert_close(gi, torch.nn.grad.conv2d_input((2, 3, 8, 8), w, gy, stride=2))


def test_weight_grad_passes_a_zero_stride_placeholder_weight() -> None:
    x, gy = torch.randn(2, 3, 8, 8), torch.randn(2, 4, 3, 3)
    with _RecordConvBackward() as mode:
        gw = cg.conv_weight_grad(x, (4, 3, 3, 3), gy, stride=2, backend="native")
    assert mode.weights[0].shape == (4, 3, 3, 3) and mode.weights[0].stride() == (0, 0, 0, 0)
    torch.testing.assert_close(gw, torch.nn.grad.conv2d_weight(x, (4, 3, 3, 3), gy, stride=2))


def test_layouts_pytorch_rejects_are_retried_contiguous() -> None:
    """channels_last input and weight whose size-1 dims make the strides ambiguous: aten's slow kernel raises
    "grad_weight must be contiguous" (torch autograd too); the native backend retries on contiguous copies."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 2, 2, 1, generator=g, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    w = torch.randn(1, 2, 2, 1, generator=g, dtype=torch.float64).permute(3, 2, 1, 0).contiguous().permute(3, 2, 1, 0)
    gy = torch.randn(1, 1, 1, 1, generator=g, dtype=torch.float64)
    gi, gw, _ = cg.conv_backward(gy, x, w, None, output_mask=(True, True, False), backend="native")
    ref = torch.ops.aten.convolution_backward(gy, x.contiguous(), w.contiguous(), None, [1, 1], [0, 0], [1, 1], False,
                                              [0, 0], 1, [True, True, False])
    torch.testing.assert_close(gi, ref[0], rtol=1e-12, atol=0)
    torch.testing.assert_close(gw, ref[1], rtol=1e-12, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("x_shape", "w_shape", "stride", "padding"), [
    ((2, 3, 8, 1), (3, 3, 1, 3), 3, (0, 1)),  # from `convgrad check --random 300 --dtype bfloat16` (seed 0)
    ((1, 3, 1), (1, 3, 4), 3, 2),  # seed 1
    ((1, 6, 4, 2, 1), (2, 3, 1, 4, 3), 3, (0, 1, 1)),  # seed 0, grouped
    ((2, 4, 1, 6), (4, 2, 3, 3), 1, 1),  # one row of x: the first and last rows of taps meet padding only
])
def test_half_weight_gradient_of_taps_that_read_only_padding_is_exactly_zero(
        dtype: torch.dtype, x_shape: tuple[int, ...], w_shape: tuple[int, ...], stride: int, padding: object) -> None:
    """oneDNN's bfloat16 weight gradient (torch 2.13, CPU; contiguous operands on an AVX-512 CPU) leaves those taps
    uninitialised (up to 1e36 seen where the gradient is 0): native sets them to their exact 0, and the other taps
    stay within half precision of float64 autograd."""
    groups = x_shape[1] // w_shape[1]
    spec = ConvSpec.from_shapes(x_shape, w_shape, stride=stride, padding=padding, groups=groups)
    assert spec.reads_only_padding
    g = torch.Generator().manual_seed(0)
    for _ in range(10):  # the garbage depends on what the allocator hands out
        x, gy = torch.randn(spec.input_shape, generator=g), torch.randn(spec.output_shape, generator=g)
        ours = get_backend("native").weight_grad(spec, x.to(dtype), gy.to(dtype))
        ref = get_backend("native").weight_grad(spec, x.to(dtype).double(), gy.to(dtype).double())
        mask = zero_padding_only_taps(torch.ones(spec.weight_shape), spec) == 0  # the taps that meet padding only
        assert mask.any() and not mask.all()
        assert bool((ours[mask.expand_as(ours)] == 0).all())
        torch.testing.assert_close(ours.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


def test_padding_only_taps_are_the_geometry() -> None:
    assert ConvSpec.from_shapes((1, 1, 1), (1, 1, 3), padding=1).padding_only_taps == ((0, 2),)
    assert ConvSpec.from_shapes((1, 1, 2), (1, 1, 3), padding=1).padding_only_taps == ((),)
    assert ConvSpec.from_shapes((1, 1, 1), (1, 1, 2), stride=2, padding=((1, 0),)).padding_only_taps == ((0,),)
    # dilation 2 on 3 rows padded by 2: tap 0 reads rows -2..0, tap 2 rows 2..4; each meets a row of x
    assert ConvSpec.from_shapes((1, 1, 3), (1, 1, 3), dilation=2, padding=2).padding_only_taps == ((),)
    assert ConvSpec.from_shapes((1, 1, 1, 5), (1, 1, 3, 1), dilation=(2, 1), padding=(2, 0)).padding_only_taps \
        == ((0, 2), ())
    assert ConvSpec.from_shapes((0, 1, 1), (1, 1, 3), padding=1).padding_only_taps == ((0, 2),)  # geometry only
