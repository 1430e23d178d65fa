"""The native backend: PyTorch's own kernels through ``aten.convolution_backward``.

Contraction (forward conv, per group g; T = kernel taps, P = output positions):
    grad_input  [N, P, C_out/g] x [C_out/g, C_in/g, T] -> [N, C_in/g, taps scattered to input positions]
    grad_weight [C_out/g, N*P] x [N*P, C_in/g * T]     -> [C_out/g, C_in/g * T]
aten dispatches this to oneDNN, cuDNN, the depthwise kernels or THNN's im2col + GEMM
(``convgrad.native_backend`` tells which). aten only knows symmetric padding, so the
excess of an asymmetric padding is applied here to the big side: padded onto the
input of a forward conv (and cropped off its gradient), or padded onto the
grad_output of a transposed conv, whose output aten would otherwise not crop.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from convgrad.backends import FusedBackend, Grads, get_backend, register
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import crop, pad, placeholder


def _complex_bilinear(f: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], a: torch.Tensor,
                      b: torch.Tensor) -> torch.Tensor:
    """f(a, b) for complex a, b from four real calls of the real-bilinear f (aten has no complex conv kernels)."""
    a, b = a.resolve_conj(), b.resolve_conj()
    real = f(a.real, b.real) - f(a.imag, b.imag)
    imag = f(a.real, b.imag) + f(a.imag, b.real)
    return torch.complex(real, imag)


def forward(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The convolution itself (batched), including asymmetric padding; used by the autograd Functions."""
    if input.is_complex():
        out = _complex_bilinear(lambda x, w: forward(spec, x, w, None), input, weight)
        return out if bias is None else out + bias.reshape(-1, *(1,) * spec.n)  # (C_out, 1, ..., 1)
    if spec.is_symmetric:
        return torch.ops.aten.convolution(input, weight, bias, *spec.aten_args)
    excess = spec.padding_excess
    if not spec.transposed:
        input = pad(input, excess)
    out = torch.ops.aten.convolution(input, weight, bias, *spec.aten_args)
    if spec.transposed:
        out = crop(out, excess)  # crop what aten's symmetric padding left
    return out


def _convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, spec: ConvSpec,
                          mask: list[bool]) -> tuple[torch.Tensor | None, ...]:
    """aten.convolution_backward; once more on contiguous copies when PyTorch rejects a layout.

    PyTorch's non-oneDNN CPU kernels (float64, or float32 when size-1 dims make the strides ambiguous)
    fail with "slow_conv2d: grad_weight must be contiguous" for some channels_last input and weight
    pairs, e.g. input (1, 2, 2, 1) in channels_last with a weight of the same shape and reversed
    strides; torch's own autograd fails there too (found by tests/test_fuzz.py).
    """
    try:
        return torch.ops.aten.convolution_backward(grad_output, input, weight, None, *spec.aten_args, mask)
    except RuntimeError as e:
        if not re.search(r"(must|needs to) be contiguous", str(e)):  # slow_conv2d's and slow_conv_transpose's words
            raise
        tensors = (t.contiguous() for t in (grad_output, input, weight))
        return torch.ops.aten.convolution_backward(*tensors, None, *spec.aten_args, mask)


# oneDNN's bfloat16 weight gradient (torch 2.13, CPU) leaves the taps that meet only padding uninitialised (values
# up to 1e308 where the gradient is exactly 0, changing from call to call): channels-last operands on an AVX2 CPU,
# contiguous ones too on an AVX-512 CPU (found by `convgrad check --random 300 --dtype bfloat16`; pinned by
# tests/test_native.py). Half precision is treated alike; float32 and float64 are left as torch's own result.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def zero_padding_only_taps(grad_weight: torch.Tensor, spec: ConvSpec) -> torch.Tensor:
    """grad_weight with the taps that meet only padding (``ConvSpec.padding_only_taps``) set to their exact 0.

    Args:
        grad_weight: ``spec.weight_shape`` ``(C_out, C_in/groups, *k)`` (transposed: ``(C_in, C_out/groups, *k)``).
        spec: the convolution.

    Returns:
        A new tensor of grad_weight's shape and dtype (``torch.where``: garbage that is inf or NaN becomes 0 too).

    Examples:
        >>> spec = ConvSpec.from_shapes((1, 1, 1), (1, 1, 3), padding=1)
        >>> zero_padding_only_taps(torch.tensor([[[1e30, 2.0, float("nan")]]]), spec)
        tensor([[[0., 2., 0.]]])
    """
    mask = torch.zeros(spec.kernel_size, dtype=torch.bool, device=grad_weight.device)  # (*k)
    for j, taps in enumerate(spec.padding_only_taps):
        for t in taps:
            mask.narrow(j, t, 1).fill_(True)
    return torch.where(mask, torch.zeros((), dtype=grad_weight.dtype, device=grad_weight.device), grad_weight)


def weight_scratch(spec: ConvSpec) -> int:
    """Reals of scratch that native's grad_weight holds at least on the CPU: one channel's taps over one plane of y
    (the last two dims), ``T * prod(y_size[-2:])``, and 4 weights (oneDNN's GEMM grad_weight, as the torch profiler
    saw it on the large suite's depthwise layers: benchmarks/results/chunk_budgets.md). It does not grow with the
    batch; the fft backend sizes its grad_weight chunks against it.

    Examples:
        >>> weight_scratch(ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96))
        172480
    """
    return spec.taps * math.prod(spec.y_size[-2:]) + 4 * math.prod(spec.weight_shape)


@register
class NativeBackend(FusedBackend):
    """aten.convolution_backward: whatever kernel PyTorch picks for this device and dtype."""

    name = "native"
    supports_complex = True

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        if grad_output.is_complex():
            # torch's convention: grad_input pairs grad_output with conj(weight), grad_weight with conj(input)
            gi = _complex_bilinear(lambda gy, w: self.input_grad(spec, w, gy), grad_output,
                                   weight.conj()) if need_input else None  # type: ignore[union-attr]
            gw = _complex_bilinear(lambda x, gy: self.weight_grad(spec, x, gy), input.conj(),
                                   grad_output) if need_weight else None  # type: ignore[union-attr]
            return gi, gw
        excess = spec.padding_excess
        like = grad_output
        if input is None:
            input = placeholder(spec.input_shape, like)
        if weight is None:
            weight = placeholder(spec.weight_shape, like)
        if spec.transposed:
            grad_output = pad(grad_output, excess)
        else:
            input = pad(input, excess)
        gi, gw, _ = _convolution_backward(grad_output, input, weight, spec, [need_input, need_weight, False])
        if gi is not None and not spec.transposed:
            gi = crop(gi, excess)
        if gw is not None and gw.dtype in HALF_DTYPES and spec.reads_only_padding:
            gw = zero_padding_only_taps(gw, spec)
        return (gi if need_input else None), (gw if need_weight else None)


@dataclass(frozen=True)
class NativeBackward:
    """The step of a plan that runs this backend on a convolution derived from the user's: channels_last's 2d view
    of a 1d conv, regroup's merged groups."""

    spec: ConvSpec  # the convolution it runs
    detail: str  # what sets it apart, for describe()

    def __call__(self, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
                 need_input: bool, need_weight: bool) -> Grads:
        return get_backend("native").backward(self.spec, grad_output, input, weight, need_input, need_weight)

    def describe(self) -> str:
        return f"aten.convolution_backward {self.detail}"
