"""The fwdconv backend: every gradient written with forward convolutions only (the seeds' method).

Contractions, per group (x: big side, y: small side, T: kernel taps; DESIGN.md):
    grad of x   [N, C_y/g, zero-inserted y] * flip(w)^T [C_x/g, C_y/g, T]  -> [N, C_x/g, i]
                 (stride 1, dilation d; y zero-inserted by s and padded by transpose_pads)
    grad of y   [N, C_x/g, x] * w [C_y/g, C_x/g, T]                        -> [N, C_y/g, o]
                 (stride s, dilation d: the forward conv; used by transposed convs)
    grad of w   [C_x/g, N, x] * y^T [C_y/g, N, o]                          -> [C_x/g, C_y/g, T]
                 (batch and channels swapped, stride d, dilation s; groups folded into channels)
Faster forms of the same sums, chosen per layer and per gradient by rules from measurements
(``_input_method`` here, ``fwdconv_weight.weight_method``): polyphase and sub-pixel grad of x, with
no products with inserted zeros (fwdconv_phases.py); 1x1 convs as matmuls (fwdconv_steps.py); grad
of w with the batch folded into the groups, the taps folded into the batch, or the dilation blocks
folded into channels (fwdconv_weight.py).

Work happens in two steps. ``plan_input_grad(spec)`` / ``plan_weight_grad(spec)``
turn a ConvSpec into a ``Plan``: a short list of plain steps that depends on
shapes only. ``execute(plan, data, kernel)`` runs it on tensors. ``convgrad.explain``
renders the very same Plan objects, so what is explained is what runs. Every step
is a differentiable torch op, so gradients of any order come from autograd.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from functools import lru_cache
from typing import Any

import torch

from convgrad.backends import Backend, register
from convgrad.backends.fwdconv import grad_weight as fwdconv_weight
from convgrad.backends.fwdconv.contractions import DepthToSpace, Phase, PhaseConvs, SubpixelKernel, TakeTaps
from convgrad.backends.fwdconv.plan import (
    Conv,
    Flip,
    Pad,
    Plan,
    Step,
    SwapGroupChannels,
    ZeroInsert,
    execute,
    pad_or_fold,
)
from convgrad.backends.fwdconv.steps import Contraction, DepthwiseTaps, MatMul, Subsample
from convgrad.spec import ConvSpec, Pair, PhaseTaps, tap_rows

Shape = tuple[int, ...]


def _grad_x_plan(spec: ConvSpec, gradient: str, data: str, pointwise: bool = False, reason: str = "") -> Plan:
    """x from y: zero-insert, pad, and a stride-1 conv with the flipped, channel-swapped kernel."""
    n_, cy, g = spec.batch, spec.y_channels, spec.groups
    steps: list[Step] = []
    if any(s > 1 for s in spec.stride):
        steps.append(ZeroInsert(spec.stride, (n_, cy, *spec.zero_inserted_size)))
    before = (n_, cy, *(spec.zero_inserted_size))
    pad_steps, conv_pad, _ = pad_or_fold(spec.transpose_pads, before, (n_, cy, *spec.transpose_padded_size))
    kernel_steps = (Flip(spec.weight_shape), SwapGroupChannels(g, (spec.x_channels, cy // g, *spec.kernel_size)))
    conv: Contraction = Conv((1,) * spec.n, conv_pad, spec.dilation, g, spec.x_shape)
    method = "zero_insert" if steps else "direct"
    if pointwise:  # stride 1 and a 1x1 kernel: the pads only crop, and the conv is a matmul
        conv, method = MatMul(g, True, spec.x_shape), "matmul"
    return Plan(gradient, spec, data, "weight", (*steps, *pad_steps), kernel_steps, conv, (), spec.x_shape, method,
                reason)


def _grad_y_plan(spec: ConvSpec, gradient: str, data: str) -> Plan:
    """y from x: the forward conv itself, reading x exactly (crop the leftover r); 1x1 kernels as a matmul."""
    x_shape = (spec.batch, spec.x_channels)
    if all(k == 1 for k in spec.kernel_size) and spec.groups == 1:
        steps: list[Step] = [Pad(spec.x_read_pads, (*x_shape, *spec.x_read_size))]
        if any(s > 1 for s in spec.stride):
            steps.append(Subsample(spec.stride, (*x_shape, *spec.y_size)))
        conv = MatMul(1, True, spec.y_shape)
        return Plan(gradient, spec, data, "weight", tuple(steps), (), conv, (), spec.y_shape, "matmul", "1x1 kernel")
    pad_steps, conv_pad, _ = pad_or_fold(spec.x_read_pads, (*x_shape, *spec.x_size), (*x_shape, *spec.x_read_size))
    conv = Conv(spec.stride, conv_pad, spec.dilation, spec.groups, spec.y_shape)
    return Plan(gradient, spec, data, "weight", tuple(pad_steps), (), conv, (), spec.y_shape)


def _grad_x_kernel_steps(spec: ConvSpec) -> tuple[Step, ...]:
    cy, g = spec.y_channels, spec.groups
    return Flip(spec.weight_shape), SwapGroupChannels(g, (spec.x_channels, cy // g, *spec.kernel_size))


def _phase_conv(taps: list[PhaseTaps], groups: int, rows: Shape, y_size: Shape,
                depthwise: bool) -> tuple[Contraction, tuple[Pair, ...], Shape]:
    """The contraction of one phase, the pads it leaves to a Pad (crops only, for a conv), and its output offset."""
    pads = tuple(t.pads for t in taps)
    nd = len(taps)
    if all(t.count == 1 for t in taps):  # one tap: a (grouped) matmul after shifting y
        return MatMul(groups, True, rows), pads, (0,) * nd
    grow = tuple(max(lo, hi, 0) for lo, hi in pads)  # the conv pads symmetrically; its surplus rows are skipped
    start = tuple(p - max(lo, 0) for p, (lo, _) in zip(grow, pads))
    crops = tuple((min(lo, 0), min(hi, 0)) for lo, hi in pads)
    if depthwise and math.prod(t.count for t in taps) <= TAPS_MAX_PHASE_TAPS:
        return _depthwise_taps(taps, rows, y_size, crops, tuple(b - q for b, q in zip(start, grow))), crops, (0,) * nd
    conv_rows = tuple(r + b + p - max(hi, 0) for r, b, p, (_, hi) in zip(rows[2:], start, grow, pads))
    conv = Conv((1,) * nd, grow, tuple(t.dilation for t in taps), groups, (*rows[:2], *conv_rows))
    return conv, crops, start


def _depthwise_taps(taps: list[PhaseTaps], rows: Shape, y_size: Shape, crops: tuple[Pair, ...],
                    offsets: Shape) -> DepthwiseTaps:
    """A depthwise phase tap by tap: row r of the phase reads row r + offset + tap * dilation of the cropped y."""
    size = tuple(o + lo + hi for o, (lo, hi) in zip(y_size, crops))
    reach: list[tuple[int, tuple[tuple[int, int, int], ...]]] = []
    for index, tap in enumerate(itertools.product(*(range(t.count) for t in taps))):
        dims = tuple(tap_rows(n, r, off, q * t.dilation) for n, r, off, q, t in zip(size, rows[2:], offsets, tap, taps))
        if all(first < stop for first, stop, _ in dims):
            reach.append((index, dims))
    return DepthwiseTaps(tuple(t.count for t in taps), tuple(reach), size, rows)


def _polyphase_plan(spec: ConvSpec, gradient: str, data: str, reason: str = "") -> Plan:
    """x from y phase by phase: each phase of the big side is a small conv with only the taps that reach it."""
    cx, cy, g = spec.x_channels, spec.y_channels, spec.groups
    rows = (spec.batch, cx, *spec.phase_rows)
    depthwise = cx == g and cy == g
    phases: list[Phase | None] = []
    for combo in itertools.product(*(enumerate(dim) for dim in spec.phases)):
        rho, taps = tuple(r for r, _ in combo), [t for _, t in combo]
        if any(t is None for t in taps):
            phases.append(None)
            continue
        live = [t for t in taps if t is not None]
        take = TakeTaps(tuple(t.first for t in live), tuple(t.step for t in live),
                        (cx, cy // g, *(t.count for t in live)))
        conv, pads, start = _phase_conv(live, g, rows, spec.y_size, depthwise)
        phases.append(Phase(rho, pads if any(lo or hi for lo, hi in pads) else (), take, conv, rows, start))
    conv_all = PhaseConvs(spec.stride, tuple(phases), spec.x_shape, cy // g <= CHUNK_MAX_CHANNELS)
    return Plan(gradient, spec, data, "weight", (), _grad_x_kernel_steps(spec), conv_all, (), spec.x_shape,
                "polyphase", reason)


def _subpixel_plan(spec: ConvSpec, gradient: str, data: str, reason: str = "") -> Plan:
    """x from y in one conv: every phase's taps side by side as output channels, then depth to space."""
    geometry = spec.subpixel_taps
    if geometry is None:
        raise ValueError(f"plan_input_grad: method='subpixel' needs dilation dividing stride and a phase with taps "
                         f"in every dim; {spec.describe()} has none")
    n_, cx, cy, g, nd = spec.batch, spec.x_channels, spec.y_channels, spec.groups, spec.n
    fused, pads, offsets = zip(*geometry)
    p = math.prod(spec.stride)
    kernel_steps = (*_grad_x_kernel_steps(spec), SubpixelKernel(g, spec.phases, offsets, (p * cx, cy // g, *fused)))
    grow = tuple(max(lo, hi, 0) for lo, hi in pads)  # symmetric conv padding; the surplus rows are skipped
    start = tuple(q - max(lo, 0) for q, (lo, _) in zip(grow, pads))
    crops = tuple((min(lo, 0), min(hi, 0)) for lo, hi in pads)
    cropped = (n_, cy, *(o + lo + hi for o, (lo, hi) in zip(spec.y_size, crops)))
    if any(c < 1 for c in cropped[2:]):  # the crop alone would empty y: pad it explicitly instead
        grow, start, crops = (0,) * nd, (0,) * nd, tuple(pads)
        cropped = (n_, cy, *(o + lo + hi for o, (lo, hi) in zip(spec.y_size, crops)))
    pad_steps = (Pad(crops, cropped),) if any(lo or hi for lo, hi in crops) else ()
    conv_rows = tuple(c + 2 * q - f + 1 for c, q, f in zip(cropped[2:], grow, fused))
    conv = Conv((1,) * nd, grow, (1,) * nd, g, (n_, p * cx, *conv_rows))
    post = (DepthToSpace(g, spec.stride, spec.x_shape, start),)
    return Plan(gradient, spec, data, "weight", tuple(pad_steps), kernel_steps, conv, post, spec.x_shape,
                "subpixel", reason)


# Measured with benchmarks/fwdconv_methods.py (2-core AVX-512 CPU, oneDNN, float32, 1 and 2 threads; ratios to
# native): sub-pixel's single conv wins when the layer has few input channels (ResNet stem: 3, wav2vec2's first
# conv: 1; 0.37-0.63 vs polyphase 1.3-2.0); separate phases win for wide layers (ResNet 3x3/2: 0.45-1.09 vs
# 0.64-1.4; 1x1/2: 0.25-0.58 vs 0.9-1.8), whose fused kernel multiplies many zero taps, and for depthwise ones
# (0.43-1.56 vs 0.61-2.45), whose fused kernel has a channel multiplier that oneDNN runs slowly.
SUBPIXEL_MAX_CHANNELS = 16
# Phases reading at most this many channels of y per group are memory-bound, and are computed a few samples at a
# time on the CPU (fwdconv_phases.CHUNK_BYTES). Measured grad_input, whole batch -> chunks: depthwise 3x3/2 9.5-11.8
# -> 5.7-6.3 ms, depthwise 1d k3/2 26.9 -> 19.0 ms, 8 channels per group 21.5 -> 20.2 ms; but 16 per group
# 10.8 -> 13.0 ms and ResNet-50's 3x3/2 14.8 -> 17.9 ms, where the conv, not the memory, is the cost.
CHUNK_MAX_CHANNELS = 8
# Depthwise phases with at most this many taps are summed tap by tap (fwdconv_steps.DepthwiseTaps), not by a conv call.
# Measured, grad_input of 16 samples, paired rounds, taps / convs: MobileNetV2's depthwise 3x3/2 (phases of 1, 2, 2
# and 4 taps) 4.2 / 5.8 ms (native 3.8 ms); depthwise 1d k3/2 (512 channels, 4000 long) 9.8 / 12.7 ms (native 16.7).
TAPS_MAX_PHASE_TAPS = 4
INPUT_METHODS = ("zero_insert", "polyphase", "subpixel")
WEIGHT_METHODS = ("kernel", "per_sample", "taps", "blocks", "phases")


def _input_method(spec: ConvSpec) -> tuple[str, str]:
    if all(s == 1 for s in spec.stride):
        if all(k == 1 for k in spec.kernel_size) and spec.groups == 1:
            return "matmul", "stride 1 and a 1x1 kernel: a matmul"
        return "direct", "stride 1: no zeros to insert"
    if spec.subpixel_taps is not None and spec.groups == 1 and spec.x_channels < SUBPIXEL_MAX_CHANNELS:
        return "subpixel", f"strided, fewer than {SUBPIXEL_MAX_CHANNELS} input channels: one fused conv"
    return "polyphase", "strided: one conv per phase, no products with inserted zeros"


@lru_cache(maxsize=1024)
def plan_input_grad(spec: ConvSpec, method: str | None = None) -> Plan:
    """The plan for grad_input: the x-gradient of a forward conv, the y-gradient of a transposed one.

    ``method`` forces a formulation of the x-gradient (one of INPUT_METHODS); None lets the rules choose.
    """
    if spec.transposed:
        return _grad_y_plan(spec, "grad_input", "grad_output")
    return _x_plan(spec, "grad_input", "grad_output", method, "plan_input_grad")


def _x_plan(spec: ConvSpec, gradient: str, data: str, method: str | None, fn: str) -> Plan:
    """x from y by the formulation ``method`` (None: the rules choose)."""
    chosen, reason = _input_method(spec) if method is None else (method, "forced")
    if chosen in ("direct", "zero_insert", "matmul"):
        return _grad_x_plan(spec, gradient, data, chosen == "matmul", reason)
    if chosen == "polyphase":
        return _polyphase_plan(spec, gradient, data, reason)
    if chosen == "subpixel":
        return _subpixel_plan(spec, gradient, data, reason)
    raise ValueError(f"{fn}: method={method!r} must be None or one of {INPUT_METHODS}")


@lru_cache(maxsize=256)
def plan_forward(spec: ConvSpec, method: str | None = None) -> Plan:
    """The plan of the convolution itself, for explain's pictures (the forward pass runs torch's own conv).

    A forward conv reads x at stride s (the grad-of-y plan); a transposed conv computes x from y, as a
    forward conv's grad_input does, by the formulation ``method`` (one of INPUT_METHODS; None: the textbook
    zero-insertion, or a direct conv at stride 1).
    """
    if not spec.transposed:
        return _grad_y_plan(spec, "output", "input")
    plan = _x_plan(spec, "output", "input", method or "zero_insert", "plan_forward")
    return plan if method else dataclasses.replace(plan, reason="the textbook form of a transposed conv")


@lru_cache(maxsize=1024)
def plan_weight_grad(spec: ConvSpec, method: str | None = None) -> Plan:
    """The plan for grad_weight: x convolved with y as the kernel, batch, taps or blocks folded as chosen.

    ``method`` forces a formulation (one of WEIGHT_METHODS); None lets the rules choose.
    """
    x_name, y_name = ("grad_output", "input") if spec.transposed else ("input", "grad_output")
    chosen, reason = fwdconv_weight.weight_method(spec) if method is None else (method, "forced")
    if chosen not in fwdconv_weight.BUILDERS:
        raise ValueError(f"plan_weight_grad: method={method!r} must be None or one of {WEIGHT_METHODS}")
    why = fwdconv_weight.refusal(chosen, spec)
    if why:  # even for a batch of 0, whose sum is empty: the method is wrong for the layer
        raise ValueError(f"plan_weight_grad: method={chosen!r} {why}; {spec.describe()}")
    if spec.batch == 0:
        return Plan("grad_weight", spec, x_name, y_name, (), (), None, (), spec.weight_shape, "empty", "batch 0")
    data_steps, kernel_steps, conv, post = fwdconv_weight.BUILDERS[chosen](spec)
    return Plan("grad_weight", spec, x_name, y_name, data_steps, kernel_steps, conv, post, spec.weight_shape,
                chosen, reason)


def _planned(planner: Any, spec: ConvSpec, *method: str | None) -> Plan:
    """``planner(spec, *method)`` through its lru_cache; while torch.compile traces, the uncached function: Dynamo
    traces through the cache anyway, and warns about it ("Silent incorrectness is only a potential risk")."""
    if torch.compiler.is_compiling():
        return planner.__wrapped__(spec, *method)  # type: ignore[no-any-return]
    return planner(spec, *method)  # type: ignore[no-any-return]


@register
class FwdConvBackend(Backend):
    """Forward convolutions, pads, flips and reshapes only; never a convolution_backward."""

    name = "fwdconv"
    supports_complex = True

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        # torch's complex convention: the gradient pairs grad_output with conj(weight) (a no-op for real dtypes)
        return execute(_planned(plan_input_grad, spec), grad_output, weight.conj())

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        input = input.conj()  # torch's complex convention, as in input_grad
        x, y = (grad_output, input) if spec.transposed else (input, grad_output)

        return execute(_planned(plan_weight_grad, spec, fwdconv_weight.im2col_weight_method(spec, grad_output)), x, y)
