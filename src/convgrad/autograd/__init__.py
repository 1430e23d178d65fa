"""Convolutions as torch.autograd.Functions whose backward is computed by a chosen backend.

The forward is PyTorch's native convolution; with backend="auto" it is tuned like the backward (native unless a
backend's ``forward``, fft's for large kernels, beats it: ``convgrad.backends.auto.forward``). The backward calls the
backend's
explicit formulas, which are built from differentiable ops, so double and higher
backward passes come from autograd (as with JAX's transpose rules).
"""

from __future__ import annotations

from convgrad.autograd.calls import (
    conv,
    conv1d,
    conv2d,
    conv3d,
    conv_transpose,
    conv_transpose1d,
    conv_transpose2d,
    conv_transpose3d,
)
from convgrad.autograd.function import ConvFunction, no_weight_gradients

__all__ = [
    "ConvFunction",
    "conv",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "no_weight_gradients",
]
