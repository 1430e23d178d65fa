"""fwdconv's forward: torch's own convolution on the input padded beforehand, with zero padding (auto races it).

Contraction (per group, T = kernel taps, P = output positions; the forward conv itself):
    y [N, C_y/g, P] = x_pad [N, C_x/g, windows of P] . w [C_y/g, C_x/g, T]      x_pad = pad(x, (p_lo, p_hi) per dim)
The same sums as native's forward, in the same kernel family; only who pads differs. On the CPU, oneDNN's jit
kernels refuse a large padding in the last (width) dim and the layer falls back to im2col + gemm
(``x64:gemm:jit`` in ``ONEDNN_VERBOSE=1``), 5-18x slower on a large depthwise kernel; with padding 0 on an input
padded here the jit kernel runs (benchmarks/results/padded_forward.md, made by benchmarks/padded_forward.py).
The gradients stay the backends' own: a padded input's grad_input would compute the pad rows' gradient too.
"""

from __future__ import annotations

import torch

from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import channels_innermost, pad

__all__ = ["DEPTHWISE_MIN_PAD", "DIRECT_MIN_CHANNELS", "DIRECT_MIN_PAD", "padded_forward", "worth_padding"]

# The cut measured on an AVX2 CPU (benchmarks/results/padded_forward.md): oneDNN's depthwise kernel (jit_dw) takes
# up to 4 rows of padding in the last dim, its direct kernel (jit:avx2, 8 or more channels per group) up to 3; past
# that native runs gemm and the padded forward wins (5-18x depthwise, 1.4-2.8x direct). Elsewhere both run the
# same kernel and the pad is extra work (0.7-0.9x). Other ISAs may cut elsewhere: the rule admits, the race decides.
DEPTHWISE_MIN_PAD = 5
DIRECT_MIN_PAD = 4
DIRECT_MIN_CHANNELS = 8


def worth_padding(spec: ConvSpec, like: torch.Tensor) -> bool:
    """Whether the padded forward can beat native's here (auto races it only then): a CPU float32 forward conv, not
    channels last, whose last dim's padding (the part aten gets, ``symmetric_padding``) is at least DEPTHWISE_MIN_PAD
    for a 1d or 2d depthwise conv (one channel per group on both sides) or DIRECT_MIN_PAD for one with
    DIRECT_MIN_CHANNELS or more channels per group on both sides. Layers with 2 to 4 channels per group, a channel
    multiplier, 3d depthwise, channels-last and float64 layers ran the same kernel either way or gained nothing
    clear (the sweep), and a ResNet's or ConvNeXt's paddings (1 to 3) are below both cuts.

    Args:
        spec: the convolution.
        like: its input (dtype, device and layout are read).

    Returns:
        bool.

    Examples:
        >>> import torch
        >>> from convgrad.spec import ConvSpec
        >>> x = torch.empty(4, 256, 28, 28)
        >>> worth_padding(ConvSpec.from_shapes(x.shape, (256, 1, 31, 31), padding=15, groups=256), x)
        True
        >>> worth_padding(ConvSpec.from_shapes(x.shape, (256, 1, 7, 7), padding=3, groups=256), x)
        False
    """
    if spec.transposed or like.device.type != "cpu" or like.dtype != torch.float32 or channels_innermost(like):
        return False
    per_group = spec.x_group_channels, spec.y_group_channels
    last = spec.symmetric_padding[-1]
    if per_group == (1, 1):  # in 3d oneDNN's brdgmm_dw kernel runs either way
        return spec.n <= 2 and last >= DEPTHWISE_MIN_PAD
    return min(per_group) >= DIRECT_MIN_CHANNELS and last >= DIRECT_MIN_PAD


def padded_forward(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The convolution (no bias) as ``aten.convolution`` on ``pad(input, spec.padding)`` with padding 0.

    Args:
        spec: a forward (not transposed) convolution.
        input: ``(N, C_in, *spatial)``, a real floating dtype.
        weight: ``(C_out, C_in/groups, *k)``, same dtype and device.

    Returns:
        ``spec.output_shape``: ``(N, C_out, *o)``, equal to native's forward up to the order of the sums.

    Raises:
        ValueError: a transposed ``spec``.
        TypeError: a complex input or weight (aten has no complex convolution; native's forward splits it).

    Examples:
        >>> import torch
        >>> from convgrad.spec import ConvSpec
        >>> x, w = torch.randn(2, 8, 20, 20, dtype=torch.float64), torch.randn(8, 1, 13, 12, dtype=torch.float64)
        >>> spec = ConvSpec.from_shapes(x.shape, w.shape, padding=((6, 6), (6, 5)), groups=8)
        >>> y = padded_forward(spec, x, w)
        >>> y.shape, torch.allclose(y, torch.nn.functional.conv2d(torch.nn.functional.pad(x, (6, 5, 6, 6)), w,
        ...                                                       groups=8))
        (torch.Size([2, 8, 20, 20]), True)

    Source: the forward's definition (DESIGN.md, "The mathematics"); padding 0 on a zero-padded input reads the same
    rows.
    """
    if spec.transposed:
        raise ConvgradValueError("fwdconv.forward: transposed=True is not served (a transposed conv's forward is a "
                                 "different kernel); use the native forward")
    for name, t in (("input", input), ("weight", weight)):
        if t.is_complex():
            raise ConvgradTypeError(f"fwdconv.forward: {name} dtype {t.dtype} is not served (complex); use the native "
                                    "forward")
    zeros = (0,) * spec.n
    return torch.ops.aten.convolution(pad(input, spec.padding), weight, None, spec.stride, zeros, spec.dilation,
                                      False, zeros, spec.groups)
