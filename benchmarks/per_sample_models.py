"""The models of benchmarks/per_sample.py: conv nets that DP-SGD users train, each with its input shape.

Every model takes a batch of 32 and returns (N, 10) logits; normalisation is GroupNorm (BatchNorm mixes
the samples of a batch and has no per-sample gradient). Five are timm's (``TIMM``, built by
benchmarks/timm_models.py: BatchNorm replaced by GroupNorm, 32x32 inputs, everything else as timm writes it,
in-place activations included), listed whether or not timm is installed (``timm_available``).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable

import timm_models
import torch
import torch.nn.functional as F
from torch import nn

CLASSES = 10


def small_cnn() -> nn.Module:
    """Three 3x3 convs with ReLU and max-pools on 32x32 images, one linear layer (the Opacus tutorials' size)."""
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 4 * 4, CLASSES))


class _Basic(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(32, c_out, affine=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(32, c_out, affine=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.GroupNorm(32, c_out, affine=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        return F.relu(self.gn2(self.conv2(out)) + self.shortcut(x))


def resnet18() -> nn.Module:
    """CIFAR ResNet-18 (3x3 stem, no max-pool), GroupNorm(32) without affine parameters: 11.2M parameters."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(32, 64, affine=False), nn.ReLU()]
    c = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Basic(c, c_out, stride), _Basic(c_out, c_out, 1)]
        c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


def vgg11() -> nn.Module:
    """CIFAR VGG-11 (conv 3x3 + ReLU, five max-pools, one linear classifier): 9.2M parameters."""
    layers: list[nn.Module] = []
    c = 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU()]
            c = int(v)
    layers += [nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


class _WideBlock(nn.Module):
    """Pre-activation wide basic block: GN-ReLU-conv3x3-GN-ReLU-conv3x3, 1x1 shortcut when the shape changes."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.gn1, self.conv1 = nn.GroupNorm(16, c_in), nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn2, self.conv2 = nn.GroupNorm(16, c_out), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride, bias=False) if stride != 1 or c_in != c_out else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)
        out = self.conv1(out)
        return self.conv2(F.relu(self.gn2(out))) + skip


def wrn16_4() -> nn.Module:
    """WRN-16-4 of De et al. (2022) for CIFAR: GroupNorm(16), no weight standardisation, 2.7M parameters."""
    layers: list[nn.Module] = [nn.Conv2d(3, 16, 3, padding=1, bias=False)]
    c = 16
    for c_out, stride in ((64, 1), (128, 2), (256, 2)):
        layers += [_WideBlock(c, c_out, stride), _WideBlock(c_out, c_out, 1)]
        c = c_out
    layers += [nn.GroupNorm(16, c), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, CLASSES)]
    return nn.Sequential(*layers)


def conv1d_audio() -> nn.Module:
    """wav2vec 2.0's feature extractor at 128 channels on 0.5 s of 16 kHz audio: strided kernels 10/5, 3/2 (x4),
    2/2 (x2), GroupNorm after the first, GELU; mean over time, one linear layer."""
    c = 128
    layers: list[nn.Module] = [nn.Conv1d(1, c, 10, 5, bias=False), nn.GroupNorm(c, c), nn.GELU()]
    for k, s in ((3, 2),) * 4 + ((2, 2),) * 2:
        layers += [nn.Conv1d(c, c, k, s, bias=False), nn.GELU()]
    layers += [nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(c, CLASSES)]
    return nn.Sequential(*layers)


class UNet(nn.Module):
    """A small U-Net on 32x32: two down steps (max-pool, conv3x3 pairs), two up steps (ConvTranspose2d 2x2 stride 2,
    skip concatenation, conv3x3), GroupNorm; the 1x1 head's per-pixel logits averaged to (N, 10)."""

    def __init__(self) -> None:
        super().__init__()

        def double(c_in: int, c_out: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU(),
                                 nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(8, c_out), nn.ReLU())

        self.enc1, self.enc2, self.mid = double(3, 32), double(32, 64), double(64, 128)
        self.up2, self.dec2 = nn.ConvTranspose2d(128, 64, 2, stride=2), double(128, 64)
        self.up1, self.dec1 = nn.ConvTranspose2d(64, 32, 2, stride=2), double(64, 32)
        self.head = nn.Conv2d(32, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)  # (N, 32, 32, 32)
        e2 = self.enc2(F.max_pool2d(e1, 2))  # (N, 64, 16, 16)
        m = self.mid(F.max_pool2d(e2, 2))  # (N, 128, 8, 8)
        d2 = self.dec2(torch.cat([self.up2(m), e2], 1))  # (N, 64, 16, 16)
        d1 = self.dec1(torch.cat([self.up1(d2), e1], 1))  # (N, 32, 32, 32)
        return self.head(d1).mean((2, 3))  # (N, 10)


class _LargeKernelBlock(nn.Module):
    def __init__(self, c: int, k: int, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.dw = nn.Conv2d(c, c, k, padding=k // 2, groups=c, bias=False)
        self.norm = norm(c)
        self.pw = nn.Conv2d(c, c, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pw(F.gelu(self.norm(self.dw(x))))


def replknet_small(norm: str = "group", channels: int = 64, blocks: int = 3, kernel: int = 31) -> nn.Module:
    """A RepLKNet-style net on 56x56: a 3x3 stride-2 stem to 28x28, ``blocks`` residual blocks of a ``kernel`` x
    ``kernel`` depthwise conv, a norm (GroupNorm for DP, or "batch": BatchNorm, as RepLKNet), GELU and a 1x1 conv;
    mean over space, one linear layer (issue 28's training-step and DP benchmarks)."""
    def make(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if norm == "batch" else nn.GroupNorm(16, c)

    return nn.Sequential(nn.Conv2d(3, channels, 3, 2, 1), make(channels), nn.GELU(),
                         *(_LargeKernelBlock(channels, kernel, make) for _ in range(blocks)),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES))


# timm's conv architectures of issue 38's benchmark (its smallest variants): inverted residuals with squeeze-excitation
# (efficientnet_b0, mobilenetv3_small_100, hard-swish), ConvNeXt (7x7 depthwise, LayerNorm2d, layer-scale gamma),
# RegNetX (grouped 3x3), NF-ResNet (ScaledStdConv2d: weights standardised in the forward, a trainable gain)
TIMM = ("efficientnet_b0", "convnext_atto", "mobilenetv3_small_100", "regnetx_002", "nf_resnet26")


def timm_available() -> bool:
    """Whether timm is installed (benchmarks/requirements.txt)."""
    return importlib.util.find_spec("timm") is not None


MODELS: dict[str, Callable[[], nn.Module]] = {"small_cnn": small_cnn, "resnet18": resnet18, "vgg11": vgg11,
                                              "wrn16_4": wrn16_4, "conv1d_audio": conv1d_audio, "unet": UNet,
                                              "replknet_small": replknet_small,
                                              **{name: functools.partial(timm_models.create, name, CLASSES)
                                                 for name in TIMM}}
INPUT_SHAPES: dict[str, tuple[int, ...]] = {name: (1, 8000) if name == "conv1d_audio" else (3, 32, 32)
                                            for name in MODELS}  # one sample's shape
INPUT_SHAPES["replknet_small"] = (3, 56, 56)
