"""The shared tensor helpers of ``convgrad.tensor_ops``: each replaced two to five copies (issue 27), so each is
checked here against its definition, not against another copy."""

from __future__ import annotations

import itertools

import pytest
import torch

from convgrad.spec import ConvSpec
from convgrad.tensor_ops import CHANNELS_LAST, channels_innermost, crop, is_channels_last, pad, pad_flat, windows

SHAPES = [  # (input, weight, stride, padding, dilation): 1d to 3d, stride leaving rows unread, dilation with stride
    ((2, 3, 9), (4, 3, 3), 2, 1, 1),
    ((1, 2, 7, 6), (2, 2, 2, 3), (2, 1), ((1, 0), (0, 2)), (1, 2)),
    ((1, 1, 5, 6, 4), (1, 1, 2, 2, 3), (1, 2, 1), 0, (2, 1, 1)),
]


@pytest.mark.parametrize("shapes", SHAPES)
def test_windows_are_the_rows_each_tap_reads(shapes: tuple) -> None:
    """windows(x_read)[n, c, *j, *t] == x_read[n, c, *(j*s + t*d)]: the one N-d unfold of gemm, the per-sample
    im2col and fwdconv's FoldTaps."""
    spec = ConvSpec.from_shapes(*shapes[:2], stride=shapes[2], padding=shapes[3], dilation=shapes[4])
    x = pad(torch.randn(spec.x_shape, dtype=torch.float64), spec.x_read_pads)  # (N, C, *x_read_size)
    got = windows(x, spec.kernel_size, spec.stride, spec.dilation)
    assert got.shape == (*x.shape[:2], *spec.y_size, *spec.kernel_size)
    for j in itertools.product(*map(range, spec.y_size)):
        for t in itertools.product(*map(range, spec.kernel_size)):
            rows = tuple(a * s + b * d for a, b, s, d in zip(j, t, spec.stride, spec.dilation))
            assert torch.equal(got[(..., *j, *t)], x[(..., *rows)])


def test_pad_flat_is_f_pad_order_and_crop_undoes_pad() -> None:
    assert pad_flat([(1, 2), (3, 4), (5, 6)]) == [5, 6, 3, 4, 1, 2]
    x = torch.randn(2, 3, 5, 4)
    pairs = [(2, -1), (-1, 3)]
    assert torch.equal(pad(x, pairs), torch.nn.functional.pad(x, pad_flat(pairs)))
    assert torch.equal(crop(pad(x, [(2, 1), (1, 3)]), [(2, 1), (1, 3)]), x)
    assert crop(x, [(1, 2), (0, 1)]).shape == (2, 3, 2, 3)


def test_the_two_channels_last_predicates_keep_their_two_meanings() -> None:
    """is_channels_last: the memory format of the rank (4d, 5d only); channels_innermost: strides, any rank >= 3."""
    for dim, fmt in CHANNELS_LAST.items():
        t = torch.randn(2, 3, *(4,) * (dim - 2)).contiguous(memory_format=fmt)
        assert is_channels_last(t) and channels_innermost(t)
        assert not is_channels_last(t.contiguous()) and not channels_innermost(t.contiguous())
    nlc = torch.randn(2, 5, 3).transpose(1, 2)  # (N, C, L) with the channels innermost: no memory format for 3d
    assert channels_innermost(nlc) and not is_channels_last(nlc)
    one_channel = torch.randn(2, 1, 4, 4).contiguous(memory_format=torch.channels_last)
    assert not channels_innermost(one_channel)  # one channel: nothing to keep innermost
