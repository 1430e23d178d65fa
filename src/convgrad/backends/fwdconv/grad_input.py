"""The fwdconv plans of x from y: grad_input of a forward conv, and the forward of a transposed one.

Contractions, per group (x: big side, y: small side, T: kernel taps; docs/derivation.md):
    grad of x   [N, C_y/g, zero-inserted y] * flip(w)^T [C_x/g, C_y/g, T]  -> [N, C_x/g, i]
                 (stride 1, dilation d; y zero-inserted by s and padded by transpose_pads)
    polyphase   x rows rho::s  =  y padded * flipped taps first::s/g      (one small conv per phase)
    sub-pixel   [N, C_y/g, y] * [P*C_x/g, C_y/g, fused taps] -> [N, P*C_x/g, ceil(i/s)] -> depth to space
    grad of y   [N, C_x/g, x] * w [C_y/g, C_x/g, T]                        -> [N, C_y/g, o]
                 (stride s, dilation d: the forward conv; used by transposed convs)
Polyphase and sub-pixel make no products with inserted zeros; a stride-1 1x1 conv is a matmul. ``input_method``
chooses among them by the measured constants below; the two steps only sub-pixel uses are at the end.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.contractions import (
    Conv,
    DepthwiseTaps,
    MatMul,
    Phase,
    PhaseConvs,
    TakeTaps,
    phase_rows,
)
from convgrad.backends.fwdconv.plan import Contraction, Plan, Step, commas, index_text, pad_code
from convgrad.backends.fwdconv.steps import Flip, Pad, Subsample, SwapGroupChannels, ZeroInsert, new_like, pad_or_fold
from convgrad.errors import ConvgradValueError, MethodRefused
from convgrad.spec import ConvSpec, Pair, PhaseTaps, Shape, output_rows, pad_split, padded_sizes, tap_rows
from convgrad.tensor_ops import pad, sliced

__all__ = ["CHUNK_MAX_CHANNELS", "INPUT_METHODS", "SUBPIXEL_MAX_CHANNELS", "TAPS_MAX_PHASE_TAPS", "DepthToSpace",
           "SubpixelKernel", "input_method", "plan_forward", "plan_input_grad"]

# The measurements behind these thresholds: benchmarks/results/fwdconv_rules.md
# (`python benchmarks/fwdconv_methods.py`).
# Sub-pixel's single conv wins for few input channels; for wide or depthwise layers its fused kernel multiplies many
# zero taps (or has a channel multiplier oneDNN runs slowly), and separate phases win
SUBPIXEL_MAX_CHANNELS = 16
# Phases reading at most this many channels of y per group are memory-bound, and are computed a few samples at a
# time on the CPU (contractions.CHUNK_BYTES); with more, the conv is the cost and chunks only slow it
CHUNK_MAX_CHANNELS = 8
# Depthwise phases with at most this many taps are summed tap by tap (contractions.DepthwiseTaps): a conv call
# reorders y into oneDNN's blocked layout and back, which costs more than the few taps
TAPS_MAX_PHASE_TAPS = 4
INPUT_METHODS = ("zero_insert", "polyphase", "subpixel")


def input_method(spec: ConvSpec) -> tuple[str, str]:
    """The x-from-y formulation for this spec, and why."""
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
    chosen, reason = input_method(spec) if method is None else (method, "forced")
    if chosen in ("direct", "zero_insert", "matmul"):
        return _grad_x_plan(spec, gradient, data, chosen == "matmul", reason)
    if chosen == "polyphase":
        return _polyphase_plan(spec, gradient, data, reason)
    if chosen == "subpixel":
        return _subpixel_plan(spec, gradient, data, reason)
    raise ConvgradValueError(f"{fn}: method={method!r} must be None or one of {INPUT_METHODS}")


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



# ---- builders ------------------------------------------------------------------------------------------------------

def _grad_x_plan(spec: ConvSpec, gradient: str, data: str, pointwise: bool = False, reason: str = "") -> Plan:
    """x from y: zero-insert, pad, and a stride-1 conv with the flipped, channel-swapped kernel."""
    n_, cy = spec.batch, spec.y_channels
    steps: list[Step] = []
    if any(s > 1 for s in spec.stride):
        steps.append(ZeroInsert(spec.stride, (n_, cy, *spec.zero_inserted_size)))
    before = (n_, cy, *(spec.zero_inserted_size))
    pad_steps, conv_pad, _ = pad_or_fold(spec.transpose_pads, before, (n_, cy, *spec.transpose_padded_size))
    kernel_steps = _grad_x_kernel_steps(spec)
    conv: Contraction = Conv((1,) * spec.n, conv_pad, spec.dilation, spec.groups, spec.x_shape)
    method = "zero_insert" if steps else "direct"
    if pointwise:  # stride 1 and a 1x1 kernel: the pads only crop, and the conv is a matmul
        conv, method = MatMul(spec.groups, True, spec.x_shape), "matmul"
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
    split = pad_split(pads)  # the conv pads symmetrically; its surplus rows are skipped
    if depthwise and math.prod([t.count for t in taps]) <= TAPS_MAX_PHASE_TAPS:
        return _depthwise_taps(taps, rows, y_size, split.crops, split.offset), split.crops, (0,) * nd
    conv = Conv((1,) * nd, split.grow, tuple(t.dilation for t in taps), groups, (*rows[:2], *split.conv_rows(rows[2:])))
    return conv, split.crops, split.start


def _depthwise_taps(taps: list[PhaseTaps], rows: Shape, y_size: Shape, crops: tuple[Pair, ...],
                    offsets: Shape) -> DepthwiseTaps:
    """A depthwise phase tap by tap: row r of the phase reads row r + offset + tap * dilation of the cropped y."""
    size = padded_sizes(y_size, crops)
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
        raise MethodRefused("plan_input_grad", "subpixel", "needs dilation dividing stride and a phase with taps in "
                            "every dim", f"{spec.describe()} has none")
    n_, cx, cy, g, nd = spec.batch, spec.x_channels, spec.y_channels, spec.groups, spec.n
    fused, pads, offsets = zip(*geometry)
    p = math.prod(spec.stride)
    kernel_steps = (*_grad_x_kernel_steps(spec), SubpixelKernel(g, spec.phases, offsets, (p * cx, cy // g, *fused)))
    grow, start, crops, _ = pad_split(pads)  # symmetric conv padding; the surplus rows are skipped
    cropped = (n_, cy, *padded_sizes(spec.y_size, crops))
    if any(c < 1 for c in cropped[2:]):  # the crop alone would empty y: pad it explicitly instead
        grow, start, crops = (0,) * nd, (0,) * nd, tuple(pads)
        cropped = (n_, cy, *padded_sizes(spec.y_size, crops))
    pad_steps = (Pad(crops, cropped),) if any(lo or hi for lo, hi in crops) else ()
    conv_rows = tuple(output_rows(c, f, 1, 1, (q, q)) for c, q, f in zip(cropped[2:], grow, fused))
    conv = Conv((1,) * nd, grow, (1,) * nd, g, (n_, p * cx, *conv_rows))
    post = (DepthToSpace(g, spec.stride, spec.x_shape, start),)
    return Plan(gradient, spec, data, "weight", tuple(pad_steps), kernel_steps, conv, post, spec.x_shape,
                "subpixel", reason)


# ---- sub-pixel grad of x: every phase in one conv -------------------------------------------------------------------

@dataclass(frozen=True)
class SubpixelKernel:
    """(C_x, C_y/g, *k) -> (g*P*C_x/g, C_y/g, *fused): each phase's taps, shifted into one common kernel."""

    groups: int
    phases: tuple[tuple[PhaseTaps | None, ...], ...]  # per dim, per rho
    offsets: tuple[tuple[int, ...], ...]  # per dim, per rho
    shape: Shape

    def _parts(self) -> list[tuple[Shape, tuple[slice, ...], tuple[Pair, ...]] | None]:
        """Per phase combination rho (row-major): (rho, its taps of the kernel, their shifts into the fused kernel),
        or None for a phase no tap reaches (zeros). What the call stacks and the code writes."""
        fused = self.shape[2:]
        out: list[tuple[Shape, tuple[slice, ...], tuple[Pair, ...]] | None] = []
        for combo in itertools.product(*(range(len(dim)) for dim in self.phases)):
            taps = [dim[r] for dim, r in zip(self.phases, combo)]
            if any(t is None for t in taps):
                out.append(None)
                continue
            index = tuple(slice(t.first, t.first + t.step * (t.count - 1) + 1, t.step) for t in taps)
            shifts = tuple((off[r], f - off[r] - t.count) for off, r, f, t in zip(self.offsets, combo, fused, taps))
            out.append((combo, index, shifts))
        return out

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        c_x, cyg, *_ = w.shape
        w = w.reshape(self.groups, c_x // self.groups, cyg, *w.shape[2:])  # (g, C_x/g, C_y/g, *k)
        subs = [w.new_zeros(*w.shape[:3], *self.shape[2:]) if part is None else pad(w[(..., *part[1])], part[2])
                for part in self._parts()]  # each (g, C_x/g, C_y/g, *fused)
        return torch.stack(subs, 1).reshape(self.shape)  # (g*P*C_x/g, C_y/g, *fused)

    def describe(self) -> str:
        return (f"gather each phase's taps into one kernel of {self.shape[2:]} taps per phase, "
                f"phases as output channels within each of the {self.groups} group(s)")

    def label(self) -> str:
        return "each phase's taps in one kernel"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase rho: its taps of the flipped kernel at their offset, zero taps around them."""
        fused = self.shape[2 + dim]
        members = []
        for rho, t in enumerate(self.phases[dim]):
            zeros = [geo.Cell("zero", 0)] * fused
            if t is None:
                members.append(geo.renumber(geo.Axis(()), zeros))
                continue
            off = self.offsets[dim][rho]
            taps = [axis.cells[t.first + t.step * q] for q in range(t.count)]  # type: ignore[union-attr]
            members.append(geo.renumber(geo.Axis(()), [*zeros[:off], *taps, *zeros[off + t.count:]]))
        return geo.Family(tuple(members), False)

    def code(self, v: str, shape: Shape) -> list[str]:
        c_x, cyg, *k = shape
        zeros = (self.groups, c_x // self.groups, cyg, *self.shape[2:])
        lines = [f"{v}_w = {v}.reshape({commas((self.groups, c_x // self.groups, cyg, *k))})  # (g, C_x/g, C_y/g, *k)",
                 "subs = []"]
        for part in self._parts():
            if part is None:
                lines.append(f"subs.append({v}_w.new_zeros({commas(zeros)}))  # a phase no tap reaches")
            else:
                lines += pad_code("p", f"{v}_w[..., {index_text(part[1])}]", part[2], f"phase {part[0]}")
                lines.append("subs.append(p)")
        return [*lines, f"{v} = torch.stack(subs, 1).reshape({commas(self.shape)})  # every phase's taps: {self.shape}"]


@dataclass(frozen=True)
class DepthToSpace:
    """(N, g*P*C_x/g, *rows) -> (N, C_x, *i): the channels of phase rho become the rows rho::s (cropped to i).

    The phases' rows begin ``start`` rows into the conv's output (rows a symmetric conv padding added).
    """

    groups: int
    stride: Shape
    shape: Shape
    start: Shape = ()

    def _writes(self) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]:
        """Per phase p (rho row-major): (p, the rows rho::s of the big side it fills, the rows of its result that
        land there: ``start`` on, as many as the big side has in rho::s). What the call writes and the code too."""
        start = self.start or (0,) * len(self.stride)
        return [(p, phase_rows(self.stride, rho), tuple(slice(b, b + len(range(r, i, s))) for b, r, s, i in
                                                       zip(start, rho, self.stride, self.shape[2:], strict=True)))
                for p, rho in enumerate(itertools.product(*(range(s) for s in self.stride)))]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n, _, *rows = t.shape
        g, c_x = self.groups, self.shape[1]
        phases = t.view(n, g, math.prod(self.stride), c_x // g, *rows)  # (N, g, P, C_x/g, *rows)
        out = new_like(t, self.shape)
        grouped = out.view(n, g, c_x // g, *self.shape[2:])  # (N, g, C_x/g, *i)
        for p, where, rows_of_p in self._writes():
            grouped[(..., *where)] = sliced(phases[:, :, p], list(rows_of_p))
        return out

    def describe(self) -> str:
        return f"depth to space: the channels of phase rho become the rows rho::{self.stride}"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Row u of the big side is row start + u // s of phase u % s's result."""
        s, b = self.stride[dim], (self.start[dim] if self.start else 0)
        members = axis.members if isinstance(axis, geo.Family) else (axis,)
        return geo.Axis(tuple(members[u % s].cells[b + u // s]._replace(key=u, phase=u % s)  # type: ignore[union-attr]
                              for u in range(self.shape[2 + dim])))

    def code(self, v: str, shape: Shape) -> list[str]:
        n, _, *rows = shape
        g, c_x = self.groups, self.shape[1]
        lines = [f"{v}_p = {v}.reshape({commas((n, g, math.prod(self.stride), c_x // g, *rows))})  # (N, g, P, "
                 f"C_x/g, *rows)", f"{v} = {v}.new_zeros({commas((n, g, c_x // g, *self.shape[2:]))})"]
        lines += [f"{v}[..., {index_text(where)}] = {v}_p[:, :, {p}][..., {index_text(rows_of_p)}]"
                  for p, where, rows_of_p in self._writes()]
        return [*lines, f"{v} = {v}.reshape({commas(self.shape)})  # depth to space: {self.shape}"]
