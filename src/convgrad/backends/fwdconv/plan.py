"""The fwdconv plan: the plain steps a gradient is made of, the Plan that lists them, and ``execute``.

The plan builders (fwdconv.py for grad of x and y, fwdconv_weight.py for grad of w) and ``convgrad.explain``
all import the steps from here, so no builder imports another. Each step is a differentiable torch op
with a ``shape`` (the tensor's shape after it) and a ``describe()``; the faster steps (matmuls, phases,
taps) live in fwdconv_steps.py and fwdconv_phases.py and follow the same protocol.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from convgrad._ops import CONV, pad
from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.steps import Contraction, Spatially, _flat
from convgrad.spec import ConvSpec, Pair

__all__ = ["BatchIntoChannels", "Conv", "Flip", "Pad", "Plan", "Step", "SwapBatchChannels", "SwapGroupChannels",
           "ZeroInsert", "execute", "pad_code", "pad_or_fold"]

Shape = tuple[int, ...]


class Step(Protocol):
    """One plain tensor operation of a plan: applied by calling it, described by describe()."""

    @property
    def shape(self) -> Shape: ...  # the tensor's shape after this step (read-only: steps are frozen)

    def __call__(self, t: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry: ...


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

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Row j moves to key j*s; s-1 zeros follow every row but the last."""
        s = self.stride[dim]

        def spread(a: geo.Axis) -> geo.Axis:
            cells = [geo.Cell(c.kind, c.key * s, c.source) for c in a.cells]
            with_zeros = [z for c in cells[:-1] for z in (c, *(geo.Cell("zero", c.key + q) for q in range(1, s)))]
            return geo.Axis((*with_zeros, *cells[-1:]), a.dropped)

        return geo.each(spread, axis)


@dataclass(frozen=True)
class Pad:
    """Pad (lo, hi) zeros per spatial dim; a negative amount crops."""

    pads: tuple[Pair, ...]
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return pad(t, self.pads)

    def describe(self) -> str:
        return f"pad (lo, hi) = {self.pads} per spatial dim (negative = crop)"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return geo.each(lambda a: geo.pad_axis(a, *self.pads[dim]), axis)


@dataclass(frozen=True)
class Flip:
    """Flip the kernel in every spatial dim."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.flip(list(range(2, t.dim())))

    def describe(self) -> str:
        return "flip the kernel in every spatial dim"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Position j now holds the tap that was at k-1-j."""
        return geo.each(lambda a: geo.renumber(a, a.cells[::-1]), axis)


@dataclass(frozen=True)
class SwapGroupChannels(Spatially):
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
class BatchIntoChannels(Spatially):
    """(N, C_x, *i) -> (C_x/g, g*N, *i): samples become channels, grouped by conv group."""

    groups: int
    shape: Shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n_, c_x, *i = x.shape
        x = x.reshape(n_, self.groups, c_x // self.groups, *i)  # (N, g, C_x/g, *i)
        x = x.permute(2, 1, 0, *range(3, x.dim()))  # (C_x/g, g, N, *i)
        return x.reshape(c_x // self.groups, self.groups * n_, *i)  # (C_x/g, g*N, *i)

    def describe(self) -> str:
        return f"fold the batch into the channels, group-major ({self.groups} group(s))"


@dataclass(frozen=True)
class SwapBatchChannels(Spatially):
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

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Result row u sums data[u*s + t*d] * kernel[t], the data padded by the conv's own padding."""
        s, p, d, rows = self.stride[dim], self.padding[dim], self.dilation[dim], self.shape[2 + dim]
        return geo.contract(lambda a, k: geo.conv_rows(a, k, s, p, d, rows), data, kernel)


@dataclass(frozen=True)
class Plan:
    """The steps that compute one gradient: data path, kernel path, one conv, then post steps.

    ``conv`` is None when the gradient is an empty sum (batch 0): the result is zeros. It may also be
    a MatMul or PhaseConvs (fwdconv_steps.py). ``method`` names the formulation and ``reason`` says
    why the plan builder chose it.
    """

    gradient: str
    spec: ConvSpec
    data: str
    kernel: str
    data_steps: tuple[Step, ...]
    kernel_steps: tuple[Step, ...]
    conv: Contraction | None
    post_steps: tuple[Step, ...]
    shape: Shape
    method: str = "direct"
    reason: str = ""


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


def pad_or_fold(pads: tuple[Pair, ...], before: Shape, after: Shape) -> tuple[list[Step], Shape, Shape]:
    """A symmetric, non-negative pad folds into the conv's own padding; anything else is a step.

    Returns the steps, the conv's padding and the shape the data has when it reaches the conv.
    """
    if all(lo == hi and lo >= 0 for lo, hi in pads):
        return [], tuple(lo for lo, _ in pads), before
    return [Pad(pads, after)], (0,) * len(pads), after


def pad_code(out: str, src: str, pads: tuple[Pair, ...], note: str) -> list[str]:
    """The script lines of ``_ops.pad``: F.pad, but a crop (negative amount) after the pads, as a slice.

    F.pad crops before it pads, so a crop that only the other side's padding makes room for fails there
    ("narrow(): length must be non-negative"); a slice past the end is merely empty, as the crop is.
    """
    flat = _flat(pads)
    if all(v >= 0 for v in flat):
        return [f"{out} = F.pad({src}, {flat})  # pads {tuple(pads)}: {note}"]
    grow = tuple((max(lo, 0), max(hi, 0)) for lo, hi in pads)
    lines = [f"{out} = F.pad({src}, {_flat(grow)})  # pads {grow}, then the crops"] if any(map(any, grow)) else []
    crop = ", ".join(f"{max(-lo, 0) or ''}:{hi if hi < 0 else ''}" for lo, hi in pads)
    return [*lines, f"{out} = {out if lines else src}[..., {crop}]  # crops {tuple(pads)}: {note}"]
