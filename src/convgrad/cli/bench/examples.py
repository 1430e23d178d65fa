"""Models to try `convgrad bench --model` on, importable as ``convgrad.cli.bench.examples:NAME`` from anywhere.

``replknet_block`` is the stage of a large-kernel network that the docs' large-kernel how-to starts from: RepLKNet's
block (Ding et al., "Scaling Up Your Kernels to 31x31", CVPR 2022, its ``RepLKBlock`` and ``ConvFFN``) as it
trains, before its branches are merged into one kernel for inference.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ConvFFN", "RepLKBlock", "ReparamLargeKernel", "replknet_block"]


def _conv_bn(c_in: int, c_out: int, kernel: int, groups: int = 1) -> nn.Sequential:
    """A conv without bias and its BatchNorm, 'same' padding (RepLKNet's ``conv_bn``)."""
    return nn.Sequential(nn.Conv2d(c_in, c_out, kernel, padding=kernel // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(c_out))


class ReparamLargeKernel(nn.Module):
    """A ``kernel`` x ``kernel`` depthwise conv and a ``small`` x ``small`` one beside it, each with its BatchNorm,
    summed (RepLKNet's ``ReparamLargeKernelConv`` while training).

    Shape: ``(N, C, H, W) -> (N, C, H, W)``.
    """

    def __init__(self, channels: int, kernel: int = 31, small: int = 5) -> None:
        super().__init__()
        self.large = _conv_bn(channels, channels, kernel, groups=channels)
        self.small = _conv_bn(channels, channels, small, groups=channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.large(x) + self.small(x)


class RepLKBlock(nn.Module):
    """``x + pw2(relu(lk(relu(pw1(bn(x))))))``: 1x1 convs around the large depthwise kernel (RepLKNet's
    ``RepLKBlock``; its drop-path is left out).

    Shape: ``(N, C, H, W) -> (N, C, H, W)``.
    """

    def __init__(self, channels: int, kernel: int = 31) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.pw1 = nn.Sequential(_conv_bn(channels, channels, 1), nn.ReLU())
        self.lk = ReparamLargeKernel(channels, kernel)
        self.pw2 = _conv_bn(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(torch.relu(self.lk(self.pw1(self.norm(x)))))


class ConvFFN(nn.Module):
    """``x + pw2(gelu(pw1(bn(x))))``, 4x wide inside (RepLKNet's ``ConvFFN``).

    Shape: ``(N, C, H, W) -> (N, C, H, W)``.
    """

    def __init__(self, channels: int, ratio: int = 4) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.pw1 = _conv_bn(channels, channels * ratio, 1)
        self.pw2 = _conv_bn(channels * ratio, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw2(nn.functional.gelu(self.pw1(self.norm(x))))


def replknet_block(channels: int = 64, kernel: int = 31) -> nn.Module:
    """One block of RepLKNet: ``RepLKBlock`` (a 31x31 depthwise kernel with a 5x5 one beside it, between 1x1 convs)
    then ``ConvFFN``; RepLKNet-31B's first stage runs such blocks at 128 channels on 56x56.

    Args:
        channels: C, the input's channels (default 64).
        kernel: the large kernel's size (default 31).

    Returns:
        An ``nn.Module`` mapping ``(N, channels, H, W)`` to the same shape: 6 convs (two depthwise, four 1x1).

    Source: Ding et al., "Scaling Up Your Kernels to 31x31: Revisiting Large Kernel Design in CNNs", CVPR 2022.

    Examples:
        >>> import torch
        >>> replknet_block(channels=8)(torch.randn(2, 8, 16, 16)).shape
        torch.Size([2, 8, 16, 16])
    """
    return nn.Sequential(RepLKBlock(channels, kernel), ConvFFN(channels))
