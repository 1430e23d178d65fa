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
from convgrad.backends.fwdconv.plan import Chain, Spatially, Step, TensorOp
from convgrad.spec import Pair, Shape
from convgrad.tensor_ops import batched_like, channels_innermost

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
class ZeroInsert(Chain):
    """Insert stride-1 zeros between neighbouring entries of every spatial dim."""

    stride: Shape
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        n_, c, *o = shape
        return (TensorOp("reshape", ((n_, c, *(v for oj in o for v in (oj, 1))),), "(N, C, o1, 1, o2, 1, ...)"),
                TensorOp("pad", (tuple(p for s in self.stride for p in ((0, 0), (0, s - 1))),),
                         "(N, C, o1, s1, ...): s-1 zeros after every entry"),
                TensorOp("reshape", ((n_, c, *(oj * s for oj, s in zip(o, self.stride))),), "(N, C, o1*s1, ...)"),
                TensorOp("pad", (tuple((0, 1 - s) for s in self.stride),),
                         f"drop the zeros after the last entry: {self.shape}"))

    def describe(self) -> str:
        return f"zero-insert by stride {self.stride} (stride-1 zeros between entries)"

    def label(self) -> str:
        return f"zero-insert by stride {self.stride}"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Row j moves to key j*s; s-1 zeros follow every row but the last."""
        s = self.stride[dim]

        def spread(a: geo.Axis) -> geo.Axis:
            cells = [geo.Cell(c.kind, c.key * s, c.source) for c in a.cells]
            with_zeros = [z for c in cells[:-1] for z in (c, *(geo.Cell("zero", c.key + q) for q in range(1, s)))]
            return geo.Axis((*with_zeros, *cells[-1:]), a.dropped)

        return geo.each(spread, axis)


@dataclass(frozen=True)
class Pad(Chain):
    """Pad (lo, hi) zeros per spatial dim; a negative amount crops."""

    pads: tuple[Pair, ...]
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        return (TensorOp("pad", (self.pads,), f"{self.shape}"),)

    def describe(self) -> str:
        return f"pad (lo, hi) = {self.pads} per spatial dim (negative = crop)"

    def label(self) -> str:
        return f"pad (lo, hi) = {self.pads}"

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
class Flip(Chain):
    """Flip the kernel in every spatial dim."""

    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        return (TensorOp("flip", (list(range(2, len(shape))),), f"flip every spatial dim: {self.shape}"),)

    def describe(self) -> str:
        return "flip the kernel in every spatial dim"

    def label(self) -> str:
        return "flip the kernel"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Position j now holds the tap that was at k-1-j."""
        return geo.each(lambda a: geo.renumber(a, a.cells[::-1]), axis)


# ---- channel and batch moves: no row moves ------------------------------------------------------------------------

@dataclass(frozen=True)
class SwapGroupChannels(Spatially, Chain):
    """(C_y, C_x/g, *k) -> (C_x, C_y/g, *k): swap in and out channels inside each group."""

    groups: int
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        c_y, cxg, *k = shape
        return (TensorOp("reshape", ((self.groups, c_y // self.groups, cxg, *k),), "(g, C_y/g, C_x/g, *k)"),
                TensorOp("transpose", (1, 2), "(g, C_x/g, C_y/g, *k)"),
                TensorOp("reshape", (self.shape,), "(C_x, C_y/g, *k): in/out swapped per group"))

    def describe(self) -> str:
        return f"swap in/out channels within each of the {self.groups} group(s)"


@dataclass(frozen=True)
class BatchFold(Spatially, Chain):
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

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        n_, c_x, *i = shape
        what = "(C_x/g, g*N, *i): samples as channels" if self.order == "group_major" else \
            "(C_x/g, N*g, *i): samples as groups"
        return (TensorOp("reshape", ((n_, self.groups, c_x // self.groups, *i),), "(N, g, C_x/g, *i)"),
                TensorOp("permute", (self._perm(len(i)),), "(C_x/g, g, N, *i)" if self.order == "group_major" else
                         "(C_x/g, N, g, *i)"),
                TensorOp("reshape", (self.shape,), what))

    def describe(self) -> str:
        if self.order == "group_major":
            return f"fold the batch into the channels, group-major ({self.groups} group(s))"
        return f"fold the batch into the groups (sample-major, {self.groups} group(s) each)"


@dataclass(frozen=True)
class SwapBatchChannels(Spatially, Chain):
    """(A, B, *s) -> (B, A, *s)."""

    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        return (TensorOp("transpose", (0, 1), f"swap batch and channels: {self.shape}"),)

    def describe(self) -> str:
        return "swap the first two dims (batch <-> channels)"


@dataclass(frozen=True)
class SamplesIntoChannels(Spatially, Chain):
    """(N, C_y, *o) -> (N*C_y, 1, *o): one single-channel kernel per sample and output channel."""

    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        return (TensorOp("reshape", (self.shape,), "one kernel per sample and channel"),)

    def describe(self) -> str:
        return "one kernel per sample and channel: (N, C_y, *o) -> (N*C_y, 1, *o)"


@dataclass(frozen=True)
class SumSamples(Spatially, Chain):
    """(C_x/g, N*C_y, *k) -> (C_x/g, C_y, *k): add the per-sample gradients."""

    batch: int
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        cxg, c_y, *k = self.shape
        return (TensorOp("reshape", ((cxg, self.batch, c_y, *k),), "(C_x/g, N, C_y, *k)"),
                TensorOp("sum", (1,), f"add the samples: {self.shape}"))

    def describe(self) -> str:
        return f"sum the {self.batch} per-sample gradients"


# ---- row selections and folds --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Subsample(Chain):
    """Keep every s-th row in every spatial dim (what a 1x1, stride-s conv reads)."""

    stride: Shape
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        return (TensorOp("index", (tuple(slice(None, None, s) for s in self.stride),),
                         f"every s-th row: {self.shape}"),)

    def describe(self) -> str:
        return f"keep every {self.stride}-th row"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return geo.each(lambda a: geo.select(a, range(0, len(a.cells), self.stride[dim])), axis)


@dataclass(frozen=True)
class FoldTaps(Chain):
    """(N, C_x, *x_read) -> (C_x/g*T, g*N, *o): the window each of the T taps reads, folded into the batch."""

    groups: int
    kernel_size: Shape
    stride: Shape
    dilation: Shape
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        n, c_x = shape[:2]
        nd, g = len(self.kernel_size), self.groups
        taps, outs = range(3 + nd, 3 + 2 * nd), range(3, 3 + nd)
        return (TensorOp("windows", (self.kernel_size, self.stride, self.dilation), "(N, C_x, *o, *k)"),
                TensorOp("reshape", ((n, g, c_x // g, *self.shape[2:], *self.kernel_size),), "(N, g, C_x/g, *o, *k)"),
                TensorOp("permute", ((2, *taps, 1, 0, *outs),), "(C_x/g, *k, g, N, *o)"),
                TensorOp("reshape", (self.shape,), f"taps into the batch: {self.shape}"))

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


@dataclass(frozen=True)
class TapsToKernel(Chain):
    """(C_x/g*T, C_y, 1, ..) -> (C_y, C_x/g, *k): the matmul's rows back into kernel taps."""

    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        c_y, cxg, *k = self.shape
        return (TensorOp("reshape", ((cxg, *k, c_y),), "(C_x/g, *k, C_y)"),
                TensorOp("movedim", (-1, 0), f"(C_y, C_x/g, *k): {self.shape}"))

    def describe(self) -> str:
        return "unfold the taps from the batch back into the kernel"

    def label(self) -> str:
        return "taps back into the kernel"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """The one result row of each tap's member becomes row t."""
        if not isinstance(axis, geo.Family):
            raise TypeError(f"TapsToKernel.rows: expects the results of its tap windows, not a {type(axis).__name__}")
        return geo.renumber(geo.Axis(()), [m.cells[0] for m in axis.members])  # type: ignore[union-attr]


@dataclass(frozen=True)
class SpaceToDepth(Chain):
    """(N, C, *(U*d)) -> (C/g, g*N*prod(d), *U): blocks of d rows become channels (after the batch)."""

    block: Shape
    groups: int
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        n, c, *size = shape
        nd, g = len(self.block), self.groups
        split = (n, g, c // g, *(v for u, d in zip(size, self.block) for v in (u // d, d)))
        perm = (2, 1, 0, *range(4, 3 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))
        return (TensorOp("reshape", (split,), "(N, g, C/g, U1, d1, ...)"),
                TensorOp("permute", (perm,), "(C/g, g, N, *d, *U)"),
                TensorOp("reshape", (self.shape,), f"space to depth: {self.shape}"))

    def describe(self) -> str:
        return f"space to depth by the dilation {self.block}: the phases of every block become channels"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase phi < d: the rows phi, phi + d, ...; the conv sums over the members (channels)."""
        d, rows = self.block[dim], geo.plain(axis, self)
        return geo.Family(tuple(geo.select(rows, range(phi, len(rows.cells), d)) for phi in range(d)), True)

