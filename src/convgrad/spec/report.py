"""Reporting: one convolution described in one line, in torch's argument names."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from convgrad.spec.geometry import ConvSpec

__all__ = ["describe"]


def describe(spec: ConvSpec) -> str:
    """``ConvSpec.describe``: the arguments that differ from their defaults; an unbatched input as given.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> describe(ConvSpec.from_shapes((3, 9, 8), (4, 3, 2, 2), stride=2))
        'conv2d input=(3, 9, 8) (unbatched) weight=(4, 3, 2, 2) stride=(2, 2)'
    """
    kind = "conv_transpose" if spec.transposed else "conv"
    given = f"{spec.input_shape[1:]} (unbatched)" if spec.unbatched else f"{spec.input_shape}"
    parts = [f"{kind}{spec.n}d input={given} weight={spec.weight_shape}"]
    for name, value, default in (
        ("stride", spec.stride, (1,) * spec.n),
        ("padding", spec.padding, ((0, 0),) * spec.n),
        ("dilation", spec.dilation, (1,) * spec.n),
        ("output_padding", spec.output_padding, (0,) * spec.n),
    ):
        if value != default:
            parts.append(f"{name}={value}")
    if spec.groups != 1:
        parts.append(f"groups={spec.groups}")
    return " ".join(parts)
