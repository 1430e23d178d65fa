"""The grad_weight plans of the fwdconv backend and the rules that choose among them.

Contractions, per group (x: big side, y: small side, T taps, P positions of y; docs/derivation.md):
    kernel      [C_x/g, N, x] * y^T [C_y/g, N, o] -> [C_x/g, C_y/g, T]   (stride d, dilation s; y as the kernel)
    per_sample  [C_x/g, N*g, x] * [N*C_y, 1, o], groups N*g -> per-sample gradients, summed over N
    taps        the windows of the T taps folded into the batch: [C_x/g*T, N*P] x [N*P, C_y/g] (a matmul)
    blocks      stride 1, dilation d: blocks of d rows folded into channels, a stride-1 conv (space to depth)
    phases      stride s, dilation 1: x's phases rho::s folded into channels, per-sample stride-1 convs

Each builder returns (data steps, kernel steps, contraction, post steps) for ``plan_weight_grad``; the rules
(``weight_method``, ``im2col_weight_method``) choose among them by the measured constants here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.contractions import Conv, MatMul
from convgrad.backends.fwdconv.plan import Chain, Contraction, Plan, Step, TensorOp, commas, index_text
from convgrad.backends.fwdconv.steps import (
    BatchFold,
    FoldTaps,
    Pad,
    SamplesIntoChannels,
    SpaceToDepth,
    SumSamples,
    SwapBatchChannels,
    TapsToKernel,
    pad_or_fold,
)
from convgrad.errors import ConvgradValueError, MethodRefused
from convgrad.spec import (
    ConvSpec,
    Pair,
    Shape,
    output_rows,
    pad_split,
    pad_to_rows,
    padded_sizes,
    phase_data_rows,
    strided_crop,
)
from convgrad.tensor_ops import ONEDNN_DTYPES, batched_like, channels_innermost

__all__ = ["BUILDERS", "ONEDNN_DTYPES", "PER_SAMPLE_MAX_BATCH", "PER_SAMPLE_MAX_CHANNELS", "TAPS_MAX_ELEMENTS",
           "WEIGHT_METHODS", "PhasesToKernel", "StrideToDepth", "im2col_weight_method", "plan_per_sample_weight_grad",
           "plan_weight_grad", "refusal", "weight_method"]

WEIGHT_METHODS = ("kernel", "per_sample", "taps", "blocks", "phases")


@lru_cache(maxsize=1024)
def plan_weight_grad(spec: ConvSpec, method: str | None = None) -> Plan:
    """The plan for grad_weight: x convolved with y as the kernel, batch, taps or blocks folded as chosen.

    ``method`` forces a formulation (one of WEIGHT_METHODS); None lets the rules choose.
    """
    x_name, y_name = ("grad_output", "input") if spec.transposed else ("input", "grad_output")
    chosen, reason = weight_method(spec) if method is None else (method, "forced")
    if chosen not in BUILDERS:
        raise ConvgradValueError(f"plan_weight_grad: method={method!r} must be None or one of {WEIGHT_METHODS}")
    why = refusal(chosen, spec)
    if why:  # even for a batch of 0, whose sum is empty: the method is wrong for the layer
        raise MethodRefused("plan_weight_grad", chosen, why, spec.describe())
    if spec.batch == 0:
        return Plan("grad_weight", spec, x_name, y_name, (), (), None, (), spec.weight_shape, "empty", "batch 0")
    data_steps, kernel_steps, conv, post = BUILDERS[chosen](spec)
    return Plan("grad_weight", spec, x_name, y_name, data_steps, kernel_steps, conv, post, spec.weight_shape,
                chosen, reason)


def weight_method(spec: ConvSpec) -> tuple[str, str]:
    """The grad_weight formulation for this spec and why.

    Rules from ``benchmarks/fwdconv_methods.py`` (oneDNN, float32, 2 threads; the figures are in
    benchmarks/results/fwdconv_rules.md): taps for 1x1 convs and up-convs whose windows do not overlap; phases for
    strided 3d depthwise convs, where oneDNN runs the dilated per-sample kernel slowly (in 2d and for the 3-channel 3d
    stem it loses); per_sample for at most ``PER_SAMPLE_MAX_CHANNELS`` input channels per group and for batches of
    at most ``PER_SAMPLE_MAX_BATCH``; blocks for dilated stride-1 convs (DeepLab's ASPP); kernel elsewhere.
    """
    if spec.taps <= math.prod(spec.stride):
        return "taps", "tap windows do not overlap (e.g. 1x1, or k <= s): im2col by taps copies at most x; a matmul"
    if spec.n == 3 and spec.x_channels == spec.groups and max(spec.stride) > 1 and max(spec.dilation) == 1:
        return "phases", "strided 3d depthwise: the phases of x make per-sample stride-1 convs, not dilated ones"
    if spec.x_group_channels <= PER_SAMPLE_MAX_CHANNELS:
        return "per_sample", (f"at most {PER_SAMPLE_MAX_CHANNELS} input channels per group (depthwise, RGB, audio): "
                              f"per-sample convs, summed")
    if all(s == 1 for s in spec.stride) and any(d > 1 for d in spec.dilation):
        return "blocks", "dilated, stride 1: space-to-depth by d turns a huge strided conv into a small stride-1 one"
    if spec.batch <= PER_SAMPLE_MAX_BATCH:
        return "per_sample", f"batch of at most {PER_SAMPLE_MAX_BATCH}: per-sample convs, summed"
    return "kernel", "grad_output as the kernel, batch folded into channels"


# per_sample's convs per sample beat one conv with grad_output as the kernel for few input channels per group (RGB:
# 3; ResNeXt's 4 per group run faster as "kernel") and for tiny batches (fwdconv_rules.md)
PER_SAMPLE_MAX_CHANNELS = 3
PER_SAMPLE_MAX_BATCH = 2


# Off oneDNN (float64, float16, complex on the CPU) torch's forward conv is im2col + GEMM, for which grad_output as a
# huge kernel is slower than folding the taps into the batch ourselves (fwdconv_rules.md); up to this many folded
# elements (N*C_x*T*P), beyond which the "kernel" plan needs far less memory
TAPS_MAX_ELEMENTS = 2**25


def im2col_weight_method(spec: ConvSpec, like: torch.Tensor) -> str | None:
    """"taps" where the forward conv would be im2col + GEMM anyway (CPU, not oneDNN) and it fits."""
    if like.device.type != "cpu" or like.dtype in ONEDNN_DTYPES or spec.x_channels == 1:
        return None
    size = spec.batch * spec.x_channels * spec.taps * spec.positions
    return "taps" if size <= TAPS_MAX_ELEMENTS else None


# ---- the steps of the phases plan: a strided conv's x split into phases, each a stride-1 conv ---------------------
@dataclass(frozen=True)
class StrideToDepth:
    """(N, C_x, *i) -> (C_x/g*S, N*g, *U): x padded by ``pads``, then its phase rho (the rows rho::s) of every dim
    becomes a channel of its own.

    Tap t = s*q + rho of a stride-s window meets row s*o + t = s*(o + q) + rho, i.e. row o + q of phase rho: a
    stride-1 conv of each phase with the taps rho::s. The S = prod(s) phases sit beside the C_x/g channels of
    each group, and the batch is folded into the groups (sample-major), as the per-sample plan does. The pad
    and the split are one copy: each phase's rows are copied from x straight to where they go.
    """

    stride: Shape
    groups: int
    pads: tuple[Pair, ...]
    shape: Shape

    def _copies(self, size: Shape) -> list[tuple[Shape, tuple[slice, ...], tuple[slice, ...]]]:
        """Per phase rho that holds rows of x: (rho, where its rows go (rows m of the phase), which rows of x they
        are (h = s*m + rho - lo)); the rows of the pads stay zero. What the call copies and the code writes."""
        out = []
        for rho in itertools.product(*(range(s) for s in self.stride)):
            dst, src = [], []
            for r, s, (lo, _), u, i in zip(rho, self.stride, self.pads, self.shape[2:], size):
                m0, count, h0 = phase_data_rows(i, u, s, r, lo)
                dst.append(slice(m0, m0 + count))
                src.append(slice(h0, h0 + s * (count - 1) + 1 if count else h0, s))
            if all(d.stop > d.start for d in dst):
                out.append((rho, tuple(dst), tuple(src)))
        return out

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n, c, *size = t.shape
        g, u, nd = self.groups, self.shape[2:], len(size)
        if channels_innermost(t):  # the result channels last too: (C_x/g, *s, *U, N, g) in memory
            out = t.new_zeros((c // g, *self.stride, *u, n, g)).movedim((-2, -1), (1 + nd, 2 + nd))
        else:
            out = t.new_zeros((c // g, *self.stride, n, g, *u))
        out = batched_like(out, t)  # (C_x/g, *s, N, g, *U)
        x = t.reshape(n, g, c // g, *size).movedim(2, 0)  # (C_x/g, N, g, *i)
        for rho, dst, src in self._copies(tuple(size)):
            out[(slice(None), *rho, ..., *dst)] = x[(..., *src)]
        return out.reshape(self.shape)  # (C_x/g*S, N*g, *U)

    def describe(self) -> str:
        return (f"pad (lo, hi) = {self.pads} per spatial dim and split into the phases rho::{self.stride} "
                f"(sample-major: every phase a channel, the batch in the groups)")

    def label(self) -> str:
        return f"pad (lo, hi) = {self.pads} and split into the phases rho::{self.stride}"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase rho < s of the padded rows: rho, rho + s, ...; each gets its own results (taps)."""
        s, (lo, hi) = self.stride[dim], self.pads[dim]
        rows = geo.pad_axis(geo.plain(axis, self), lo, hi)
        return geo.Family(tuple(geo.select(rows, range(rho, len(rows.cells), s)) for rho in range(s)), False)

    def code(self, v: str, shape: Shape) -> list[str]:
        n, c, *size = shape
        g = self.groups
        lines = [f"{v}_x = {v}.reshape({commas((n, g, c // g, *size))}).movedim(2, 0)  # (C_x/g, N, g, *i)",
                 f"{v} = {v}.new_zeros(({commas((c // g, *self.stride, n, g, *self.shape[2:]))}))"
                 "  # (C_x/g, *s, N, g, *U): the pads' rows stay zero"]
        lines += [f"{v}[:, {commas(rho)}, ..., {index_text(dst)}] = {v}_x[..., {index_text(src)}]  # phase {rho}"
                  for rho, dst, src in self._copies(tuple(size))]
        return [*lines, f"{v} = {v}.reshape({commas(self.shape)})  # phases into channels: {self.shape}"]


@dataclass(frozen=True)
class PhasesToKernel(Chain):
    """(C_x/g*S, C_y, *q) -> (C_y, C_x/g, *k): result q of phase rho is tap s*q + rho; taps past k are dropped."""

    stride: Shape
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        c_y, cxg, *_ = self.shape
        q = shape[2:]
        nd = len(q)
        perm = (1 + nd, 0, *(v for j in range(nd) for v in (2 + nd + j, 1 + j)))
        return (TensorOp("reshape", ((cxg, *self.stride, c_y, *q),), "(C_x/g, *s, C_y, *q)"),
                TensorOp("permute", (perm,), "(C_y, C_x/g, q1, s1, ...)"),
                TensorOp("reshape", ((c_y, cxg, *(m * s for m, s in zip(q, self.stride))),),
                         "(C_y, C_x/g, *(q*s)): tap s*q + rho in order"),
                TensorOp("index", (tuple(slice(0, k) for k in self.shape[2:]),),
                         f"phases back into taps: {self.shape}"))

    def describe(self) -> str:
        return f"interleave the phases' results: result q of phase rho is tap {self.stride}*q + rho"

    def label(self) -> str:
        return "the phases' results interleaved into taps"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Tap t is row t // s of phase t % s's results."""
        if not isinstance(axis, geo.Family):
            raise TypeError(f"PhasesToKernel.rows: expects the results of its phases, not a {type(axis).__name__}")
        s = self.stride[dim]
        cells = [axis.members[t % s].cells[t // s] for t in range(self.shape[2 + dim])]  # type: ignore[union-attr]
        return geo.renumber(geo.Axis(()), cells)



_Parts = tuple[tuple[Step, ...], tuple[Step, ...], Contraction, tuple[Step, ...]]


def _x_pads(spec: ConvSpec) -> tuple[tuple[Step, ...], Shape, Shape, tuple[Pair, ...], Shape]:
    """How the grad-of-w conv reads x: crops as a view, padding by the conv itself, surplus outputs dropped.

    An asymmetric pad of x would be a copy of x; instead the conv pads max(lo, hi) on both sides and
    the few extra outputs (the taps "before" tap 0 and past tap k-1) are cropped from its small
    result. The conv's stride is d, so this needs the extra leading padding to be a multiple of d;
    otherwise x is padded explicitly. Returns (steps on x, x's shape after them, conv padding,
    crop of the conv's output per dim, the conv's output taps before that crop).
    """
    shape = (spec.batch, spec.x_channels)
    pads = spec.x_read_pads
    grow, extra, crops, _ = pad_split(pads)
    size = padded_sizes(spec.x_size, crops)
    if any(e % d for e, d in zip(extra, spec.dilation)) or any(n < 1 for n in size):  # or the crop empties x
        steps, conv_pad, padded = pad_or_fold(pads, (*shape, *spec.x_size), (*shape, *spec.x_read_size))
        return tuple(steps), padded, conv_pad, ((0, 0),) * spec.n, spec.kernel_size
    out = tuple(output_rows(n, o, d, s, (g, g))  # a conv of stride d, dilation s and o taps
                for n, g, s, o, d in zip(size, grow, spec.stride, spec.y_size, spec.dilation))
    crop_out = tuple(strided_crop(e, d, m, k) for e, d, m, k in zip(extra, spec.dilation, out, spec.kernel_size))
    steps = (Pad(crops, (*shape, *size)),) if any(lo or hi for lo, hi in crops) else ()
    return steps, (*shape, *size), grow, crop_out, out


def _crop_taps(spec: ConvSpec, crop: tuple[Pair, ...], lead: Shape) -> tuple[Step, ...]:
    return (Pad(crop, (*lead, *spec.kernel_size)),) if any(lo or hi for lo, hi in crop) else ()


def _kernel_plan(spec: ConvSpec) -> _Parts:
    """x (batch folded into channels) convolved with y as the kernel: stride d, dilation s."""
    g, cxg, cy, n_ = spec.groups, spec.x_group_channels, spec.y_channels, spec.batch
    pad_steps, padded, conv_pad, crop, taps = _x_pads(spec)
    data_steps = (*pad_steps, BatchFold(g, "group_major", (cxg, g * n_, *padded[2:])))
    conv = Conv(spec.dilation, conv_pad, spec.stride, g, (cxg, cy, *taps))
    post = (*_crop_taps(spec, crop, (cxg, cy)), SwapBatchChannels(spec.weight_shape))
    return data_steps, (SwapBatchChannels((cy, n_, *spec.y_size)),), conv, post


def _samples_as_groups(spec: ConvSpec, pad_steps: tuple[Step, ...], padded: Shape, conv_pad: Shape,
                       crop: tuple[Pair, ...], taps: Shape) -> _Parts:
    """The conv of every sample on its own, the batch folded into the groups: its result (C_x/g, N*C_y, *k) holds
    sample n's gradient in columns n*C_y to (n+1)*C_y. ``pad_steps`` .. ``taps``: how it reads x (``_x_pads``)."""
    g, cxg, cy, n_ = spec.groups, spec.x_group_channels, spec.y_channels, spec.batch
    data_steps = (*pad_steps, BatchFold(g, "sample_major", (cxg, n_ * g, *padded[2:])))
    conv = Conv(spec.dilation, conv_pad, spec.stride, n_ * g, (cxg, n_ * cy, *taps))
    kernel_steps = (SamplesIntoChannels((n_ * cy, 1, *spec.y_size)),)
    return data_steps, kernel_steps, conv, _crop_taps(spec, crop, (cxg, n_ * cy))


def _per_sample_plan(spec: ConvSpec) -> _Parts:
    """The same conv per sample, the batch folded into the groups, then the samples summed."""
    cx, cy = spec.x_group_channels, spec.y_channels
    data_steps, kernel_steps, conv, crop = _samples_as_groups(spec, *_x_pads(spec))
    post = (*crop, SumSamples(spec.batch, (cx, cy, *spec.kernel_size)), SwapBatchChannels(spec.weight_shape))
    return data_steps, kernel_steps, conv, post


@lru_cache(maxsize=1024)
def plan_per_sample_weight_grad(spec: ConvSpec) -> Plan:
    """The plan for per-sample weight gradients: the per_sample plan without its sum over the samples.

    Its result, ``(N*C_y, C_x/g, *k)`` (a transposed view), holds sample n's weight gradient in rows n*C_y to
    (n+1)*C_y: ``.view(N, *spec.weight_shape)``. Unlike the summed plans, x is padded by a step (``pad_or_fold``)
    rather than read through a grown conv padding whose surplus results are cropped: here those results are N
    times as many (``convgrad.per_sample``'s "conv" method, which runs this plan, has always padded x).

    Examples:
        >>> import torch
        >>> from convgrad.backends.fwdconv import execute, plan_per_sample_weight_grad
        >>> spec = ConvSpec.from_shapes((3, 4, 9, 8), (6, 2, 3, 2), stride=2, padding=1, groups=2)
        >>> x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)
        >>> gw = execute(plan_per_sample_weight_grad(spec), x, y).view(3, *spec.weight_shape)  # (N, C_y, C_x/g, *k)
        >>> torch.allclose(gw.sum(0), torch.nn.grad.conv2d_weight(x, spec.weight_shape, y, 2, 1, groups=2), atol=1e-5)
        True
    """
    x_name, y_name = ("grad_output", "input") if spec.transposed else ("input", "grad_output")
    shape = (spec.batch * spec.y_channels, spec.x_group_channels, *spec.kernel_size)
    if spec.batch == 0:
        return Plan("grad_weight", spec, x_name, y_name, (), (), None, (), shape, "empty", "batch 0")
    lead = (spec.batch, spec.x_channels)
    pad_steps, conv_pad, padded = pad_or_fold(spec.x_read_pads, (*lead, *spec.x_size), (*lead, *spec.x_read_size))
    data_steps, kernel_steps, conv, _ = _samples_as_groups(spec, tuple(pad_steps), padded, conv_pad,
                                                           ((0, 0),) * spec.n, spec.kernel_size)
    return Plan("grad_weight", spec, x_name, y_name, data_steps, kernel_steps, conv, (SwapBatchChannels(shape),),
                shape, "per_sample", "per-sample gradients: per-sample convs, not summed")


def _taps_plan(spec: ConvSpec) -> _Parts:
    """The window of every tap folded into the batch (im2col by taps): a conv whose kernel y covers it, a matmul."""
    g, cx, cy, n_, t = spec.groups, spec.x_channels, spec.y_channels, spec.batch, spec.taps
    cxg = spec.x_group_channels
    pads = (Pad(spec.x_read_pads, (n_, cx, *spec.x_read_size)),) if any(any(p) for p in spec.x_read_pads) else ()
    data_steps = (*pads, FoldTaps(g, spec.kernel_size, spec.stride, spec.dilation, (cxg * t, g * n_, *spec.y_size)))
    conv = MatMul(g, False, (cxg * t, cy, *(1,) * spec.n))
    return data_steps, (SwapBatchChannels((cy, n_, *spec.y_size)),), conv, (TapsToKernel(spec.weight_shape),)


def _blocks_plan(spec: ConvSpec) -> _Parts:
    """Stride 1, dilation d: blocks of d rows folded into channels (space to depth) make it a stride-1 conv."""
    g, cx, cy, n_, d = spec.groups, spec.x_channels, spec.y_channels, spec.batch, spec.dilation
    cxg = spec.x_group_channels
    blocks, dd = spec.dilation_blocks, math.prod(d)
    x_pads = tuple(pad_to_rows(p, size, u * di) for p, (u, _), di, size in
                   zip(spec.x_read_pads, blocks, d, spec.x_read_size))
    y_pads = tuple(pad_to_rows((0, 0), o, m * di) for (_, m), di, o in zip(blocks, d, spec.y_size))
    data_steps = (Pad(x_pads, (n_, cx, *(u * di for (u, _), di in zip(blocks, d)))),
                  SpaceToDepth(d, g, (cxg, g * n_ * dd, *(u for u, _ in blocks))))
    y_pad = (Pad(y_pads, (n_, cy, *(m * di for (_, m), di in zip(blocks, d)))),) if any(hi for _, hi in y_pads) else ()
    kernel_steps = (*y_pad, SpaceToDepth(d, 1, (cy, n_ * dd, *(m for _, m in blocks))))
    conv = Conv((1,) * spec.n, (0,) * spec.n, (1,) * spec.n, g, (cxg, cy, *spec.kernel_size))
    return data_steps, kernel_steps, conv, (SwapBatchChannels(spec.weight_shape),)


def _phases_plan(spec: ConvSpec) -> _Parts:
    """Stride s, dilation 1: x's phases rho::s become channels, so each sample's conv is a stride-1 one.

    Each phase gets Q = ceil(k/s) taps per dim (``ConvSpec.stride_phases``); a phase with fewer real taps computes
    a few surplus results, which PhasesToKernel drops.
    """
    g, cy, n_, s = spec.groups, spec.y_channels, spec.batch, spec.stride
    q, u, pads = zip(*spec.stride_phases)
    phases = spec.x_group_channels * math.prod(s)
    data_steps = (StrideToDepth(s, g, pads, (phases, n_ * g, *u)),)
    conv = Conv((1,) * spec.n, (0,) * spec.n, (1,) * spec.n, n_ * g, (phases, n_ * cy, *q))
    post = (SumSamples(n_, (phases, cy, *q)), PhasesToKernel(s, spec.weight_shape))
    return data_steps, (SamplesIntoChannels((n_ * cy, 1, *spec.y_size)),), conv, post


def refusal(method: str, spec: ConvSpec) -> str | None:
    """Why a formulation cannot serve this spec (None if it can): blocks folds the dilation and phases the stride,
    so each needs the other to be 1."""
    if method == "blocks" and any(s > 1 for s in spec.stride):
        return "needs stride 1 in every dim"
    if method == "phases" and any(d > 1 for d in spec.dilation):
        return "needs dilation 1 in every dim"
    return None


BUILDERS = {"kernel": _kernel_plan, "per_sample": _per_sample_plan, "taps": _taps_plan, "blocks": _blocks_plan,
            "phases": _phases_plan}
