"""The faster steps of the fwdconv plans: matmuls and folds (forward convolutions only); phases are in
fwdconv_phases.py.

Contractions, per group (x: big side, y: small side; DESIGN.md, the docs' "Derivation" page):
    matmul      a conv whose kernel is 1x1, or covers its whole input:  [B, I] x [I, O] -> [B, O]
    folds       batch into groups (per-sample convs, summed), taps into the batch (im2col by taps),
                dilation blocks into channels (space-to-depth): same sums, friendlier conv shapes

Each step is a frozen dataclass, like those of fwdconv.py: ``shape`` is the shape it produces,
calling it applies it, ``describe()`` says what it does in one line. A contraction (Conv, MatMul,
PhaseConvs) is called with (data, kernel). Every op is differentiable, so gradients of any order
come from autograd; layouts follow the data, so channels_last stays channels_last.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Protocol

import torch

from convgrad._ops import add_product_, batched_like, plain, sliced
from convgrad.backends.fwdconv import geometry as geo
from convgrad.spec import Pair

Shape = tuple[int, ...]

__all__ = ["BatchIntoGroups", "Contraction", "DepthwiseTaps", "FoldTaps", "MatMul", "SamplesIntoChannels",
           "SpaceToDepth", "Spatially", "Subsample", "SumSamples", "TapsToKernel"]


class Contraction(Protocol):
    """The one multiply-accumulate of a plan: called with (data, kernel)."""

    @property
    def shape(self) -> Shape: ...  # read-only: contractions are frozen

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Along one spatial dim: the (data, kernel) products summed into each result row (fwdconv_geometry)."""
        ...


class Spatially:
    """A step that moves channels or samples only: every spatial row stays where it is."""

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return axis


def _channels_last(t: torch.Tensor) -> bool:
    """True when the channels are the innermost dim in memory (NHWC-like), whatever the rank."""
    return t.dim() >= 3 and t.shape[1] > 1 and t.stride(1) == 1 and not t.is_contiguous()


def _new_like(data: torch.Tensor, shape: Shape, kernel: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised tensor of this shape in data's memory format (channels last stays channels last), batched
    like ``kernel`` too under functorch transforms (``_ops.batched_like``)."""
    if _channels_last(data):
        return batched_like(data.new_empty((shape[0], *shape[2:], shape[1])).movedim(-1, 1), kernel)
    return batched_like(data.new_empty(shape), kernel)


def _dims(values: object) -> str:
    return ", ".join(str(v) for v in values)  # type: ignore[attr-defined]


def _flat(pairs: tuple[Pair, ...]) -> list[int]:
    """(lo, hi) per trailing dim -> F.pad's flat list, last dim first."""
    return [v for lo, hi in reversed(pairs) for v in (lo, hi)]


def _slices(first: Shape, step: Shape, count: Shape) -> str:
    return ", ".join(f"{f}:{f + s * (c - 1) + 1}:{s}" for f, s, c in zip(first, step, count, strict=True))


def _contraction_code(conv: Contraction, out: str, data: str, kernel: str) -> list[str]:
    """Script lines for a contraction: its own code(), or F.conv*d for fwdconv's Conv."""
    own = getattr(conv, "code", None)
    if callable(own):
        return list(own(out, data, kernel))
    c = conv  # fwdconv.Conv: stride, padding, dilation, groups
    return [f"{out} = F.conv{len(c.stride)}d({data}, {kernel}, None, stride={c.stride}, "  # type: ignore[attr-defined]
            f"padding={c.padding}, dilation={c.dilation}, groups={c.groups})  # {c.shape}"]  # type: ignore[attr-defined]


def _coordinate(index: int, counts: Shape, dim: int) -> int:
    """The coordinate in ``dim`` of a row-major flat index over ``counts``."""
    return index // math.prod(counts[dim + 1:]) % counts[dim]


# ---- matmuls ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatMul:
    """A conv computed as one matmul: its kernel is 1x1 (``pointwise``), or it covers the whole input.

    pointwise: (B, g*I, *S) x (O, I, 1, ..) -> (B, O, *S);  full: (B, g*I, *J) x (O, I, *J) -> (B, O, 1, ..).
    """

    groups: int
    pointwise: bool
    shape: Shape

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return self._pointwise(data, kernel) if self.pointwise else self._full(data, kernel)

    def _pointwise(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        g, b, o, i = self.groups, data.shape[0], self.shape[1], data.shape[1] // self.groups  # b: a batch chunk too
        spatial = data.shape[2:]
        k = kernel.reshape(g, o // g, i)  # (g, O/g, I)
        if i == 1 and o == g:  # depthwise: a matmul of 1x1 matrices per channel is a per-channel scale
            return data * kernel.reshape(1, g, *(1,) * len(spatial))  # (B, C, *S), in data's memory format
        if _channels_last(data) and g == 1:
            out = data.movedim(1, -1).reshape(b * math.prod(spatial), i) @ k[0].t()  # (B*S, O)
            return out.reshape(b, *spatial, o).movedim(-1, 1)  # (B, O, *S), channels last
        out = torch.matmul(k, data.reshape(b, g, i, math.prod(spatial)))  # (B, g, O/g, S)
        return out.reshape(b, o, *spatial)

    def _full(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        g, (b, o) = self.groups, self.shape[:2]
        ij = data.shape[1] // g * math.prod(data.shape[2:])
        d = data.reshape(b, g, ij).transpose(0, 1)  # (g, B, I*J)
        k = kernel.reshape(g, o // g, ij)  # (g, O/g, I*J)
        return torch.matmul(d, k.transpose(1, 2)).transpose(0, 1).reshape(self.shape)  # (B, O, 1, ..)

    def describe(self) -> str:
        kind = "a 1x1 kernel" if self.pointwise else "a kernel covering its whole input"
        return f"conv with {kind}, groups={self.groups}: one matmul"

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """pointwise: row u is data[u] * kernel[0]; full: one row, the sum of data[j] * kernel[j]."""
        def one(a: geo.Axis, k: geo.Axis) -> geo.Axis:
            if self.pointwise:
                return geo.Axis(tuple(geo.Out("out", u, ((c, k.cells[0]),), (a, k)) for u, c in enumerate(a.cells)))
            return geo.Axis((geo.Out("out", 0, tuple(zip(a.cells, k.cells, strict=True)), (a, k)),))

        return geo.contract(one, data, kernel)

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        g, o = self.groups, self.shape[1]
        if self.pointwise:
            return [f"{out} = torch.matmul({kernel}.reshape({g}, {o // g}, -1), {data}.unflatten(1, ({g}, -1))"
                    f".flatten(3)).reshape({_dims(self.shape)})  # 1x1 conv as a matmul"]
        return [f"{out} = torch.matmul({data}.unflatten(1, ({g}, -1)).flatten(2).transpose(0, 1), {kernel}.reshape("
                f"{g}, {o // g}, -1).transpose(1, 2)).transpose(0, 1).reshape({_dims(self.shape)})  # full-size kernel"]


@dataclass(frozen=True)
class DepthwiseTaps:
    """A depthwise conv (one channel of y per output channel) with stride 1, summed tap by tap: each tap scales its
    shifted slice of y by that channel's weight, and adds it into the rows the tap reaches.

    For the few taps of a polyphase phase this beats a conv call: a conv reorders y into oneDNN's blocked layout
    and its result back, and the phase work is memory-bound (measurements: fwdconv.TAPS_MAX_PHASE_TAPS).
    ``rows`` holds, per tap (row-major over ``counts``) and per dim, the output rows first..stop and the data row
    that the first of them reads (``spec.tap_rows``); taps that read nothing are left out.
    """

    counts: Shape
    rows: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # (tap index, per dim (first, stop, data_first))
    size: Shape  # the spatial size of y
    shape: Shape

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        c, nd = kernel.shape[0], len(self.counts)
        scales = kernel.reshape(c, -1).t().reshape(-1, 1, c, *(1,) * nd)  # (T, 1, C, 1, ..): each tap's weights
        fused = plain(data) and plain(kernel)
        out = None
        if not self._indices or self._indices[0][1] is not None:  # no tap reaches every row: start from zeros
            out = _new_like(data, (data.shape[0], *self.shape[1:]), kernel).zero_()  # (B, C, *rows)
        for tap, rows, src in self._indices:
            part = data if src is None else data[src]
            if out is None:
                out = part * scales[tap]  # (B, C, *rows), in data's memory format
            else:
                add_product_(out if rows is None else out[rows], part, scales[tap], fused)
        return out

    @functools.cached_property
    def _indices(self) -> list[tuple[int, tuple[slice, ...] | None, tuple[slice, ...] | None]]:
        """Per tap, a tap that fills every row first: (tap, rows of the result, rows of y), None where all rows.

        Indexing with whole-dim slices only would return an alias, which the legacy vmap of is_grads_batched
        cannot batch (``_ops.sliced``); None skips it."""
        def index(ranges: list[tuple[int, int]], sizes: Shape) -> tuple[slice, ...] | None:
            if all(a == 0 and b == n for (a, b), n in zip(ranges, sizes, strict=True)):
                return None
            return (slice(None), slice(None), *(slice(a, b) for a, b in ranges))

        entries = []
        for tap, dims in self.rows:
            rows = index([(first, stop) for first, stop, _ in dims], self.shape[2:])
            src = [(d, d + stop - first) for first, stop, d in dims]
            entries.append((tap, rows, src))
        entries.sort(key=lambda e: e[1] is not None)
        return [(tap, rows, index(src, self.size)) for tap, rows, src in entries]

    def describe(self) -> str:
        return f"depthwise conv of {math.prod(self.counts)} taps {self.counts}, summed tap by tap"

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Tap q adds data[r + offset_q] into row r; rows whose data row lies outside y read padding."""
        reach: dict[int, int] = {}  # tap coordinate in this dim -> data row read by result row 0
        for tap, dims in self.rows:
            first, _, data_first = dims[dim]
            reach[_coordinate(tap, self.counts, dim)] = data_first - first

        def one(a: geo.Axis, k: geo.Axis) -> geo.Axis:
            rows = range(self.shape[2 + dim])
            return geo.Axis(tuple(geo.Out("out", r, tuple((geo.row_or_pad(a, r + off), k.cells[q]) for q, off in
                                                          sorted(reach.items())), (a, k)) for r in rows))

        return geo.contract(one, data, kernel)

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        c, nd = self.shape[1], len(self.counts)
        lines = [f"{out} = {data}.new_zeros(({data}.shape[0], {_dims(self.shape[1:])}))  # depthwise, tap by tap",
                 f"{out}_w = {kernel}.reshape({c}, -1)"]
        for tap, dims in self.rows:
            rows = ", ".join(f"{first}:{stop}" for first, stop, _ in dims)
            src = ", ".join(f"{d}:{d + stop - first}" for first, stop, d in dims)
            lines.append(f"{out}[..., {rows}] += {data}[..., {src}] * {out}_w[:, {tap}].reshape(1, {c}"
                         f"{', 1' * nd})  # tap {tap}")
        return lines


@dataclass(frozen=True)
class Subsample:
    """Keep every s-th row in every spatial dim (what a 1x1, stride-s conv reads)."""

    stride: Shape
    shape: Shape

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t[(..., *(slice(None, None, s) for s in self.stride))]

    def describe(self) -> str:
        return f"keep every {self.stride}-th row"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return geo.each(lambda a: geo.select(a, range(0, len(a.cells), self.stride[dim])), axis)

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}[..., {', '.join(f'::{s}' for s in self.stride)}]  # every s-th row: {self.shape}"]


# ---- folds for grad_weight ------------------------------------------------------------------------------------------

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
        for j, (k, s, d) in enumerate(zip(self.kernel_size, self.stride, self.dilation)):
            x = x.unfold(2 + j, d * (k - 1) + 1, s)  # (N, C_x, *o, *window) after every dim
        x = sliced(x, [slice(None, None, d) for d in self.dilation])  # (N, C_x, *o, *k)
        x = x.reshape(n, g, c_x // g, *x.shape[2:])  # (N, g, C_x/g, *o, *k)
        taps, outs = range(3 + nd, 3 + 2 * nd), range(3, 3 + nd)
        return x.permute(2, *taps, 1, 0, *outs).reshape(self.shape)  # (C_x/g*T, g*N, *o)

    def describe(self) -> str:
        return (f"fold the windows of the {math.prod(self.kernel_size)} taps into the batch "
                f"(im2col by taps, stride {self.stride}, dilation {self.dilation})")

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
                f"{v} = {v}.reshape({n}, {g}, {c_x // g}, *{v}.shape[2:]).permute({_dims(perm)})"
                f".reshape({_dims(self.shape)})  # taps into the batch: {self.shape}"]


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

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """The one result row of each tap's member becomes row t."""
        if not isinstance(axis, geo.Family):
            raise TypeError(f"TapsToKernel.rows: expects the results of its tap windows, not a {type(axis).__name__}")
        return geo.renumber(geo.Axis(()), [m.cells[0] for m in axis.members])  # type: ignore[union-attr]

    def code(self, v: str, shape: Shape) -> list[str]:
        c_y, cxg, *k = self.shape
        return [f"{v} = {v}.reshape({_dims((cxg, *k, c_y))}).movedim(-1, 0)  # (C_y, C_x/g, *k): {self.shape}"]


@dataclass(frozen=True)
class BatchIntoGroups(Spatially):
    """(N, C_x, *i) -> (C_x/g, N*g, *i): each sample's group becomes its own conv group."""

    groups: int
    shape: Shape

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, c_x, *i = x.shape
        x = x.reshape(n, self.groups, c_x // self.groups, *i)  # (N, g, C_x/g, *i)
        return x.permute(2, 0, 1, *range(3, x.dim())).reshape(self.shape)  # (C_x/g, N*g, *i)

    def describe(self) -> str:
        return f"fold the batch into the groups (sample-major, {self.groups} group(s) each)"

    def code(self, v: str, shape: Shape) -> list[str]:
        n, c_x, *i = shape
        perm = (2, 0, 1, *range(3, 3 + len(i)))
        return [f"{v} = {v}.reshape({_dims((n, self.groups, c_x // self.groups, *i))}).permute({_dims(perm)})"
                f".reshape({_dims(self.shape)})  # batch into groups: {self.shape}"]


@dataclass(frozen=True)
class SamplesIntoChannels(Spatially):
    """(N, C_y, *o) -> (N*C_y, 1, *o): one single-channel kernel per sample and output channel."""

    shape: Shape

    def __call__(self, y: torch.Tensor) -> torch.Tensor:
        return y.reshape(self.shape)

    def describe(self) -> str:
        return "one kernel per sample and channel: (N, C_y, *o) -> (N*C_y, 1, *o)"

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}.reshape({_dims(self.shape)})  # one kernel per sample and channel"]


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
        return [f"{v} = {v}.reshape({_dims((cxg, self.batch, c_y, *k))}).sum(1)  # add the samples: {self.shape}"]


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

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase phi < d: the rows phi, phi + d, ...; the conv sums over the members (channels)."""
        d, rows = self.block[dim], geo.plain(axis, self)
        return geo.Family(tuple(geo.select(rows, range(phi, len(rows.cells), d)) for phi in range(d)), True)

    def code(self, v: str, shape: Shape) -> list[str]:
        n, c, *size = shape
        nd, g = len(self.block), self.groups
        split = (n, g, c // g, *(x for u, d in zip(size, self.block) for x in (u // d, d)))
        perm = (2, 1, 0, *range(4, 3 + 2 * nd, 2), *range(3, 3 + 2 * nd, 2))
        return [f"{v} = {v}.reshape({_dims(split)}).permute({_dims(perm)}).reshape({_dims(self.shape)})"
                f"  # space to depth: {self.shape}"]
