"""Which native kernel ``aten.convolution_backward`` runs for a configuration, and why.

aten picks a backend with ``select_conv_backend`` (aten/src/ATen/native/Convolution.cpp)
from the device, dtype, shapes and global flags, then calls that backend's backward.
``torch._C._select_conv_backend`` exposes the same selection; this module asks it,
with the very shapes and symmetric padding that convgrad's native backend hands to
aten, and explains the answer from the table below. tests/test_explain.py checks the
table against what torch.profiler and oneDNN's verbose log record while the backward
really runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from convgrad.errors import ConvgradTypeError
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg, padded_sizes
from convgrad.tensor_ops import CHANNELS_LAST, is_channels_last

__all__ = ["NativeChoice", "native_backend"]


class _Kernel(NamedTuple):
    kernel: str  # the aten function that computes the backward
    explanation: str
    loops_over_groups: bool  # aten calls the kernel once per group and concatenates (no native groups)
    profiler_ops: tuple[str, ...] = ()  # dispatcher ops the kernel itself records under aten::convolution_backward
    forward_op: str | None = None  # the dispatcher op the forward of the same configuration records
    onednn: bool = False  # runs oneDNN primitives (visible with torch.backends.mkldnn.verbose)


# One line per torch._C._ConvBackend value, in aten's enum order.
_KERNELS: dict[str, _Kernel] = {
    "CudaDepthwise2d": _Kernel("conv_depthwise2d_backward", "PyTorch's own CUDA depthwise kernel "
                               "(groups == C_in, C_out a multiple of C_in), used when cuDNN's depthwise "
                               "heuristics decline", False, (), "aten::_conv_depthwise2d"),
    "CudaDepthwise3d": _Kernel("conv_depthwise3d_backward", "PyTorch's own CUDA 3d depthwise kernel "
                               "(groups == C_in)", False, (), "aten::conv_depthwise3d"),
    "Cudnn": _Kernel("cudnn_convolution_backward", "cuDNN: NVIDIA's library picks an algorithm (implicit GEMM, "
                     "FFT, Winograd; torch.backends.cudnn.benchmark times them); groups are native",
                     False, (), "aten::cudnn_convolution"),
    "CudnnTranspose": _Kernel("cudnn_convolution_transpose_backward", "cuDNN for a transposed conv: its "
                              "grad_input is cuDNN's forward conv, grad_weight its weight-gradient kernel",
                              False, (), "aten::cudnn_convolution_transpose"),
    "Empty": _Kernel("zeros_like", "empty batch or channels: no kernel runs, the gradients are zeros",
                     False),
    "Miopen": _Kernel("miopen_convolution_backward", "AMD MIOpen (ROCm); groups are native",
                      False, (), "aten::miopen_convolution"),
    "MiopenDepthwise": _Kernel("miopen_depthwise_convolution_backward", "AMD MIOpen's depthwise kernel",
                               False, (), "aten::miopen_depthwise_convolution"),
    "MiopenTranspose": _Kernel("miopen_convolution_transpose_backward", "AMD MIOpen for a transposed conv",
                               False, (), "aten::miopen_convolution_transpose"),
    "Mkldnn": _Kernel("mkldnn_convolution_backward", "oneDNN: JIT-compiled direct convolution on a blocked "
                      "memory layout; CPU float32 when batch, kernel or thread count make it pay off, and "
                      "bfloat16/float16 where the CPU supports them; groups are native",
                      False, (), "aten::mkldnn_convolution", True),
    "MkldnnTranspose": _Kernel("mkldnn_convolution_transpose_backward", "oneDNN deconvolution (transposed conv) "
                               "backward on CPU; torch 2.13 prints this ConvBackend value (9) as '???'",
                               False, (), None, True),
    "MkldnnEmpty": _Kernel("zeros_like", "empty oneDNN (mkldnn layout) tensor: no kernel runs", False),
    "NnpackSpatial": _Kernel("_nnpack_spatial_convolution (backward)", "NNPACK: CPU float32 with batch >= 16 "
                             "in builds where oneDNN is off; called once per group", True, (),
                             "aten::_nnpack_spatial_convolution"),
    "Overrideable": _Kernel("convolution_backward_overrideable", "an out-of-tree device backend registered "
                            "with TORCH_LIBRARY_IMPL", False, (), "aten::convolution_overrideable"),
    "Slow2d": _Kernel("_slow_conv2d_backward", "THNN slow_conv2d: im2col (unfold) + GEMM per sample; CPU "
                      "float64/float16/complex and small float32 problems where oneDNN is not used (1d runs "
                      "as 2d); called once per group", True, ("aten::_slow_conv2d_backward",), "aten::thnn_conv2d"),
    "Slow3d": _Kernel("slow_conv3d_backward_cpu", "THNN slow_conv3d: vol2col + GEMM per sample for non-dilated "
                      "3d convs on CPU; groups are native", False, (), "aten::slow_conv3d"),
    "SlowDilated2d": _Kernel("slow_conv_dilated2d_backward", "im2col with dilation + GEMM per sample (dilated 1d/2d "
                             "convs on CPU, or CUDA without cuDNN); called once per group", True, (),
                             "aten::slow_conv_dilated2d"),
    "SlowDilated3d": _Kernel("slow_conv_dilated3d_backward", "vol2col with dilation + GEMM per sample (dilated 3d "
                             "on CPU, any 3d on CUDA without cuDNN); called once per group", True, (),
                             "aten::slow_conv_dilated3d"),
    "SlowTranspose2d": _Kernel("slow_conv_transpose2d_backward", "transposed conv as GEMM + col2im per sample; its "
                               "grad_input is an im2col forward conv of grad_output; called once per group",
                               True, (), "aten::slow_conv_transpose2d"),
    "SlowTranspose3d": _Kernel("slow_conv_transpose3d_backward", "3d transposed conv as GEMM + col2vol per sample; "
                               "called once per group", True, (), "aten::slow_conv_transpose3d"),
    "Winograd3x3Depthwise": _Kernel("none (inference only)", "ARM NEON 3x3 depthwise Winograd; aten never picks it "
                                    "when a backward is needed", False),
    "Xnnpack2d": _Kernel("none (inference only)", "XNNPACK (mobile builds); aten never picks it when a backward "
                         "is needed", False),
    "Mps": _Kernel("mps_convolution_backward", "Apple Metal (MPSGraph)", False, (), "aten::_mps_convolution"),
    "MpsTranspose": _Kernel("mps_convolution_transpose_backward", "Apple Metal (MPSGraph), transposed conv",
                            False, (), "aten::_mps_convolution_transpose"),
}

# aten's ConvBackend enum order; pybind leaves some values without a Python name (9 prints as '???' in 2.13).
_ENUM_ORDER = list(_KERNELS)


def _backend_name(value: Any) -> str:
    """The ConvBackend's name; values that torch prints without one are named from aten's enum order."""
    name = str(getattr(value, "name", "???")).rstrip(",")  # 2.13 spells one member 'MpsTranspose,'
    if name in _KERNELS:
        return name
    index = int(value)
    return _ENUM_ORDER[index] if 0 <= index < len(_ENUM_ORDER) else f"ConvBackend({index})"


@dataclass(frozen=True)
class NativeChoice:
    """The native kernel PyTorch dispatches a convolution's backward to, with a one-line reason.

    Attributes:
        backend: the ``torch._C._ConvBackend`` name, e.g. ``"Mkldnn"`` or ``"Slow2d"``.
        kernel: the aten function that computes the backward, e.g. ``"_slow_conv2d_backward"``.
        explanation: one line on what that kernel does and when aten picks it.
        loops_over_groups: True when aten calls the kernel once per group and concatenates the results.
        groups: the configuration's groups (so ``loops_over_groups`` means ``groups`` kernel calls).
        profiler_ops: operators torch.profiler records for the kernel inside ``aten::convolution_backward``.
        forward_op: the operator torch.profiler records for the forward of the same configuration, if any.
        onednn: the kernel runs oneDNN primitives.
        dtype, device: what the choice was made for.
    """

    backend: str
    kernel: str
    explanation: str
    loops_over_groups: bool
    groups: int
    profiler_ops: tuple[str, ...]
    forward_op: str | None
    onednn: bool
    dtype: torch.dtype
    device: torch.device

    def __str__(self) -> str:
        calls = (f"; {self.groups} kernel calls, one per group" if self.loops_over_groups and self.groups > 1
                 else "")
        return (f"native backward on {self.device} {self.dtype}: {self.kernel} (ConvBackend.{self.backend})\n"
                f"  {self.explanation}{calls}")


def _probe(shape: Sequence[int], like: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor of the shape, in the memory format of `like`, that asks for a gradient."""
    fmt = torch.contiguous_format
    if like is not None and like.dim() == len(shape) and is_channels_last(like):
        fmt = CHANNELS_LAST[len(shape)]
    return torch.empty(tuple(shape), dtype=dtype, device=device, memory_format=fmt).requires_grad_()


def _resolve(fn: str, input: Any, weight: Any, dtype: Any, device: Any) -> tuple[
        tuple[int, ...], tuple[int, ...], torch.dtype, torch.device, torch.Tensor | None]:
    tensors = [isinstance(t, torch.Tensor) for t in (input, weight)]
    if any(tensors):
        if not all(tensors):
            raise ConvgradTypeError(f"{fn}: input and weight must both be tensors or both be sizes")
        if dtype is not None or device is not None:
            raise ConvgradTypeError(f"{fn}: dtype and device are taken from the tensors; pass them only with sizes")
        if input.dtype != weight.dtype or input.device != weight.device:
            raise ConvgradTypeError(f"{fn}: input ({input.dtype}, {input.device}) and weight ({weight.dtype}, "
                                    f"{weight.device}) must share dtype and device")
        return tuple(input.shape), tuple(weight.shape), input.dtype, input.device, input
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        raise ConvgradTypeError(f"{fn}: dtype={dtype!r} must be a floating or complex torch.dtype")
    return input, weight, dtype, torch.device("cpu" if device is None else device), None


def native_backend(
    input: torch.Tensor | Sequence[int],
    weight: torch.Tensor | Sequence[int],
    stride: IntOrTuple = 1,
    padding: PaddingArg = 0,
    dilation: IntOrTuple = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> NativeChoice:
    """Which native kernel ``aten.convolution_backward`` runs for this convolution, and why.

    Args:
        input: tensor or size ``(N, C_in, *spatial)`` (or unbatched ``(C_in, *spatial)``).
        weight: tensor or size ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when transposed.
        stride, padding, dilation, transposed, output_padding, groups: aten order, as in
            ``convgrad.conv_backward`` (defaults 1, 0, 1, False, 0, 1).
        dtype: with sizes only; default ``torch.float32``.
        device: with sizes only; default ``"cpu"``.

    Returns:
        NativeChoice: the kernel's name, a one-line explanation, whether it loops over groups.

    Raises:
        TypeError: tensors mixed with sizes, dtype/device given with tensors, a non-floating dtype.
        ValueError: invalid hyperparameters or shapes (as ``convgrad.ConvSpec``).

    Source: ``select_conv_backend`` in aten/src/ATen/native/Convolution.cpp;
    the docs' "How do I..." page, the first question.

    Examples:
        >>> import torch, convgrad as cg
        >>> cg.native_backend((8, 16, 32, 32), (16, 16, 3, 3), padding=1, dtype=torch.float64).kernel
        '_slow_conv2d_backward'
    """
    fn = "native_backend"
    in_shape, w_shape, dtype, dev, like = _resolve(fn, input, weight, dtype, device)
    spec = ConvSpec.from_shapes(in_shape, w_shape, stride, padding, dilation, transposed, output_padding, groups,
                                fn=fn)
    # The native backend pads the asymmetric excess onto a forward conv's input and hands aten the rest.
    size = spec.input_size
    if not spec.transposed:
        size = padded_sizes(size, spec.padding_excess)
    # Complex convolutions run as real ones (torch's Gauss trick, convgrad's four real calls): ask for the real dtype.
    real = dtype.to_real() if dtype.is_complex else dtype
    x = _probe((spec.batch, spec.in_channels, *size), like, real, dev)
    w = _probe(spec.weight_shape, None, real, dev)
    select = getattr(torch._C, "_select_conv_backend", None)
    if select is None:
        kernel = _Kernel("unknown", f"torch {torch.__version__} has no torch._C._select_conv_backend", False)
        name = "unknown"
    else:
        with torch.enable_grad():
            value = select(x, w, None, list(spec.stride), list(spec.symmetric_padding), list(spec.dilation),
                           spec.transposed, list(spec.output_padding), spec.groups)
        name = _backend_name(value)
        kernel = _KERNELS.get(name, _Kernel("unknown", f"ConvBackend value {int(value)} is not in convgrad's "
                                                       f"table for torch {torch.__version__}", False))
    return NativeChoice(name, kernel.kernel, kernel.explanation, kernel.loops_over_groups, spec.groups,
                        kernel.profiler_ops, kernel.forward_op, kernel.onednn, dtype, dev)


def known_profiler_ops() -> frozenset[str]:
    """Every operator name in the table's profiler_ops (to check that no other kernel's op ran)."""
    return frozenset(op for k in _KERNELS.values() for op in k.profiler_ops)
