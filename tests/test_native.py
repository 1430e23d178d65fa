"""The native backend: aten.convolution_backward with zero-stride placeholders for unwanted tensors."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import convgrad as cg


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
