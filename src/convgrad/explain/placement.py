"""Where explain's frames go: the frames chosen and the panels and text lines placed.

Plain decisions for explain/render.py, which draws them: which frames fit a budget (the first channel of
each group, a corner of the result, and for large layers a corner of the data and kernel) and where each
panel's cells go in pixels (figures 800 px wide at 100 dpi, cells 20 to 36 px). The numbers, legend and
caption are explain/legend.py's; their line counts size the figure here.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from convgrad.backends.fwdconv.geometry import Cell
from convgrad.explain.canvas import (
    LEGEND_LINE_PX,
    MARGIN,
    MAX_CELL_PX,
    MIN_CELL_PX,
    WIDTH_PX,
    Layout,
    Panel,
    channel_name,
)
from convgrad.explain.frames import Frame, Index, Scene
from convgrad.explain.legend import caption, legend_rows

__all__ = ["Window", "channel_strip", "frames_needed", "layout", "result_index", "select", "shown_channels"]


def result_index(scene: Scene, frame: Frame) -> Index:
    lead = () if scene.gradient == "grad_weight" else (0,)
    return (*lead, *frame.channel, *frame.cell)


@dataclass(frozen=True)
class Window:
    """Which part of a scene is drawn: the first ``corner`` result rows per dim (None: all) and, where even one
    cell's footprint would not fit, the first ``clip`` rows per dim of the data and the kernel (None: all)."""

    corner: int | None = None
    clip: int | None = None


def _window(scene: Scene, window: Window) -> tuple[list[list[Cell]], list[list[Cell]], list[list]]:
    """The canvases to draw, per dim: every cell, or the top-left corner the window keeps."""
    data, kernel = (list(map(list, c)) for c in scene.canvases)
    result = [sorted((*a.cells, *a.dropped), key=lambda c: c.key) for a in scene.axes]
    if window.corner is not None:
        for j, axis in enumerate(scene.axes):
            rows = axis.cells[:window.corner]
            hi = max((d.key for o in rows for d, _ in o.links), default=data[j][-1].key)  # type: ignore[union-attr]
            data[j] = [c for c in data[j] if c.key <= hi]
            result[j] = [c for c in result[j] if c.key <= rows[-1].key]
    if window.clip is not None:
        data = [d[:window.clip] for d in data]
        kernel = [k[:window.clip] for k in kernel]
    return data, kernel, result


def shown_channels(scene: Scene) -> list[Index]:
    """The result channels the frames show: the first of each group, at most 4 groups."""
    return list({scene.group_of(c): c for c in reversed(scene.result_channels())}.values())[::-1][:4]


def frames_needed(scene: Scene) -> int:
    """How many frames show every cell of the shown channels."""
    return len(shown_channels(scene)) * math.prod(len(a.cells) for a in scene.axes)


def select(scene: Scene, budget: int) -> tuple[list[Frame], str, Window]:
    """The frames to draw within ``budget``, a note saying what was left out, and the window drawn.

    Channels: the first of each group (at most 4 groups); cells: all, or a corner of the result when the
    cells of those channels exceed the budget or the grids would not fit 800 px at 20 px a cell; when not
    even one cell's grids fit (a large grad_weight), a corner of the data and the kernel as well.
    """
    spec, channels = scene.spec, scene.result_channels()
    firsts = shown_channels(scene)
    notes = []
    if len(channels) > len(firsts):
        names = ", ".join(map(channel_name, firsts))
        notes.append(f"result channel{'s' if len(firsts) > 1 else ''} {names} of {len(channels)}"
                     + (" (the first of each group)" if spec.groups > 1 else " (the others are alike)"))
    sizes = [len(a.cells) for a in scene.axes]
    per_channel = max(1, budget // len(firsts))
    corners = [c for c in range(max(sizes), 0, -1) if math.prod(min(c, n) for n in sizes) <= per_channel]
    window = next((Window(None if c >= max(sizes) else c) for c in corners
                   if _fits(scene, Window(None if c >= max(sizes) else c))), None)
    if window is None:
        corner = corners[0]
        window = Window(None if corner >= max(sizes) else corner)
        window = next((Window(window.corner, clip) for clip in range(30, 2, -1)
                       if _fits(scene, Window(window.corner, clip))), Window(window.corner, 3))
        notes.append(f"the first {window.clip} rows per dim of {scene.data} and {scene.kernel} (the footprints go "
                     f"on past them)")
    shown = [min(window.corner or n, n) for n in sizes]
    if window.corner is not None:
        notes.append(f"the top-left corner of the result, {'x'.join(map(str, shown))} of "
                     f"{'x'.join(map(str, sizes))} cells (the pattern repeats)")
    frames = [scene.frame(c, u) for c in firsts for u in itertools.product(*(range(n) for n in shown))]
    return frames, "; ".join(notes), window


def _panels(scene: Scene, window: Window) -> tuple[Panel, Panel, Panel]:
    data, kernel, result = _window(scene, window)
    flipped = " (flipped)" if scene.flips else ""
    return Panel(scene.data, data), Panel(f"{scene.kernel}{flipped}", kernel), Panel(scene.result, result)


def _fits(scene: Scene, window: Window) -> bool:
    return _cell_px(list(_panels(scene, window)), scene.spec.n) >= MIN_CELL_PX


def _cell_px(panels: list[Panel], n: int) -> float:
    widths = [p.cells_wide() for p in panels]
    wide = sum(widths) + 1.4 * (len(panels) - 1) if n == 2 else max(widths)
    return min(MAX_CELL_PX, math.floor((WIDTH_PX - 2 * MARGIN) / wide))


def layout(scene: Scene, budget: int) -> Layout:
    """Choose the frames (bounded by ``budget``) and place the panels and text lines of a scene."""
    frames, note, window = select(scene, budget)
    panels = list(_panels(scene, window))
    cell = _cell_px(panels, scene.spec.n)
    lay = Layout(scene, frames, *panels, note=note, cell=cell)
    y = MARGIN
    lay.rows["title"] = y
    y += 2 * 17 + 4  # two title lines
    title_h = 16 + (12 if scene.spec.n == 3 else 0)  # panel title, and the depth labels of 3d slices
    for p in panels:
        p.cell = cell
    if scene.spec.n == 2:
        x = (WIDTH_PX - (sum(p.cells_wide() for p in panels) + 2.8) * cell) / 2
        for p in panels:
            p.x, p.y = x, y + title_h
            x += (p.cells_wide() + 1.4) * cell
        y += title_h + max(p.cells_high() for p in panels) * cell + 10
    else:
        for p in panels:
            p.x, p.y = MARGIN, y + title_h
            y += title_h + p.cells_high() * cell + 8
    if channel_strip(scene):
        lay.rows["channels"] = y
        y += 46
    lay.rows["phase"] = y
    y += 16
    lay.rows["sum"] = y
    y += 16
    lay.rows["caption"] = y
    y += LEGEND_LINE_PX * len(caption(lay)) + 6
    lay.rows["legend"] = y
    y += LEGEND_LINE_PX * len(legend_rows(lay)) + MARGIN
    lay.height = y
    return lay


def channel_strip(scene: Scene) -> bool:
    s = scene.spec
    return s.x_channels > 1 or s.y_channels > 1
