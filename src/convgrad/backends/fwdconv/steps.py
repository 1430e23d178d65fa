"""The plain steps of the fwdconv plans: pads, zero-insertion, flips, channel swaps, folds, subsampling.

Each step is a frozen dataclass that follows plan.Step: ``shape`` is the shape it produces, calling it
applies it, ``describe()`` and ``label()`` say what it does, ``code()`` writes it as script lines and
``rows()`` tells where it moves the rows of one spatial dim. Every op is differentiable, so gradients of
any order come from autograd; layouts follow the data, so channels_last stays channels_last. Steps that
belong to one formulation only live with its builder (grad_input.py: sub-pixel; grad_weight.py: phases).

Folds, per group (x: big side, y: small side): batch into channels or groups (BatchFold), taps into the
batch (im2col by taps, FoldTaps), dilation blocks into channels (space-to-depth): same sums, friendlier
conv shapes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.plan import Spatially, Step, commas, pad_code
from convgrad.spec import Pair, Shape
from convgrad.tensor_ops import batched_like, channels_innermost, pad, pad_flat, windows

__all__ = ["BatchFold", "Flip", "FoldTaps", "Pad", "SamplesIntoChannels", "SpaceToDepth", "Subsample", "SumSamples",
           "SwapBatchChannels", "SwapGroupChannels", "TapsToKernel", "ZeroInsert", "new_like",
           "pad_or_fold"]


def new_like(data: torch.Tensor, shape: Shape, kernel: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised tensor of this shape in data's memory format (channels last stays channels last), batched
    like ``kernel`` too under functorch transforms (``tensor_ops.batched_like``)."""
    if channels_innermost(data):
        return batched_like(data.new_empty((shape[0], *shape[2:], shape[1])).movedim(-1, 1), kernel)
    return batched_like(data.new_empty(shape), kernel)


# ---- pads, zeros and flips ----------------------------------------------------------------------------------------

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

    def label(self) -> str:
        return f"zero-insert by stride {self.stride}"

    def code(self, v: str, shape: Shape) -> list[str]:
        n_, c, *o = shape
        spread = [x for oj in o for x in (oj, 1)]
        between = tuple(p for s in self.stride for p in ((0, 0), (0, s - 1)))
        return [
            f"{v} = {v}.reshape({commas((n_, c, *spread))})  # (N, C, o1, 1, o2, 1, ...)",
            f"{v} = F.pad({v}, {pad_flat(between)})  # (N, C, o1, s1, ...): s-1 zeros after every entry",
            f"{v} = {v}.reshape({commas((n_, c, *(oj * s for oj, s in zip(o, self.stride, strict=True))))})"
            f"  # (N, C, o1*s1, ...)",
            f"{v} = F.pad({v}, {pad_flat(tuple((0, 1 - s) for s in self.stride))})  # drop the zeros after the last "
            f"entry: {self.shape}",
        ]

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

    def label(self) -> str:
        return f"pad (lo, hi) = {self.pads}"

    def code(self, v: str, shape: Shape) -> list[str]:
        return pad_code(v, v, self.pads, f"{self.shape}")

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return geo.each(lambda a: geo.pad_axis(a, *self.pads[dim]), axis)


def pad_or_fold(pads: tuple[Pair, ...], before: Shape, after: Shape) -> tuple[list[Step], Shape, Shape]:
    """A symmetric, non-negative pad folds into the conv's own padding; anything else is a step.

    Returns the steps, the conv's padding and the shape the data has when it reaches the conv.
    """
    if all(lo == hi and lo >= 0 for lo, hi in pads):
        return [], tuple(lo for lo, _ in pads), before
    return [Pad(pads, after)], (0,) * len(pads), after


@dataclass(frozen=True)
class Flip:
    """Flip the kernel in every spatial dim."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.flip(list(range(2, t.dim())))

    def describe(self) -> str:
        return "flip the kernel in every spatial dim"

    def label(self) -> str:
        return "flip the kernel"

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}.flip({list(range(2, len(shape)))})  # flip every spatial dim: {self.shape}"]

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Position j now holds the tap that was at k-1-j."""
        return geo.each(lambda a: geo.renumber(a, a.cells[::-1]), axis)


# ---- channel and batch moves: no row moves ------------------------------------------------------------------------

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

    def code(self, v: str, shape: Shape) -> list[str]:
        c_y, cxg, *k = shape
        g = self.groups
        return [f"{v} = {v}.reshape({commas((g, c_y // g, cxg, *k))})  # (g, C_y/g, C_x/g, *k)",
                f"{v} = {v}.transpose(1, 2).reshape({commas(self.shape)})"
                f"  # (C_x, C_y/g, *k): in/out swapped per group"]


@dataclass(frozen=True)
class BatchFold(Spatially):
    """(N, C_x, *i) -> (C_x/g, N*g, *i): the samples become channels of a conv whose kernel is y.

    ``order`` is how the N*g dim is laid out: ``"group_major"`` (g, N), every group's samples side by side
    as the channels that the grad-of-w conv contracts; ``"sample_major"`` (N, g), every sample's group its
    own conv group, for per-sample convs.
    """

    groups: int
    order: Literal["group_major", "sample_major"]
    shape: Shape

    def _perm(self, nd: int) -> tuple[int, ...]:
        """From (N, g, C_x/g, *i): C_x/g first, then the (g, N) or (N, g) pair."""
        return (2, *((1, 0) if self.order == "group_major" else (0, 1)), *range(3, 3 + nd))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n_, c_x, *i = x.shape
        x = x.reshape(n_, self.groups, c_x // self.groups, *i)  # (N, g, C_x/g, *i)
        return x.permute(self._perm(len(i))).reshape(self.shape)  # (C_x/g, g*N or N*g, *i)

    def describe(self) -> str:
        if self.order == "group_major":
            return f"fold the batch into the channels, group-major ({self.groups} group(s))"
        return f"fold the batch into the groups (sample-major, {self.groups} group(s) each)"

    def code(self, v: str, shape: Shape) -> list[str]:
        n_, c_x, *i = shape
        g = self.groups
        what = "(C_x/g, g*N, *i): samples as channels" if self.order == "group_major" else \
            "(C_x/g, N*g, *i): samples as groups"
        return [f"{v} = {v}.reshape({commas((n_, g, c_x // g, *i))})  # (N, g, C_x/g, *i)",
                f"{v} = {v}.permute({commas(self._perm(len(i)))}).reshape({commas(self.shape)})  # {what}"]


@dataclass(frozen=True)
class SwapBatchChannels(Spatially):
    """(A, B, *s) -> (B, A, *s)."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.transpose(0, 1)

    def describe(self) -> str:
        return "swap the first two dims (batch <-> channels)"

    def code(self, v: str, shape: Shape) -> list[str]:
        perm = (1, 0, *range(2, len(shape)))
        return [f"{v} = {v}.permute({commas(perm)})  # swap batch and channels: {self.shape}"]


@dataclass(frozen=True)
class SamplesIntoChannels(Spatially):
    """(N, C_y, *o) -> (N*C_y, 1, *o): one single-channel kernel per sample and output channel."""

    shape: Shape

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.shape)

    def describe(self) -> str:
        return "one kernel per sample and channel: (N, C_y, *o) -> (N*C_y, 1, *o)"

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}.reshape({commas(self.shape)})  # one kernel per sample and channel"]


@dataclass(frozen=True)
class SumSamples(Spatially):
    """(C_x/g, N*C_y, *k) -> (C_x/g, C_y, *k): add the per-sample gradients."""

    batch: int
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        cxg, c_y, *k = self.shape
        return t.reshape(cxg, self.batch, c_y, *k).sum(1)  # (C_x/g, C_y, *k)

    def describe(self) -> str:
        return f"sum the {self.batch} per-sample gradients"

    def code(self, v: str, shape: Shape) -> list[str]:
        cxg, c_y, *k = self.shape
        return [f"{v} = {v}.reshape({commas((cxg, self.batch, c_y, *k))}).sum(1)  # add the samples: {self.shape}"]


# ---- row selections and folds --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Subsample:
    """Keep every s-th row in every spatial dim (what a 1x1, stride-s conv reads)."""

    stride: Shape
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[(..., *(slice(None, None, s) for s in self.stride))]

    def describe(self) -> str:
        return f"keep every {self.stride}-th row"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return geo.each(lambda a: geo.select(a, range(0, len(a.cells), self.stride[dim])), axis)

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}[..., {', '.join(f'::{s}' for s in self.stride)}]  # every s-th row: {self.shape}"]


@dataclass(frozen=True)
class FoldTaps:
    """(N, C_x, *x_read) -> (C_x/g*T, g*N, *o): the window each of the T taps reads, folded into the batch."""

    groups: int
    kernel_size: Shape
    stride: Shape
    dilation: Shape
    shape: Shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c_x = x.shape[:2]
        nd, g = len(self.kernel_size), self.groups
        x = windows(x, self.kernel_size, self.stride, self.dilation)  # (N, C_x, *o, *k)
        x = x.reshape(n, g, c_x // g, *x.shape[2:])  # (N, g, C_x/g, *o, *k)
        taps, outs = range(3 + nd, 3 + 2 * nd), range(3, 3 + nd)
        return x.permute(2, *taps, 1, 0, *outs).reshape(self.shape)  # (C_x/g*T, g*N, *o)

    def describe(self) -> str:
        return (f"fold the windows of the {math.prod(self.kernel_size)} taps into the batch "
                f"(im2col by taps, stride {self.stride}, dilation {self.dilation})")

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per tap t: the rows t*d + j*s, j < o, that it meets."""
        k, s, d, o = self.kernel_size[dim], self.stride[dim], self.dilation[dim], self.shape[2 + dim]
        windows = [[t * d + j * s for j in range(o)] for t in range(k)]
        return geo.Family(tuple(geo.select(geo.plain(axis, self), w) for w in windows), False)

    def code(self, v: str, shape: Shape) -> list[str]:
        n, c_x, *_ = shape
        nd, g = len(self.kernel_size), self.groups
        lines = [f"{v} = {v}.unfold({2 + j}, {d * (k - 1) + 1}, {s})  # windows of dim {j}"
                 for j, (k, s, d) in enumerate(zip(self.kernel_size, self.stride, self.dilation))]
        perm = (2, *range(3 + nd, 3 + 2 * nd), 1, 0, *range(3, 3 + nd))
        return [*lines, f"{v} = {v}[..., {', '.join(f'::{d}' for d in self.dilation)}]  # (N, C_x, *o, *k)",
                f"{v} = {v}.reshape({n}, {g}, {c_x // g}, *{v}.shape[2:]).permute({commas(perm)})"
                f".reshape({commas(self.shape)})  # taps into the batch: {self.shape}"]


@dataclass(frozen=True)
class TapsToKernel:
    """(C_x/g*T, C_y, 1, ..) -> (C_y, C_x/g, *k): the matmul's rows back into kernel taps."""

    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        c_y, cxg, *k = self.shape
        t = t.reshape(cxg, *k, c_y)  # (C_x/g, *k, C_y)
        return t.movedim(-1, 0)  # (C_y, C_x/g, *k)

    def describe(self) -> str:
        return "unfold the taps from the batch back into the kernel"

    def label(self) -> str:
        return "taps back into the kernel"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """The one result row of each tap's member becomes row t."""
        if not isinstance(axis, geo.Family):
            raise TypeError(f"TapsToKernel.rows: expects the results of its tap windows, not a {type(axis).__name__}")
        return geo.renumber(geo.Axis(()), [m.cells[0] for m in axis.members])  # type: ignore[union-attr]

    def code(self, v: str, shape: Shape) -> list[str]:
        c_y, cxg, *k = self.shape
        return [f"{v} = {v}.reshape({commas((cxg, *k, c_y))}).movedim(-1, 0)  # (C_y, C_x/g, *k): {self.shape}"]


@dataclass(frozen=True)
class SpaceToDepth:
    """(N, C, *(U*d)) -> (C/g, g*N*prod(d), *U): blocks of d rows become channels (after the batch)."""

    block: Shape
    groups: int
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n, c, *size = t.shape
        nd, g = len(self.block), self.groups
        blocks = [u // d for u, d in zip(size, self.block)]
        t = t.reshape(n, g, c // g, *(v for u, d in zip(blocks, self.block) for v in (u, d)))  # (N, g, C/g, U1, d1..)
        perm = (2, 1, 0, *range(4, 3 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))  # (C/g, g, N, *d, *U)
        return t.permute(perm).reshape(self.shape)  # (C/g, g*N*prod(d), *U)

    def describe(self) -> str:
        return f"space to depth by the dilation {self.block}: the phases of every block become channels"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase phi < d: the rows phi, phi + d, ...; the conv sums over the members (channels)."""
        d, rows = self.block[dim], geo.plain(axis, self)
        return geo.Family(tuple(geo.select(rows, range(phi, len(rows.cells), d)) for phi in range(d)), True)

    def code(self, v: str, shape: Shape) -> list[str]:
        n, c, *size = shape
        nd, g = len(self.block), self.groups
        split = (n, g, c // g, *(x for u, d in zip(size, self.block) for x in (u // d, d)))
        perm = (2, 1, 0, *range(4, 3 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))
        return [f"{v} = {v}.reshape({commas(split)}).permute({commas(perm)}).reshape({commas(self.shape)})"
                f"  # space to depth: {self.shape}"]
