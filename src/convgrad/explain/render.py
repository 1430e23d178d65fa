"""Drawing explain's frames with matplotlib (Agg): the one renderer of Recipe.plot, Recipe.animate and to_html.

Everything drawn comes from a Scene and its Frames (explain/frames.py), which are read from the plan's own
steps, placed by explain/placement.py on explain/canvas.py's sizes and colours, with explain/legend.py's
numbers, legend and caption. A frame is drawn as three panels: the data grid (padding, inserted zeros, cropped
and never-read cells) with the kernel's footprint on it, each read cell lettered with the kernel tap it meets;
the kernel (flipped where the plan flips it; the taps a phase does not use greyed); and the result with the cell
being produced. Channels, when there are several, are a strip of boxes coloured by group.

Sizes are pixels: figures are 800 px wide at 100 dpi, text is at least 9 px tall and cells at least 20 px
(tests/test_explain_render.py measures them). Colours are tints of Okabe and Ito's colour-blind-safe
palette; hatching tells cropped, never-reached cells and zero taps apart without colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from convgrad.explain.canvas import (
    CURRENT,
    DPI,
    FILLS,
    FONT,
    FOOTPRINT,
    GROUP_COLOURS,
    HATCHES,
    LEGEND,
    LEGEND_CHAR_PX,
    LEGEND_LINE_PX,
    MARGIN,
    OKABE_ITO,
    PHASES,
    SMALL,
    WIDTH_PX,
    Layout,
    Panel,
    cell_kind,
)
from convgrad.explain.frames import Frame
from convgrad.explain.legend import (
    caption,
    data_steps,
    kernel_cells,
    legend_rows,
    never_read,
    number,
    phase_number,
    reached,
    result_cells,
    tap_letters,
    title,
    values,
)
from convgrad.explain.placement import frames_needed, layout, result_index

__all__ = ["DPI", "FILLS", "GROUP_COLOURS", "OKABE_ITO", "PHASES", "WIDTH_PX", "Layout", "background", "caption",
           "draw", "figure", "frame_artists", "frames_needed", "layout", "legend_rows", "result_value", "values"]


# ---- drawing ------------------------------------------------------------------------------------------------------

def _rect(ax: Axes, x: float, y: float, w: float, h: float, **kw: Any) -> Rectangle:
    # add_artist, not add_patch: ``background`` fixes the axes' limits, so add_patch's data-limit update per cell
    # (a fifth of a picture's drawing time) changes nothing drawn
    rect = Rectangle((x, y), w, h, **kw)
    ax.add_artist(rect)
    return rect


LINE_CHARS = 108  # characters of FONT text in the 772 px between the margins (about 6.7 px each; wider ran off)


def _fit(line: str) -> str:
    """A one-line text of FONT size, cut with an ellipsis where it would run past the figure's right edge."""
    return line if len(line) <= LINE_CHARS else line[:LINE_CHARS - 1] + "…"


def _text(ax: Axes, x: float, y: float, s: str, size: float = FONT, **kw: Any) -> Any:
    return ax.text(x, y, s, fontsize=size, **kw)


def _cell(ax: Axes, panel: Panel, pos: Sequence[int], kind: str, text: str = "", fill: str | None = None,
          corner: str = "") -> list:
    """A cell with its number: centred, or (small cells, where a letter shares it) in the ``corner`` given."""
    x, y = panel.at(pos)
    c = panel.cell
    edge = "#BBBBBB" if fill is None and kind == "out" else "white"
    out = [_rect(ax, x, y, c, c, facecolor=fill or FILLS[kind], edgecolor=edge, linewidth=1.2)]
    if kind in HATCHES:
        out.append(_rect(ax, x, y, c, c, fill=False, hatch=HATCHES[kind], edgecolor="#777777", linewidth=0))
    colour = "#222222" if kind not in ("skipped",) else "#999999"
    if text and (c >= 30 or not corner):
        out.append(_text(ax, x + c / 2, y + c / 2, text, FONT if c >= 28 else SMALL, ha="center", va="center",
                         color=colour))
    elif text and corner == "top-left":
        out.append(_text(ax, x + 2, y + 1, text, SMALL, ha="left", va="top", color=colour))
    elif text:
        out.append(_text(ax, x + c - 2, y + c - 1, text, SMALL, ha="right", va="bottom", color=colour))
    return out


def background(fig: Figure, lay: Layout, t: dict[str, Any], top: float = 0.0) -> Axes:
    """The parts of a scene that stay through its frames: titles, the data grid, the legend."""
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, WIDTH_PX)
    height = fig.get_size_inches()[1] * DPI
    ax.set_ylim(height - top, -top)
    ax.set_axis_off()
    ax.patch.set_visible(False)  # blocks stacked in one figure each have an axes over the whole of it
    sc = lay.scene
    _text(ax, MARGIN, lay.rows["title"], title(sc), 11, va="top", weight="bold")
    _text(ax, MARGIN, lay.rows["title"] + 19, _fit(data_steps(sc)), FONT, va="top", color="#333333")
    data_channel = lay.frames[0].channels[0][0]
    never = never_read(lay)
    for panel in (lay.data, lay.kernel, lay.result):
        _text(ax, panel.x, panel.y - 4 - (12 if sc.spec.n == 3 else 0), panel.title, FONT, va="bottom")
        if sc.spec.n == 3:
            for z in range(len(panel.dims[0])):
                x, _ = panel.at((z, 0, 0))
                _text(ax, x, panel.y - 3, f"depth {z}", SMALL, va="bottom", color="#555555")
    for pos, cells in lay.data.every():
        kind = cell_kind(cells)
        text = number(t[sc.data][(0, data_channel, *(c.source for c in cells))]) if kind == "row" else ""
        _cell(ax, lay.data, pos, kind, text, corner="top-left")
        if pos in never:
            x, y = lay.data.at(pos)
            _rect(ax, x, y, lay.cell, lay.cell, fill=False, hatch="..", edgecolor="#555555", linewidth=0)
    for pos, cells, cell in result_cells(lay):
        kind = "cropped" if cell is None else "out" if reached(sc, cell) else "unreached"
        _cell(ax, lay.result, pos, kind)
        _phase_bar(ax, lay, pos, cells)
    if "channels" in lay.rows:
        y = lay.rows["channels"]
        _text(ax, MARGIN, y, f"channels of {sc.data} (colour: group; outlined: summed)", LEGEND, va="top")
        _text(ax, WIDTH_PX / 2, y, f"channels of {sc.result} (outlined: this one)", LEGEND, va="top")
    _draw_legend(ax, lay)
    for n, line in enumerate(caption(lay)):
        _text(ax, MARGIN, lay.rows["caption"] + LEGEND_LINE_PX * n, line, LEGEND, va="top", color="#333333")
    return ax


def _draw_legend(ax: Axes, lay: Layout) -> None:
    y = lay.rows["legend"]
    for row in legend_rows(lay):
        x = MARGIN
        for fill, hatch, label in row:
            if fill == "none":
                _rect(ax, x, y, 18, 12, fill=False, edgecolor=FOOTPRINT, linewidth=2.2)
            else:
                _rect(ax, x, y, 18, 12, facecolor=fill, edgecolor="#888888", linewidth=0.6, hatch=hatch or None)
            _text(ax, x + 24, y + 6, label, LEGEND, va="center")
            x += 24 + LEGEND_CHAR_PX * len(label) + 14
        y += LEGEND_LINE_PX








def frame_artists(ax: Axes, lay: Layout, frame: Frame, t: dict[str, Any]) -> list:
    """The parts of one frame that go with it: the footprint, the kernel, the current cell, the phase and the sum."""
    sc, out = lay.scene, []
    letters = tap_letters(sc)
    kernel_channel = frame.channels[0][1]
    kernel_lead = () if sc.kernel == "weight" else (0,)
    used = {tuple(c.key for c in k) for d, k in frame.links}
    for cells in kernel_cells(lay, frame):  # the kernel this cell's contraction reads
        pos = lay.kernel.positions(cells)
        if pos is None:
            continue
        kind = cell_kind(cells, kernel=True)
        if kind == "tap" and tuple(c.key for c in cells) not in used:
            kind = "skipped"
        value = t[sc.kernel][(*kernel_lead, *kernel_channel, *(c.source for c in cells))] if kind == "tap" else None
        label = letters.get(tuple(c.source for c in cells), "") if kind in ("tap", "skipped") else ""
        out += _cell(ax, lay.kernel, pos, kind, "" if value is None else number(value), corner="bottom-right")
        if label:
            x, y = lay.kernel.at(pos)
            out.append(_text(ax, x + 2, y + 1, label, SMALL, va="top", color="#7A4A00"))
    for d, k in frame.links:  # the footprint on the data, lettered with the taps
        pos = lay.data.positions(d)
        if pos is None:
            continue
        x, y = lay.data.at(pos)
        real = all(c.kind == "row" for c in k)
        out.append(_rect(ax, x + 1.5, y + 1.5, lay.cell - 3, lay.cell - 3, fill=False, edgecolor=FOOTPRINT,
                         linewidth=2.4 if real else 1.2, linestyle="-" if real else ":"))
        if real and letters:
            out.append(_text(ax, x + lay.cell - 3, y + lay.cell - 2, letters[tuple(c.source for c in k)], SMALL,
                             ha="right", va="bottom", color=FOOTPRINT, weight="bold"))
    out += _current(ax, lay, frame)
    out += _frame_text(ax, lay, frame, t)
    if "channels" in lay.rows:
        out += _channels(ax, lay, frame)
    return out


def result_value(ax: Axes, lay: Layout, frame: Frame, t: dict[str, Any]) -> list:
    """The produced cell's value (and, without phases, its 'produced' fill): parts that stay for later frames."""
    sc = lay.scene
    lead = () if sc.gradient == "grad_weight" else (0,)
    for pos, cells, cell in result_cells(lay):
        if cell == frame.cell:
            kind = "out" if reached(sc, cell) else "unreached"
            fill = FILLS["done"] if kind == "out" else None
            value = number(t[sc.result][(*lead, *frame.channel, *cell)])
            return [*_cell(ax, lay.result, pos, kind, value, fill), *_phase_bar(ax, lay, pos, cells)]
    return []


def _phase_bar(ax: Axes, lay: Layout, pos: Sequence[int], cells: Sequence[Any]) -> list:
    """A bar in the colour of the cell's phase along the top of a result cell."""
    phase = [c.phase for c in cells]
    if any(p < 0 for p in phase) or any(c.kind == "cropped" for c in cells):
        return []
    x, y = lay.result.at(pos)
    colour = PHASES[phase_number(phase, lay.scene.spec.stride) % len(PHASES)]
    return [_rect(ax, x + 1, y + 1, lay.cell - 2, max(4.0, lay.cell / 6), facecolor=colour, linewidth=0)]


def _current(ax: Axes, lay: Layout, frame: Frame) -> list:
    for pos, _, cell in result_cells(lay):
        if cell == frame.cell:
            x, y = lay.result.at(pos)
            return [_rect(ax, x + 1, y + 1, lay.cell - 2, lay.cell - 2, fill=False, edgecolor=CURRENT, linewidth=3)]
    return []




def _frame_text(ax: Axes, lay: Layout, frame: Frame, t: dict[str, Any]) -> list:
    sc = lay.scene
    letters = tap_letters(sc)
    index = result_index(sc, frame)
    name = f"{sc.result}[{', '.join(map(str, index))}]"
    out = []
    if frame.phase is not None:
        rows = ", ".join(f"{r}::{s}" for r, s in zip(frame.phase, sc.spec.stride, strict=True))
        taps = sorted({letters.get(tuple(c.source for c in k), "") for d, k in frame.links
                       if all(c.kind == "row" for c in k)} - {""})
        out.append(_text(ax, MARGIN, lay.rows["phase"], f"phase rho = {frame.phase}: the rows {rows} of {sc.result}, "
                         f"from the taps {', '.join(taps) or '(none)'} of the {sc.kernel}", FONT, va="top",
                         color="#333333"))
    data_channel = frame.channels[0][0]
    terms = []
    for d, k in frame.links:
        if all(c.kind == "row" for c in d) and all(c.kind == "row" for c in k):
            v = t[sc.data][(0, data_channel, *(c.source for c in d))]
            terms.append(f"{number(v)}·{letters.get(tuple(c.source for c in k), '')}")
    value = number(t[sc.result][index])
    if not frame.reached:
        line = f"{name} = 0: no tap of the {sc.kernel} reaches this cell"
    else:
        body = " + ".join(terms) if len(terms) <= 12 and letters else f"the sum of {len(terms)} products"
        more = f" + the same over {len(frame.channels) - 1} more channel(s)" if len(frame.channels) > 1 else ""
        idle = sum(1 for d, k in frame.links if not (Frame.real(d) and Frame.real(k)))
        rest = ("   (1 more product meets padding or zeros)" if idle == 1 else
                f"   ({idle} more products meet padding or zeros)" if idle else "")
        line = f"{name} = {body}{more} = {value}"
        line += rest if len(line + rest) <= LINE_CHARS else ""  # the sum itself stays whole where it can
    out.append(_text(ax, MARGIN, lay.rows["sum"], _fit(line), FONT, va="top"))
    return out


def _channels(ax: Axes, lay: Layout, frame: Frame) -> list:
    """Data channels and result channels as boxes coloured by group; the ones this frame sums, outlined."""
    sc, out, y = lay.scene, [], lay.rows["channels"]
    s = sc.spec
    data_c, data_g = ((s.y_channels, s.y_group_channels) if sc.direction == "x"
                      else (s.x_channels, s.x_group_channels))
    groups_of_result = [sc.group_of(c) for c in sc.result_channels()]
    feeding = {c for c, _ in frame.channels}
    x, box = MARGIN, 20
    for c in range(min(data_c, 16)):
        bx = x + c * (box + 2)
        out.append(_rect(ax, bx, y + 16, box, box, facecolor=GROUP_COLOURS[c // data_g % len(GROUP_COLOURS)],
                         edgecolor=FOOTPRINT if c in feeding else "white", linewidth=2.5 if c in feeding else 1))
    current = sc.result_channels().index(frame.channel)
    for c, g in enumerate(groups_of_result[:16]):
        bx = WIDTH_PX / 2 + c * (box + 2)
        out.append(_rect(ax, bx, y + 16, box, box, facecolor=GROUP_COLOURS[g % len(GROUP_COLOURS)],
                         edgecolor=CURRENT if c == current else "white", linewidth=2.5 if c == current else 1))
    return out


def figure(height: float) -> Figure:
    """An empty figure 800 px wide and ``height`` px tall (Agg canvas)."""
    return Figure(figsize=(WIDTH_PX / DPI, height / DPI), dpi=DPI)


def draw(lay: Layout, frame: Frame, t: dict[str, Any], done: Sequence[Frame] = (), height: float | None = None,
         fig: Figure | None = None, top: float = 0.0) -> Figure:
    """One whole frame as a figure (or into ``fig``, ``top`` px down), after the ``done`` frames produced theirs."""
    fig = fig or figure(height or lay.height)
    ax = background(fig, lay, t, top)
    for f in (*done, frame):
        result_value(ax, lay, f, t)
    frame_artists(ax, lay, frame, t)
    return fig
