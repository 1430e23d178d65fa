"""The fwdconv backend: every gradient written with forward convolutions only (the seeds' method).

Contractions, per group (x: big side, y: small side, T: kernel taps; DESIGN.md):
    grad of x   [N, C_y/g, zero-inserted y] * flip(w)^T [C_x/g, C_y/g, T]  -> [N, C_x/g, i]
                 (stride 1, dilation d; y zero-inserted by s and padded by transpose_pads)
    grad of y   [N, C_x/g, x] * w [C_y/g, C_x/g, T]                        -> [N, C_y/g, o]
                 (stride s, dilation d: the forward conv; used by transposed convs)
    grad of w   [C_x/g, N, x] * y^T [C_y/g, N, o]                          -> [C_x/g, C_y/g, T]
                 (batch and channels swapped, stride d, dilation s; groups folded into channels)

Work happens in two steps. ``plan_input_grad(spec)`` / ``plan_weight_grad(spec)``
turn a ConvSpec into a :class:`Plan`: a short list of plain steps that depends on
shapes only. ``execute(plan, data, kernel)`` runs it on tensors. ``convgrad.explain``
renders the very same Plan objects, so what is explained is what runs. Every step
is a differentiable torch op, so gradients of any order come from autograd.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

import torch

from convgrad._ops import CONV, pad
from convgrad.backends import Backend, register
from convgrad.spec import ConvSpec, Pair

Shape = tuple[int, ...]


class Step(Protocol):
    """One plain tensor operation of a plan: applied by calling it, described by describe()."""

    shape: Shape  # the tensor's shape after this step

    def __call__(self, t: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class ZeroInsert:
    """Insert stride-1 zeros between neighbouring entries of every spatial dim."""

    stride: Shape
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n_, c, *o = t.shape
        t = t.reshape(n_, c, *(v for oj in o for v in (oj, 1)))  # (N, C, o1, 1, o2, 1, ...)
        t = pad(t, [p for s in self.stride for p in ((0, 0), (0, s - 1))])  # (N, C, o1, s1, o2, s2, ...)
        t = t.reshape(n_, c, *(oj * s for oj, s in zip(o, self.stride)))  # (N, C, o1*s1, ...)
        return pad(t, [(0, 1 - s) for s in self.stride])  # (N, C, (o1-1)s1+1, ...)

    def describe(self) -> str:
        return f"zero-insert by stride {self.stride} (stride-1 zeros between entries)"


@dataclass(frozen=True)
class Pad:
    """Pad (lo, hi) zeros per spatial dim; a negative amount crops."""

    pads: tuple[Pair, ...]
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return pad(t, self.pads)

    def describe(self) -> str:
        return f"pad (lo, hi) = {self.pads} per spatial dim (negative = crop)"


@dataclass(frozen=True)
class Flip:
    """Flip the kernel in every spatial dim."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.flip(list(range(2, t.dim())))

    def describe(self) -> str:
        return "flip the kernel in every spatial dim"


@dataclass(frozen=True)
class SwapGroupChannels:
    """(C_y, C_x/g, *k) -> (C_x, C_y/g, *k): swap in and out channels inside each group."""

    groups: int
    shape: Shape

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        c_y, cxg, *k = w.shape
        w = w.reshape(self.groups, c_y // self.groups, cxg, *k)  # (g, C_y/g, C_x/g, *k)
        return w.transpose(1, 2).reshape(self.shape)  # (C_x, C_y/g, *k)

    def describe(self) -> str:
        return f"swap in/out channels within each of the {self.groups} group(s)"


@dataclass(frozen=True)
class BatchIntoChannels:
    """(N, C_x, *i) -> (C_x/g, g*N, *i): samples become channels, grouped by conv group."""

    groups: int
    shape: Shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n_, c_x, *i = x.shape
        x = x.reshape(n_, self.groups, c_x // self.groups, *i)  # (N, g, C_x/g, *i)
        return x.permute(2, 1, 0, *range(3, x.dim())).reshape(c_x // self.groups, self.groups * n_, *i)  # (C_x/g, g*N, *i)

    def describe(self) -> str:
        return f"fold the batch into the channels, group-major ({self.groups} group(s))"


@dataclass(frozen=True)
class SwapBatchChannels:
    """(A, B, *s) -> (B, A, *s)."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1)

    def describe(self) -> str:
        return "swap the first two dims (batch <-> channels)"


@dataclass(frozen=True)
class Conv:
    """A forward convolution, data * kernel, with explicit stride, padding, dilation and groups."""

    stride: Shape
    padding: Shape
    dilation: Shape
    groups: int
    shape: Shape

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return CONV[len(self.stride)](data, kernel, None, self.stride, self.padding, self.dilation, self.groups)

    def describe(self) -> str:
        return (f"conv{len(self.stride)}d stride={self.stride} padding={self.padding} "
                f"dilation={self.dilation} groups={self.groups}")


@dataclass(frozen=True)
class Plan:
    """The steps that compute one gradient: data path, kernel path, one conv, then post steps.

    ``conv`` is None when the gradient is an empty sum (batch 0): the result is zeros.
    """

    gradient: str
    spec: ConvSpec
    data: str
    kernel: str
    data_steps: tuple[Step, ...]
    kernel_steps: tuple[Step, ...]
    conv: Conv | None
    post_steps: tuple[Step, ...]
    shape: Shape


def execute(plan: Plan, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Run a plan on tensors; every op is differentiable."""
    if plan.conv is None:
        return data.new_zeros(plan.shape)
    for step in plan.data_steps:
        data = step(data)
    for step in plan.kernel_steps:
        kernel = step(kernel)
    out = plan.conv(data, kernel)
    for step in plan.post_steps:
        out = step(out)
    return out


def _pad_or_fold(pads: tuple[Pair, ...], before: Shape, after: Shape) -> tuple[list[Step], Shape, Shape]:
    """A symmetric, non-negative pad folds into the conv's own padding; anything else is a step.

    Returns the steps, the conv's padding and the shape the data has when it reaches the conv.
    """
    if all(lo == hi and lo >= 0 for lo, hi in pads):
        return [], tuple(lo for lo, _ in pads), before
    return [Pad(pads, after)], (0,) * len(pads), after


def _grad_x_plan(spec: ConvSpec, gradient: str, data: str) -> Plan:
    """x from y: zero-insert, pad, and a stride-1 conv with the flipped, channel-swapped kernel."""
    n_, cy, g = spec.batch, spec.y_channels, spec.groups
    steps: list[Step] = []
    if any(s > 1 for s in spec.stride):
        steps.append(ZeroInsert(spec.stride, (n_, cy, *spec.zero_inserted_size)))
    before = (n_, cy, *(spec.zero_inserted_size))
    pad_steps, conv_pad, _ = _pad_or_fold(spec.transpose_pads, before, (n_, cy, *spec.transpose_padded_size))
    kernel_steps = (Flip(spec.weight_shape), SwapGroupChannels(g, (spec.x_channels, cy // g, *spec.kernel_size)))
    conv = Conv((1,) * spec.n, conv_pad, spec.dilation, g, spec.x_shape)
    return Plan(gradient, spec, data, "weight", (*steps, *pad_steps), kernel_steps, conv, (), spec.x_shape)


def _grad_y_plan(spec: ConvSpec, gradient: str, data: str) -> Plan:
    """y from x: the forward conv itself, reading x exactly (crop the leftover r)."""
    x_shape = (spec.batch, spec.x_channels)
    pad_steps, conv_pad, _ = _pad_or_fold(spec.x_read_pads, (*x_shape, *spec.x_size), (*x_shape, *spec.x_read_size))
    conv = Conv(spec.stride, conv_pad, spec.dilation, spec.groups, spec.y_shape)
    return Plan(gradient, spec, data, "weight", tuple(pad_steps), (), conv, (), spec.y_shape)


@lru_cache(maxsize=1024)
def plan_input_grad(spec: ConvSpec) -> Plan:
    """The plan for grad_input: the x-gradient of a forward conv, the y-gradient of a transposed one."""
    if spec.transposed:
        return _grad_y_plan(spec, "grad_input", "grad_output")
    return _grad_x_plan(spec, "grad_input", "grad_output")


@lru_cache(maxsize=1024)
def plan_weight_grad(spec: ConvSpec) -> Plan:
    """The plan for grad_weight: x (batch folded into channels) convolved with y as the kernel."""
    g, cx, cy, n_ = spec.groups, spec.x_channels, spec.y_channels, spec.batch
    x_name, y_name = ("grad_output", "input") if spec.transposed else ("input", "grad_output")
    if n_ == 0:
        return Plan("grad_weight", spec, x_name, y_name, (), (), None, (), spec.weight_shape)
    pad_steps, conv_pad, padded = _pad_or_fold(spec.x_read_pads, (n_, cx, *spec.x_size), (n_, cx, *spec.x_read_size))
    data_steps = (*pad_steps, BatchIntoChannels(g, (cx // g, g * n_, *padded[2:])))
    kernel_steps = (SwapBatchChannels((cy, n_, *spec.y_size)),)
    conv = Conv(spec.dilation, conv_pad, spec.stride, g, (cx // g, cy, *spec.kernel_size))
    post = (SwapBatchChannels(spec.weight_shape),)
    return Plan("grad_weight", spec, x_name, y_name, data_steps, kernel_steps, conv, post, spec.weight_shape)


@register
class FwdConvBackend(Backend):
    """Forward convolutions, pads, flips and reshapes only; never a convolution_backward."""

    name = "fwdconv"
    supports_complex = True

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return execute(plan_input_grad(spec), grad_output, weight)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        x, y = (grad_output, input) if spec.transposed else (input, grad_output)
        return execute(plan_weight_grad(spec), x, y)
