"""Where each fwdconv plan step moves the rows of one spatial dim: plain data that explain's pictures draw.

Every step of a plan acts on each spatial dim separately (the N-d sums are products of 1-d ones), so a
step's geometry is told one dim at a time. Data and kernel steps map an ``Axis`` (the rows a tensor has
along that dim, after the steps so far) to a new Axis: ``step.rows(dim, axis)``. A contraction maps the
data and kernel axes to the result's axis, whose cells (``Out``) list the products summed into each
result row: ``step.reads(dim, data, kernel)``. Post steps map the result axis like data steps do.

A cell remembers what it is (an entry of the operand, an inserted zero, padding) and where it came from,
so a picture can draw the padded, zero-inserted grid with the kernel's footprint, and a test can compare
the products with the Jacobian. No torch, no matplotlib: this runs only when something is explained.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

__all__ = [
    "Axis",
    "Cell",
    "Family",
    "Out",
    "contract",
    "conv_rows",
    "each",
    "operand",
    "pad_axis",
    "renumber",
    "row_or_pad",
    "select",
    "union_axis",
]


class Cell(NamedTuple):
    """One row of a data or kernel tensor along one dim.

    ``kind``: ``"row"`` (an entry of the operand; ``source`` is its index there), ``"zero"`` (an inserted
    zero), ``"pad"`` (padding); a dropped cell becomes ``"cropped"`` (a negative pad removed it) or
    ``"skipped"`` (a subsample or tap selection left it out), keeping its source. ``key`` places the cell
    on a canvas: cells of one tensor seen at different steps (or by different phases) share a key when
    they are the same row.
    """

    kind: str
    key: int
    source: int = -1


class Out(NamedTuple):
    """One row of a contraction's result along one dim.

    ``links``: the (data cell, kernel cell) products summed into it; ``view``: the data and kernel axes
    the contraction read (for the picture); ``phase``: the polyphase phase rho that computes it, or -1.
    ``kind`` is ``"out"``, or ``"cropped"`` once a crop drops the row.
    """

    kind: str
    key: int
    links: tuple[tuple[Cell, Cell], ...] = ()
    view: tuple[Axis, Axis] | None = None
    phase: int = -1


@dataclass(frozen=True)
class Axis:
    """The rows of a tensor along one dim (``cells``), and the rows a crop or selection dropped (``dropped``)."""

    cells: tuple[Cell | Out, ...]
    dropped: tuple[Cell | Out, ...] = ()


@dataclass(frozen=True)
class Family:
    """Axes that a step split one tensor into: tap windows, phases or dilation blocks.

    ``summed``: the contraction adds the members' products into one result (blocks folded into the
    channels it contracts); otherwise every member gets its own result (taps, phases), which a later
    step puts back in place.
    """

    members: tuple[Geometry, ...]
    summed: bool


Geometry = Axis | Family


def operand(size: int) -> Axis:
    """The rows of a tensor as it enters a plan: row j has key j."""
    return Axis(tuple(Cell("row", j, j) for j in range(size)))


def each(fn: Callable[[Axis], Geometry], geometry: Geometry) -> Geometry:
    """Apply fn to an axis, or to every member of a family."""
    if isinstance(geometry, Family):
        return Family(tuple(each(fn, m) for m in geometry.members), geometry.summed)
    return fn(geometry)


def _drop(cells: Sequence[Cell | Out], why: str) -> tuple[Cell | Out, ...]:
    return tuple(c._replace(kind=why) for c in cells)


def pad_axis(axis: Axis, lo: int, hi: int) -> Axis:
    """Pad (lo, hi) cells of padding; a negative amount crops, keeping the cropped cells as dropped."""
    cells, dropped = list(axis.cells), list(axis.dropped)
    if lo < 0:
        dropped += _drop(cells[:-lo], "cropped")
        cells = cells[-lo:]
    if hi < 0:
        dropped += _drop(cells[len(cells) + hi:], "cropped")
        cells = cells[:len(cells) + hi]
    first = cells[0].key if cells else 0
    last = cells[-1].key if cells else -1
    before = [Cell("pad", first - q) for q in range(max(lo, 0), 0, -1)]
    after = [Cell("pad", last + q) for q in range(1, max(hi, 0) + 1)]
    return Axis((*before, *cells, *after), tuple(dropped))


def row_or_pad(axis: Axis, j: int) -> Cell | Out:
    """Cell j of the axis, or the padding cell a conv would read there when j lies outside it."""
    if 0 <= j < len(axis.cells):
        return axis.cells[j]
    if j < 0:
        return Cell("pad", axis.cells[0].key + j)
    return Cell("pad", axis.cells[-1].key + j - len(axis.cells) + 1)


def plain(geometry: Geometry, step: object) -> Axis:
    """The geometry as one axis, for a step that splits one (it cannot split a split one again)."""
    if not isinstance(geometry, Axis):
        raise TypeError(f"{type(step).__name__}.rows: expects the rows of one tensor, not a {type(geometry).__name__}")
    return geometry


def select(axis: Axis, indices: Sequence[int], why: str = "skipped") -> Axis:
    """The cells at these indices (keys kept); the others are dropped as ``why``."""
    keep = set(indices)
    rest = [c for j, c in enumerate(axis.cells) if j not in keep]
    return Axis(tuple(axis.cells[j] for j in indices), (*axis.dropped, *_drop(rest, why)))


def renumber(axis: Axis, cells: Sequence[Cell | Out] | None = None) -> Axis:
    """These cells (default: the axis' own) with keys 0, 1, ...: a new tensor whose rows are its positions."""
    return Axis(tuple(c._replace(key=j) for j, c in enumerate(axis.cells if cells is None else cells)))


def union_axis(axes: Sequence[Axis]) -> Axis:
    """One axis holding every cell of these (by key, first seen wins); dropped cells not held by any."""
    cells: dict[int, Cell | Out] = {}
    for a in axes:
        for c in a.cells:
            cells.setdefault(c.key, c)
    dropped: dict[int, Cell | Out] = {}
    for a in axes:
        for c in a.dropped:
            if c.key not in cells:
                dropped.setdefault(c.key, c)
    return Axis(tuple(cells[k] for k in sorted(cells)), tuple(dropped[k] for k in sorted(dropped)))


def _merge(parts: Sequence[Axis]) -> Axis:
    """Results of a summed family: row u sums the products of row u of every part."""
    rows = []
    for outs in zip(*(p.cells for p in parts), strict=True):
        links = tuple(link for o in outs for link in o.links)  # type: ignore[union-attr]
        views = [o.view for o in outs if o.view is not None]  # type: ignore[union-attr]
        view = (union_axis([v[0] for v in views]), union_axis([v[1] for v in views])) if views else None
        rows.append(outs[0]._replace(links=links, view=view))
    return Axis(tuple(rows))


def contract(fn: Callable[[Axis, Axis], Axis], data: Geometry, kernel: Geometry) -> Geometry:
    """Apply a contraction's 1-d rule to plain axes, through families: summed ones add, others map."""
    if isinstance(data, Family) and isinstance(kernel, Family) and data.summed and kernel.summed:
        return _merge([contract(fn, d, k) for d, k in zip(data.members, kernel.members, strict=True)])  # type: ignore[misc]
    if isinstance(data, Family):
        return Family(tuple(contract(fn, d, kernel) for d in data.members), False)
    if isinstance(kernel, Family):
        return Family(tuple(contract(fn, data, k) for k in kernel.members), False)
    return fn(data, kernel)


def conv_rows(data: Axis, kernel: Axis, stride: int, padding: int, dilation: int, rows: int) -> Axis:
    """A forward conv along one dim: result row u sums data[u*s + t*d] * kernel[t] over the kernel's taps."""
    padded = pad_axis(data, padding, padding)
    cells = padded.cells
    return Axis(tuple(Out("out", u, tuple((cells[u * stride + t * dilation], k) for t, k in enumerate(kernel.cells)),
                          (padded, kernel)) for u in range(rows)))
