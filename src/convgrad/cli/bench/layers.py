"""Named suites of real convolution layers, each labelled with the network it comes from.

* ``default``: 20 layers of common image, audio and video networks. Batch sizes are chosen so that one
  backward (grad_input and grad_weight) by the native backend takes roughly 10 to 500 ms on a 2-core
  AVX-512 CPU in float32.
* ``slow``: layers whose backward PyTorch users report slow on the CPU: depthwise and grouped 3d
  convs (channel-separated video networks), large and strided depthwise kernels (ConvNeXt,
  EfficientNet) and 1d depthwise convs (speech). Batches are sized so that native's forward takes at
  least 5 ms there: below that, the fixed cost of a call dominates every ratio to the forward.
* ``large``: large kernels from published models (RepLKNet, SLaK, UniRepLKNet, wav2vec 2.0's positional conv,
  Hyena, SincNet, wav2letter, HiFi-GAN, 3D UX-Net), where the fft backend pays, with two controls. It times its
  own backends by default (``SUITE_BACKENDS``): fft, fwdconv and auto.
* ``all``: default and slow. ``smoke``: tiny versions of a few layers, for tests.

Every layer runs in float32; the layers marked ``float64`` form the float64 subset.
``convgrad bench --list`` (or ``benchmarks/layers.py``) prints the suites.

Examples:
    >>> from convgrad.cli.bench.layers import SUITES
    >>> layer = SUITES["default"][0]
    >>> layer.name, layer.network, layer.spec().output_shape
    ('resnet50.stem7x7s2', 'ResNet-50', (8, 64, 112, 112))
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from fnmatch import fnmatch
from typing import Any

from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec

__all__ = ["SUITES", "SUITE_BACKENDS", "Layer", "select"]


@dataclass(frozen=True)
class Layer:
    """One convolution of a real network, in torch's argument names.

    Attributes:
        name: unique, ``network.layer``.
        network: the network it comes from.
        where: where in the network (stage, block).
        input_shape: ``(N, C_in, *spatial)``; N is the benchmark's batch.
        weight_shape: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when transposed.
        float64: part of the float64 subset.
    """

    name: str
    network: str
    where: str
    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: Any = 1
    padding: Any = 0
    dilation: Any = 1
    groups: int = 1
    transposed: bool = False
    output_padding: Any = 0
    float64: bool = False

    def spec(self) -> ConvSpec:
        """The validated configuration."""
        return ConvSpec.from_shapes(self.input_shape, self.weight_shape, self.stride, self.padding, self.dilation,
                                    self.transposed, self.output_padding, self.groups, fn=f"layer {self.name}")

    def gflop(self) -> float:
        """GFLOP of one gradient (2 per multiply-accumulate; grad_input and grad_weight cost the same)."""
        return 2 * self.spec().macs() / 1e9


def _conv(name: str, network: str, where: str, n: int, cin: int, cout: int, size: Any, k: Any,
          **kw: Any) -> Layer:
    size = (size,) if isinstance(size, int) else tuple(size)
    k = (k,) * len(size) if isinstance(k, int) else tuple(k)
    g = kw.get("groups", 1)
    weight = (cin, cout // g, *k) if kw.get("transposed") else (cout, cin // g, *k)
    return Layer(name, network, where, (n, cin, *size), weight, **kw)


_R50 = "ResNet-50"
_MB2 = "MobileNetV2"
DEFAULT: tuple[Layer, ...] = (
    _conv("resnet50.stem7x7s2", _R50, "conv1", 8, 3, 64, (224, 224), 7, stride=2, padding=3),
    _conv("resnet50.3x3@56", _R50, "layer1 conv2", 8, 64, 64, (56, 56), 3, padding=1, float64=True),
    _conv("resnet50.3x3@28", _R50, "layer2 conv2", 8, 128, 128, (28, 28), 3, padding=1),
    _conv("resnet50.3x3@14", _R50, "layer3 conv2", 8, 256, 256, (14, 14), 3, padding=1),
    _conv("resnet50.3x3@7", _R50, "layer4 conv2", 8, 512, 512, (7, 7), 3, padding=1),
    _conv("resnet50.3x3s2", _R50, "layer2.0 conv2 (v1.5 stride)", 8, 128, 128, (56, 56), 3, stride=2, padding=1,
          float64=True),
    _conv("resnet50.1x1reduce", _R50, "layer1 conv1", 8, 256, 64, (56, 56), 1),
    _conv("resnet50.1x1expand", _R50, "layer1 conv3", 8, 64, 256, (56, 56), 1, float64=True),
    _conv("resnet50.1x1s2down", _R50, "layer2.0 downsample", 8, 256, 512, (56, 56), 1, stride=2, float64=True),
    _conv("mobilenetv2.dw3x3", _MB2, "block 2 depthwise", 16, 144, 144, (56, 56), 3, padding=1, groups=144,
          float64=True),
    _conv("mobilenetv2.dw3x3s2", _MB2, "block 3 depthwise", 16, 144, 144, (56, 56), 3, stride=2, padding=1,
          groups=144),
    _conv("mobilenetv2.pointwise", _MB2, "block 2 project", 16, 144, 24, (56, 56), 1),
    _conv("vgg16.3x3", "VGG-16", "conv2_2", 4, 128, 128, (112, 112), 3, padding=1),
    _conv("deeplabv3.aspp12", "DeepLabv3", "ASPP rate 12 (output stride 16)", 1, 2048, 256, (33, 33), 3,
          padding=12, dilation=12),
    _conv("wav2vec2.k10s5", "wav2vec 2.0", "feature extractor conv0", 4, 1, 512, (16000,), 10, stride=5,
          float64=True),
    _conv("wav2vec2.k3s2", "wav2vec 2.0", "feature extractor conv1", 2, 512, 512, (3199,), 3, stride=2),
    _conv("r3d18.3x3x3", "R3D-18", "layer2 conv", 2, 128, 128, (8, 28, 28), 3, padding=1),
    _conv("resnext50.g32", "ResNeXt-50 32x4d", "layer1 conv2", 8, 128, 128, (56, 56), 3, padding=1, groups=32,
          float64=True),
    _conv("dcgan.convT4x4s2", "DCGAN", "generator 16->32", 64, 128, 64, (16, 16), 4, stride=2, padding=1,
          transposed=True, float64=True),
    _conv("unet.upconv2x2", "U-Net", "up-conv 28->56", 2, 1024, 512, (28, 28), 2, stride=2, transposed=True),
)


_SLOW: tuple[Layer, ...] = (
    _conv("csn.dw3x3x3", "ir-CSN-152", "channel-separated 3x3x3 (depthwise)", 4, 64, 64, (16, 28, 28), 3,
          padding=1, groups=64, float64=True),
    _conv("csn.g8x3x3x3", "CSN-style grouped", "3x3x3 in 8 groups of 8 channels", 4, 64, 64, (16, 28, 28), 3,
          padding=1, groups=8, float64=True),
    _conv("resnext3d.g32", "3D ResNeXt-101 32x4d", "layer2 conv2 (8 channels per group)", 2, 256, 256, (8, 28, 28),
          3, padding=1, groups=32),
    _conv("x3d.dw3x3x3s2", "X3D-M", "res4 block 1 depthwise, stride (1, 2, 2)", 2, 216, 216, (16, 28, 28), 3,
          stride=(1, 2, 2), padding=1, groups=216),
    _conv("convnext.dw7x7", "ConvNeXt-T", "stage 1 depthwise 7x7", 16, 96, 96, (56, 56), 7, padding=3, groups=96,
          float64=True),
    _conv("efficientnet.dw5x5s2", "EfficientNet-B0", "stage 3 block 1 depthwise 5x5, stride 2", 16, 144, 144,
          (56, 56), 5, stride=2, padding=2, groups=144),
    _conv("conformer.dw31", "Conformer-M", "convolution module depthwise, k 31", 4, 256, 256, (500,), 31,
          padding=15, groups=256, float64=True),
    _conv("convtasnet.dw3d8", "Conv-TasNet", "TCN block depthwise, dilation 8", 2, 512, 512, (3999,), 3,
          padding=8, dilation=8, groups=512),
)


# Large kernels (issue 28): where the convolution theorem pays. Batches so that native's forward takes >= 5 ms on
# 2 threads; ConvNeXt's 7x7 and ResNet's 3x3 are the controls, where auto must not pick fft.
_LARGE: tuple[Layer, ...] = (
    _conv("replknet.dw31", "RepLKNet-31B", "stage 2 depthwise 31x31", 4, 256, 256, (28, 28), 31, padding=15,
          groups=256, float64=True),
    _conv("slak.dw51x5", "SLaK-T", "stage 1 depthwise 51x5 (of the 51x5 + 5x51 pair)", 2, 96, 96, (56, 56), (51, 5),
          padding=(25, 2), groups=96),
    _conv("unireplknet.dw13", "UniRepLKNet-T", "stage 3 depthwise 13x13", 8, 320, 320, (14, 14), 13, padding=6,
          groups=320),
    _conv("wav2vec2.posconv", "wav2vec 2.0", "positional conv, k 128, 16 groups", 2, 768, 768, (500,), 128,
          padding=64, groups=16),
    _conv("hyena.long1d", "Hyena / H3", "causal long conv, depthwise, k = length 1024", 2, 256, 256, (1024,), 1024,
          padding=((1023, 0),), groups=256, float64=True),
    _conv("sincnet.k251", "SincNet", "learnable front end, 80 filters of 251 taps", 8, 1, 80, (16000,), 251),
    _conv("wav2letter.k250s160", "wav2letter", "raw-waveform front end, k 250, stride 160", 16, 1, 250, (16000,),
          250, stride=160),
    _conv("hifigan.up16s8", "HiFi-GAN V1", "generator upsampling 1, transposed k 16, stride 8", 4, 512, 256, (200,),
          16, stride=8, padding=4, transposed=True),
    _conv("3duxnet.dw7x7x7", "3D UX-Net", "stage 1 depthwise 7x7x7", 1, 48, 48, (48, 48, 48), 7, padding=3,
          groups=48),
    _conv("convnext.dw7x7", "ConvNeXt-T", "stage 1 depthwise 7x7 (control)", 16, 96, 96, (56, 56), 7, padding=3,
          groups=96),
    _conv("resnet50.3x3@28", _R50, "layer2 conv2 (control)", 8, 128, 128, (28, 28), 3, padding=1),
)


def _shrink(layer: Layer) -> Layer:
    """A tiny version with the same geometry: batch 1, at most 4 groups of at most 8 channels, at most 40 wide
    (10 in 3d)."""
    g = min(layer.groups, 4)
    spec = layer.spec()
    xg, yg = min(spec.x_group_channels, 8), min(spec.y_group_channels, 8)
    in_g, out_g = (yg, xg) if layer.transposed else (xg, yg)
    k = layer.weight_shape[2:]
    weight = (g * in_g, out_g, *k) if layer.transposed else (g * out_g, in_g, *k)
    wide = 40 if len(k) < 3 else 10
    size = tuple(min(s, wide) for s in layer.input_shape[2:])
    return replace(layer, input_shape=(1, g * in_g, *size), weight_shape=weight, groups=g)


SUITES: dict[str, tuple[Layer, ...]] = {
    "default": DEFAULT,
    "slow": _SLOW,
    "all": DEFAULT + _SLOW,
    "large": _LARGE,
    "smoke": tuple(_shrink(layer) for layer in DEFAULT if layer.name in {
        "resnet50.3x3s2", "resnet50.1x1s2down", "mobilenetv2.dw3x3", "wav2vec2.k10s5", "dcgan.convT4x4s2"})
    + tuple(_shrink(layer) for layer in _SLOW if layer.name in {"csn.g8x3x3x3", "efficientnet.dw5x5s2"}),
}


# The backends a suite times when --backends is not given, where not the registry's bench_by_default ones. On large
# kernels auto chooses fft, fwdconv or native (benchmarks/results/large_kernels.md, made by
# benchmarks/large_kernels.py); the registry's others rearrange native's direct kernels (channels_last, regroup,
# chunked) or unfold 961 taps per pixel (gemm), so they lose there and would multiply the run's time
SUITE_BACKENDS: dict[str, tuple[str, ...]] = {"large": ("fwdconv", "fft", "auto")}


def select(suite: str, patterns: list[str] | None = None, dtype: str = "float32") -> tuple[Layer, ...]:
    """The layers of a suite matching any of the glob patterns (all when None); float64: its subset.

    Raises:
        ValueError: an unknown suite, or patterns that match no layer.
    """
    if suite not in SUITES:
        raise ConvgradValueError(f"convgrad bench: --suite={suite!r} must be one of {sorted(SUITES)}")
    layers = SUITES[suite]
    if patterns:
        picked = tuple(layer for layer in layers if any(fnmatch(layer.name, p) for p in patterns))
        if not picked:
            raise ConvgradValueError(
                f"convgrad bench: --layers {' '.join(patterns)} match no layer of suite {suite!r}; "
                f"its layers are {[layer.name for layer in layers]}")
        return picked
    if dtype == "float64":
        return tuple(layer for layer in layers if layer.float64)
    return layers
