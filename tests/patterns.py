"""Small copies of the ways real models hand over their convolutions and parameters (timm 1.0, StyleGAN, LoRA), for
the fast tier: subclasses with a forward of their own, convolutions called as functions, weights computed in the
forward, parameters that meet the samples outside any layer function. The full tier runs timm itself
(tests/test_timm.py)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _pad_same(x: torch.Tensor, k: tuple[int, ...], s: tuple[int, ...], d: tuple[int, ...]) -> torch.Tensor:
    """timm's pad_same: TF's 'SAME' pads, computed from the input size in the forward."""
    pads = []
    for i, kk, ss, dd in zip(x.shape[2:], k, s, d):
        total = max((math.ceil(i / ss) - 1) * ss + (kk - 1) * dd + 1 - i, 0)
        pads.append((total // 2, total - total // 2))
    return F.pad(x, [p for pair in reversed(pads) for p in pair])


class SameConv(nn.Conv2d):
    """timm's Conv2dSame: pads in its own forward, then F.conv2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _pad_same(x, self.kernel_size, self.stride, self.dilation)
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class StdConv(nn.Conv2d):
    """timm's StdConv2d: the weight standardised in the forward, by batch_norm over the weight itself."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class ScaledStdConv(nn.Conv2d):
    """timm's ScaledStdConv2d (NFNets): standardised, then scaled by a trainable gain, in batch_norm's weight."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.gain = nn.Parameter(torch.full((self.out_channels, 1, 1, 1), 1.5))
        self.scale = self.weight[0].numel() ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(self.weight.reshape(1, self.out_channels, -1), None, None,
                         weight=(self.gain * self.scale).view(-1), training=True, momentum=0.0,
                         eps=1e-6).reshape_as(self.weight)
        return F.conv2d(x, w, self.bias, self.stride, self.padding, self.dilation, self.groups)


class BlurPool(nn.Module):
    """timm's BlurPool2d: a fixed binomial kernel (a buffer), reflect-padded, a strided depthwise F.conv2d."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        k = torch.tensor([1.0, 2.0, 1.0])
        self.register_buffer("filt", (k[:, None] * k[None, :] / 16).expand(channels, 1, 3, 3).clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (1, 1, 1, 1), mode="reflect")
        return F.conv2d(x, self.filt.to(x.dtype), stride=2, groups=self.channels)


class TimmLinear(nn.Linear):
    """timm's Linear: an nn.Linear subclass whose forward calls F.linear itself."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight, self.bias)


class LayerNorm2d(nn.LayerNorm):
    """timm's LayerNorm2d: LayerNorm over the channels of (N, C, H, W), by permuting around F.layer_norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class LayerScale(nn.Module):
    """timm's LayerScale: a trainable per-channel scale that meets the samples in a plain multiplication."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma.view(1, -1, 1, 1)


class Block(nn.Module):
    """A ConvNeXt block as timm writes it: depthwise conv, LayerNorm2d, two 1x1 convs, and a gamma that is the
    block's own parameter, multiplied in its forward; a residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 3, padding=1, groups=channels)
        self.norm = LayerNorm2d(channels)
        self.pw1 = nn.Conv2d(channels, 2 * channels, 1)
        self.pw2 = nn.Conv2d(2 * channels, channels, 1)
        self.gamma = nn.Parameter(torch.linspace(0.2, 1.0, channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pw2(F.gelu(self.pw1(self.norm(self.dw(x)))))
        return x + h.mul(self.gamma.reshape(1, -1, 1, 1))


class ModulatedConv(nn.Module):
    """StyleGAN2's modulated conv: a weight per sample (scaled by a style computed from the input), demodulated,
    then one grouped F.conv2d with the batch folded into the groups."""

    def __init__(self, cin: int, cout: int, k: int, style: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cout, cin, k, k) / math.sqrt(cin * k * k))
        self.affine = nn.Linear(style, cin)
        self.padding = k // 2

    def forward(self, x: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
        n, cin, h, w = x.shape
        s = self.affine(latent) + 1  # (N, C_in)
        wt = self.weight.unsqueeze(0) * s[:, None, :, None, None]  # (N, C_out, C_in, k, k)
        wt = wt * torch.rsqrt(wt.square().sum((2, 3, 4), keepdim=True) + 1e-8)
        out = F.conv2d(x.reshape(1, n * cin, h, w), wt.reshape(-1, cin, *wt.shape[3:]), padding=self.padding,
                       groups=n)  # (1, N·C_out, H, W)
        return out.reshape(n, -1, h, w)


class LoRALinear(nn.Module):
    """A LoRA-style linear: a frozen weight plus a trainable low-rank product, added in the forward."""

    def __init__(self, cin: int, cout: int, rank: int) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(cout, cin) / math.sqrt(cin), requires_grad=False)
        self.a = nn.Parameter(torch.randn(rank, cin) / math.sqrt(cin))
        self.b = nn.Parameter(torch.randn(cout, rank) / math.sqrt(rank))
        self.bias = nn.Parameter(torch.zeros(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.w0 + self.b @ self.a, self.bias)


class Functional(nn.Module):
    """Convolutions called as functions on the module's own parameters: 1d, transposed 2d, 3d."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(4, 2, 3) / 3)
        self.wt = nn.Parameter(torch.randn(4, 2, 3, 2) / 3)  # transposed: (C_in, C_out/g, kh, kw), groups 2
        self.bt = nn.Parameter(torch.randn(4))
        self.w3 = nn.Parameter(torch.randn(2, 4, 2, 2, 2) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, 2, L)
        h = torch.tanh(F.conv1d(x, self.w1, padding=1))  # (N, 4, L)
        h = h.unsqueeze(-1).expand(-1, -1, -1, 3)  # (N, 4, L, 3)
        h = F.conv_transpose2d(h, self.wt, self.bt, stride=2, padding=1, output_padding=1, groups=2)
        h = h.unsqueeze(2).expand(-1, -1, 2, -1, -1)  # (N, 4, 2, H, W)
        return F.conv3d(h, self.w3, stride=(1, 2, 1))


def network(channels: int = 4) -> nn.Module:
    """The 2d patterns in one network (N, 3, 12, 12) -> (N, 3): every way of handing over a conv but the
    modulated one, which takes a second input."""
    return nn.Sequential(
        SameConv(3, channels, 3, stride=2), nn.GELU(),  # (N, C, 6, 6)
        StdConv(channels, channels, 3, padding=1), ScaledStdConv(channels, channels, 3, padding=1),
        BlurPool(channels),  # (N, C, 3, 3)
        Block(channels), LayerScale(channels), nn.GroupNorm(2, channels),
        nn.Flatten(), TimmLinear(channels * 9, 8), nn.Tanh(), LoRALinear(8, 3, 2))
