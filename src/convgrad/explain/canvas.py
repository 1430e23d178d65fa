"""The canvas every explain picture shares: its sizes, colours and legend labels, and the placed panels (``Panel``,
``Layout``) that explain/placement.py builds, explain/legend.py describes and explain/render.py draws.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convgrad.backends.fwdconv.geometry import Cell
from convgrad.explain.frames import Frame, Index, Scene

__all__ = ["CAPTION_CHARS", "CURRENT", "DPI", "FILLS", "FONT", "FOOTPRINT", "GROUP_COLOURS", "HATCHES", "LABELS",
           "LEGEND", "LEGEND_CHAR_PX", "LEGEND_LINE_PX", "MARGIN", "MAX_CELL_PX", "MIN_CELL_PX", "OKABE_ITO", "PHASES",
           "SMALL", "WIDTH_PX", "Layout", "Panel", "cell_kind", "channel_name", "letter"]

WIDTH_PX, DPI = 800, 100
MIN_CELL_PX, MAX_CELL_PX = 20, 36
MARGIN = 14  # px
FONT, SMALL = 9, 7  # points: 12.5 px and 9.7 px at 100 dpi
# The legend, caption and channel labels: 11.8 px, still 10.8 px where the docs site shows the 800 px figure
# 733 px wide (its content column at a 1280 px window; tests/test_docs_layout.py measures it).
LEGEND = 8.5
LEGEND_CHAR_PX, CAPTION_CHARS, LEGEND_LINE_PX = 7.0, 104, 17

OKABE_ITO = {"orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442", "blue": "#0072B2",
             "vermillion": "#D55E00", "purple": "#CC79A7", "black": "#000000"}


def _tint(colour: str, amount: float) -> str:
    """The colour mixed with white: amount 1 is the colour itself."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - v) * amount):02X}" for v in rgb)


FILLS = {  # cell kind -> fill
    "row": _tint(OKABE_ITO["sky"], 0.35), "zero": _tint(OKABE_ITO["yellow"], 0.55), "pad": "#DDDDDD",
    "cropped": _tint(OKABE_ITO["vermillion"], 0.3), "skipped": "#F4F4F4", "tap": _tint(OKABE_ITO["orange"], 0.4),
    "zero_tap": _tint(OKABE_ITO["orange"], 0.12), "out": "#FFFFFF", "unreached": _tint(OKABE_ITO["purple"], 0.35),
    "done": _tint(OKABE_ITO["green"], 0.35)}
PHASES = [OKABE_ITO[c] for c in ("blue", "vermillion", "purple", "green", "orange", "sky", "yellow", "black")]
GROUP_COLOURS = [OKABE_ITO[c] for c in ("orange", "sky", "green", "blue", "vermillion", "purple", "yellow")]
HATCHES = {"cropped": "///", "unreached": "xx", "zero_tap": ".."}
LABELS = {
    "row": "{data} entry", "zero": "inserted zero", "pad": "padding", "cropped": "cropped (a negative pad)",
    "skipped": "not read by this step", "tap": "{kernel} tap", "zero_tap": "zero tap (another phase's slot)",
    "unreached": "no tap reaches it: always 0", "done": "{result}, produced", "never": "{data} entry no window reads"}
FOOTPRINT, CURRENT = OKABE_ITO["blue"], OKABE_ITO["black"]


def cell_kind(cells: Sequence[Cell], kernel: bool = False) -> str:
    """One N-d cell's kind from its per-dim cells: a dropped dim wins, then padding, then zeros."""
    kinds = {c.kind for c in cells}
    for kind in ("cropped", "skipped", "pad", "zero"):
        if kind in kinds:
            return {"zero": "zero_tap"}.get(kind, kind) if kernel else kind
    return "tap" if kernel else "row"


def letter(index: int) -> str:
    return chr(ord("a") + index) if index < 26 else str(index)


def channel_name(channel: Index) -> str:
    """A result channel as the pictures write it: ``3`` for one index, ``(1, 2)`` for several."""
    return str(channel[0]) if len(channel) == 1 else "(" + ", ".join(map(str, channel)) + ")"


@dataclass
class Panel:
    """One grid of a frame: its canvas cells per dim and where they go, in pixels."""

    title: str
    dims: list[list[Any]]  # canvas cells (Cell or Out) per dim, in key order
    cell: float = 0.0
    x: float = 0.0
    y: float = 0.0
    where: list[dict[int, int]] = field(default_factory=list)  # per dim: key -> position

    def __post_init__(self) -> None:
        self.where = [{c.key: j for j, c in enumerate(d)} for d in self.dims]

    def cells_wide(self) -> float:
        n = len(self.dims)
        if n == 3:
            return len(self.dims[0]) * (len(self.dims[2]) + 0.6) - 0.6
        return len(self.dims[-1])

    def cells_high(self) -> int:
        return 1 if len(self.dims) == 1 else len(self.dims[-2])

    def at(self, position: Sequence[int]) -> tuple[float, float]:
        """Top-left pixel of the cell at these canvas positions (one per dim)."""
        n, c = len(position), self.cell
        if n == 1:
            return self.x + position[0] * c, self.y
        if n == 2:
            return self.x + position[1] * c, self.y + position[0] * c
        return self.x + (position[0] * (len(self.dims[2]) + 0.6) + position[2]) * c, self.y + position[1] * c

    def positions(self, cells: Sequence[Any]) -> tuple[int, ...] | None:
        """Canvas positions of per-dim cells (by key), or None when one lies outside the drawn window."""
        out = []
        for d, c in zip(self.where, cells, strict=True):
            if c.key not in d:
                return None
            out.append(d[c.key])
        return tuple(out)

    def every(self) -> list[tuple[tuple[int, ...], tuple[Any, ...]]]:
        """(positions, per-dim cells) of every canvas cell."""
        return [(tuple(p for p, _ in combo), tuple(c for _, c in combo))
                for combo in itertools.product(*(list(enumerate(d)) for d in self.dims))]


@dataclass
class Layout:
    """Where everything of a scene's frames goes: the panels, the text lines, the figure height."""

    scene: Scene
    frames: list[Frame]
    data: Panel
    kernel: Panel
    result: Panel
    note: str
    cell: float
    height: float = 0.0
    rows: dict[str, float] = field(default_factory=dict)  # text line name -> y in px
