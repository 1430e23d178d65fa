"""Drawing explain's frames with matplotlib (Agg): the one renderer of Recipe.plot, Recipe.animate and to_html.

Everything drawn comes from a Scene and its Frames (explain/frames.py), which are read from the plan's own
steps. A frame is drawn as three panels: the data grid (padding, inserted zeros, cropped and never-read
cells) with the kernel's footprint on it, each read cell lettered with the kernel tap it meets; the
kernel (flipped where the plan flips it; the taps a phase does not use greyed); and the result with the
cell being produced. Channels, when there are several, are a strip of boxes coloured by group.

Sizes are pixels: figures are 800 px wide at 100 dpi, text is at least 9 px tall and cells at least 20 px
(tests/test_explain_render.py measures them). Colours are tints of Okabe and Ito's colour-blind-safe
palette; hatching tells cropped and never-reached cells apart without colour.
"""

from __future__ import annotations

import itertools
import math
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from convgrad.backends.fwdconv_geometry import Cell
from convgrad.backends.fwdconv_steps import Spatially
from convgrad.explain.frames import Frame, Index, Scene
from convgrad.explain.symbols import SYMBOLS

__all__ = ["DPI", "FILLS", "MIN_CELL_PX", "OKABE_ITO", "WIDTH_PX", "Layout", "draw", "layout", "values"]

WIDTH_PX, DPI = 800, 100
MIN_CELL_PX, MAX_CELL_PX = 20, 36
MARGIN = 14  # px
FONT, SMALL = 9, 7  # points: 12.5 px and 9.7 px at 100 dpi

OKABE_ITO = {"orange": "#E69F00", "sky": "#56B4E9", "green": "#009E73", "yellow": "#F0E442", "blue": "#0072B2",
             "vermillion": "#D55E00", "purple": "#CC79A7", "black": "#000000"}


def _tint(colour: str, amount: float) -> str:
    """The colour mixed with white: amount 1 is the colour itself."""
    rgb = [int(colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(255 - (255 - v) * amount):02X}" for v in rgb)


FILLS = {  # cell kind -> fill
    "row": _tint(OKABE_ITO["sky"], 0.35), "zero": _tint(OKABE_ITO["yellow"], 0.55), "pad": "#DDDDDD",
    "cropped": _tint(OKABE_ITO["vermillion"], 0.3), "skipped": "#F4F4F4", "tap": _tint(OKABE_ITO["orange"], 0.4),
    "zero_tap": _tint(OKABE_ITO["yellow"], 0.55), "out": "#FFFFFF", "unreached": _tint(OKABE_ITO["purple"], 0.35),
    "done": _tint(OKABE_ITO["green"], 0.35)}
PHASES = [OKABE_ITO[c] for c in ("blue", "vermillion", "purple", "green", "orange", "sky", "yellow", "black")]
GROUP_COLOURS = [OKABE_ITO[c] for c in ("orange", "sky", "green", "blue", "vermillion", "purple", "yellow")]
HATCHES = {"cropped": "///", "unreached": "xx"}
LABELS = {
    "row": "{data} entry", "zero": "inserted zero", "pad": "padding", "cropped": "cropped (a negative pad)",
    "skipped": "not read by this step", "tap": "{kernel} tap", "zero_tap": "zero tap (another phase's slot)",
    "unreached": "no tap reaches it: always 0", "done": "{result}, produced", "never": "{data} entry no window reads"}
FOOTPRINT, CURRENT = OKABE_ITO["blue"], OKABE_ITO["black"]


def _kind(cells: Sequence[Cell], kernel: bool = False) -> str:
    """One N-d cell's kind from its per-dim cells: a dropped dim wins, then padding, then zeros."""
    kinds = {c.kind for c in cells}
    for kind in ("cropped", "skipped", "pad", "zero"):
        if kind in kinds:
            return {"zero": "zero_tap"}.get(kind, kind) if kernel else kind
    return "tap" if kernel else "row"


def _letter(index: int) -> str:
    return chr(ord("a") + index) if index < 26 else str(index)


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


def _result_index(scene: Scene, frame: Frame) -> Index:
    lead = () if scene.gradient == "grad_weight" else (0,)
    return (*lead, *frame.channel, *frame.cell)


def _window(scene: Scene, frames: list[Frame], full: bool) -> tuple[list[list[Cell]], list[list[Cell]], list[list]]:
    """The canvases to draw: every cell when all frames are shown, else the part the shown frames touch."""
    data, kernel = (list(map(list, c)) for c in scene.canvases)
    result = [sorted((*a.cells, *a.dropped), key=lambda c: c.key) for a in scene.axes]
    if full:
        return data, kernel, result
    for j in range(scene.spec.n):
        keys = {d[j].key for f in frames for d, _ in f.links}
        keys |= {c.key for f in frames if f.views[j] is not None for c in f.views[j][0].cells}  # type: ignore[index]
        lo, hi = min(keys), max(keys)
        data[j] = [c for c in data[j] if lo <= c.key <= hi]
        last = max(f.cell[j] for f in frames)
        result[j] = [c for c in scene.axes[j].cells if c.key <= scene.axes[j].cells[last].key]
    return data, kernel, result


def select(scene: Scene, budget: int) -> tuple[list[Frame], str, bool]:
    """The frames to draw within ``budget``, a note saying what was left out, and whether all cells are shown.

    Channels: the first of each group (at most 4 groups); cells: all, or a corner of the result when the
    cells of those channels exceed the budget or the grids would not fit 800 px at 20 px a cell.
    """
    spec, channels = scene.spec, scene.result_channels()
    firsts = list({scene.group_of(c): c for c in reversed(channels)}.values())[::-1][:4]
    notes = []
    if len(channels) > len(firsts):
        notes.append(f"result channels {', '.join(map(_c, firsts))} of {len(channels)} shown"
                     + (" (the first of each group)" if spec.groups > 1 else " (the others are alike)"))
    sizes = [len(a.cells) for a in scene.axes]
    per_channel = max(1, budget // len(firsts))
    corner = max(sizes)
    while corner > 1:
        cells = list(itertools.product(*(range(min(corner, n)) for n in sizes)))
        frames = [scene.frame(c, u) for c in firsts for u in cells]
        full = corner >= max(sizes)
        if len(cells) <= per_channel and _fits(scene, frames, full):
            break
        corner -= 1
    else:
        cells = [(0,) * spec.n]
        frames = [scene.frame(c, u) for c in firsts for u in cells]
        full = False
    if not full:
        notes.append(f"the top-left corner of the result, {'x'.join(str(min(corner, n)) for n in sizes)} of "
                     f"{'x'.join(map(str, sizes))} cells (the pattern repeats)")
    return frames, "; ".join(notes), full


def _c(channel: Index) -> str:
    return str(channel[0]) if len(channel) == 1 else "(" + ", ".join(map(str, channel)) + ")"


def _panels(scene: Scene, frames: list[Frame], full: bool) -> tuple[Panel, Panel, Panel]:
    data, kernel, result = _window(scene, frames, full)
    flipped = " (flipped)" if scene.flips else ""
    return Panel(scene.data, data), Panel(f"{scene.kernel}{flipped}", kernel), Panel(scene.result, result)


def _fits(scene: Scene, frames: list[Frame], full: bool) -> bool:
    return _cell_px(list(_panels(scene, frames, full)), scene.spec.n) >= MIN_CELL_PX


def _cell_px(panels: list[Panel], n: int) -> float:
    widths = [p.cells_wide() for p in panels]
    wide = sum(widths) + 1.4 * (len(panels) - 1) if n == 2 else max(widths)
    return min(MAX_CELL_PX, math.floor((WIDTH_PX - 2 * MARGIN) / wide))


def layout(scene: Scene, budget: int) -> Layout:
    """Choose the frames (bounded by ``budget``) and place the panels and text lines of a scene."""
    frames, note, full = select(scene, budget)
    panels = list(_panels(scene, frames, full))
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
    if _channel_strip(scene):
        lay.rows["channels"] = y
        y += 46
    lay.rows["phase"] = y
    y += 16
    lay.rows["sum"] = y
    y += 16
    lay.rows["caption"] = y
    y += 14 * len(_caption(lay)) + 6
    lay.rows["legend"] = y
    y += 15 * len(_legend_rows(lay)) + MARGIN
    lay.height = y
    return lay


def _channel_strip(scene: Scene) -> bool:
    s = scene.spec
    return s.x_channels > 1 or s.y_channels > 1


# ---- what the frames show -----------------------------------------------------------------------------------------

def values(scene: Scene) -> dict[str, Any]:
    """Small-integer example tensors (one sample) and the result they give: the numbers printed in the cells."""
    import torch

    import convgrad

    spec = scene.spec
    one = {"input": (1, *spec.input_shape[1:]), "weight": spec.weight_shape, "grad_output": (1, *spec.output_shape[1:])}
    gen = torch.Generator().manual_seed(3)
    t = {name: torch.randint(0, 4, shape, generator=gen).double() for name, shape in one.items()}
    nonzero = torch.tensor([-2.0, -1.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    t["weight"] = nonzero[torch.randint(0, 5, spec.weight_shape, generator=gen)]
    hyper = dict(stride=spec.stride, padding=spec.padding, dilation=spec.dilation, groups=spec.groups)
    if scene.gradient == "forward":
        conv = convgrad.conv_transpose if spec.transposed else convgrad.conv
        extra = dict(output_padding=spec.output_padding) if spec.transposed else {}
        t["output"] = conv(t["input"], t["weight"], **hyper, **extra, backend="native")  # type: ignore[operator]
    else:
        gi, gw, _ = convgrad.conv_backward(t["grad_output"], t["input"], t["weight"], None, **hyper,
                                           transposed=spec.transposed, output_padding=spec.output_padding,
                                           output_mask=(True, True, False), backend="fwdconv")
        t["grad_input"], t["grad_weight"] = gi, gw
    return t


def _number(v: float) -> str:
    text = f"{v:.0f}" if float(v).is_integer() else f"{v:.1f}"
    return "" if len(text) > 4 else text


def _used_kinds(lay: Layout) -> set[str]:
    kinds = {_kind(cells) for _, cells in lay.data.every()}
    kinds |= {_kind(cells, kernel=True) for f in lay.frames for cells in _kernel_cells(lay, f)}
    if any(u is not None and not _reached(lay.scene, u) for _, _, u in _result_cells(lay)):
        kinds.add("unreached")
    if any(c.kind == "cropped" for d in lay.result.dims for c in d):
        kinds.add("cropped")
    if _never_read(lay):
        kinds.add("never")
    return kinds


def _reached(scene: Scene, cell: Index) -> bool:
    """Whether any product of the cell multiplies two entries: in every dim, some product of its row does."""
    def real(c: Cell) -> bool:
        return c.kind == "row"

    return all(any(real(d) and real(k) for d, k in a.cells[u].links)  # type: ignore[union-attr]
               for a, u in zip(scene.axes, cell, strict=True))


def _result_cells(lay: Layout) -> list[tuple[tuple[int, ...], tuple[Any, ...], Index | None]]:
    """(canvas positions, per-dim cells, result cell or None for a cropped one) of every drawn result cell."""
    index = [{c.key: j for j, c in enumerate(a.cells)} for a in lay.scene.axes]
    out = []
    for pos, cells in lay.result.every():
        cropped = any(c.kind == "cropped" for c in cells)
        out.append((pos, cells, None if cropped else tuple(ix[c.key] for ix, c in zip(index, cells, strict=True))))
    return out


def _never_read(lay: Layout) -> set[tuple[int, ...]]:
    """Canvas positions of data entries that no result cell of the scene reads."""
    never = [lay.scene.never_read(j) for j in range(lay.scene.spec.n)]
    out = set()
    for pos, cells in lay.data.every():
        if all(c.source >= 0 for c in cells) and any(c.source in nv for c, nv in zip(cells, never, strict=True)):
            if all(c.kind in ("row", "cropped") for c in cells):
                out.add(pos)
    return out


def _kernel_cells(lay: Layout, frame: Frame) -> list[tuple[Any, ...]]:
    """The kernel cells this frame's contraction sees (its phase's kernel), per N-d cell."""
    dims = []
    for j, view in enumerate(frame.views):
        cells = list(view[1].cells) + list(view[1].dropped) if view is not None else list(lay.kernel.dims[j])
        dims.append(cells)
    return list(itertools.product(*dims))


def _legend_rows(lay: Layout) -> list[list[tuple[str, str, str]]]:
    """Legend entries (fill, hatch, label), in rows that fit 800 px: only what this scene draws."""
    names = {"data": lay.scene.data, "kernel": lay.scene.kernel, "result": lay.scene.result}
    kinds = _used_kinds(lay)
    order = ["row", "never", "zero", "pad", "cropped", "skipped", "tap", "zero_tap", "done", "unreached"]
    entries = [(FILLS.get(k, FILLS["row"]), HATCHES.get(k, "" if k != "never" else ".."), LABELS[k].format(**names))
               for k in order if k in kinds or k == "done"]
    stride = lay.scene.spec.stride
    entries += [(PHASES[_phase_number(p, stride) % len(PHASES)], "", f"bar: phase {_c(p)}") for p in
                sorted({tuple(c.phase for c in cells) for _, cells, u in _result_cells(lay)
                        if u is not None and all(c.phase >= 0 for c in cells)})]
    entries.append(("none", "", "blue outline, letter: a cell read for the black-framed cell, and the tap it meets"))
    rows, row, width = [], [], 0
    for e in entries:
        w = 24 + 6.2 * len(e[2]) + 14
        if row and width + w > WIDTH_PX - 2 * MARGIN:
            rows.append(row)
            row, width = [], 0
        row.append(e)
        width += w
    return [*rows, row] if row else rows


def _caption(lay: Layout) -> list[str]:
    plan, spec = lay.scene.plan, lay.scene.spec
    parts = [f"{spec.describe()}; plan: {plan.method}" + (f" ({plan.reason})" if plan.reason else "")]
    if lay.note:
        parts.append("shown: " + lay.note)
    if any(f.phase for f in lay.frames):
        parts.append("phase rho: " + SYMBOLS["phase rho"][1].split(" is ", 1)[1])
    if lay.scene.gradient == "grad_weight" and spec.batch > 1:
        parts.append(f"one sample shown; grad_weight adds the same sum over all {spec.batch} samples")
    return textwrap.wrap(". ".join(parts), 118)


# ---- drawing ------------------------------------------------------------------------------------------------------

def _rect(ax: Axes, x: float, y: float, w: float, h: float, **kw: Any) -> Rectangle:
    return ax.add_patch(Rectangle((x, y), w, h, **kw))  # type: ignore[return-value]


def _text(ax: Axes, x: float, y: float, s: str, size: float = FONT, **kw: Any) -> Any:
    return ax.text(x, y, s, fontsize=size, **kw)


def _cell(ax: Axes, panel: Panel, pos: Sequence[int], kind: str, text: str = "", fill: str | None = None) -> list:
    x, y = panel.at(pos)
    c = panel.cell
    edge = "#BBBBBB" if fill is None and kind == "out" else "white"
    out = [_rect(ax, x, y, c, c, facecolor=fill or FILLS[kind], edgecolor=edge, linewidth=1.2)]
    if kind in HATCHES:
        out.append(_rect(ax, x, y, c, c, fill=False, hatch=HATCHES[kind], edgecolor="#777777", linewidth=0))
    if text:
        out.append(_text(ax, x + c / 2, y + c / 2, text, FONT if c >= 28 else SMALL, ha="center", va="center",
                         color="#222222" if kind not in ("skipped",) else "#999999"))
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
    title = (f"{sc.result} {sc.result_shape} = conv of {sc.data} with {sc.kernel}"
             f"{' flipped' if sc.flips else ''} as the kernel")
    _text(ax, MARGIN, lay.rows["title"], title, 11, va="top", weight="bold")
    _text(ax, MARGIN, lay.rows["title"] + 19, _data_steps(sc)[:118], FONT, va="top", color="#333333")
    data_channel = lay.frames[0].channels[0][0]
    never = _never_read(lay)
    for panel in (lay.data, lay.kernel, lay.result):
        _text(ax, panel.x, panel.y - 4 - (12 if sc.spec.n == 3 else 0), panel.title, FONT, va="bottom")
        if sc.spec.n == 3:
            for z in range(len(panel.dims[0])):
                x, _ = panel.at((z, 0, 0))
                _text(ax, x, panel.y - 3, f"depth {z}", SMALL, va="bottom", color="#555555")
    for pos, cells in lay.data.every():
        kind = _kind(cells)
        text = _number(t[sc.data][(0, data_channel, *(c.source for c in cells))]) if kind == "row" else ""
        _cell(ax, lay.data, pos, kind, text)
        if pos in never:
            x, y = lay.data.at(pos)
            _rect(ax, x, y, lay.cell, lay.cell, fill=False, hatch="..", edgecolor="#555555", linewidth=0)
    for pos, cells, cell in _result_cells(lay):
        kind = "cropped" if cell is None else "out" if _reached(sc, cell) else "unreached"
        _cell(ax, lay.result, pos, kind)
        _phase_bar(ax, lay, pos, cells)
    if "channels" in lay.rows:
        y = lay.rows["channels"]
        _text(ax, MARGIN, y, f"channels of {sc.data} (colour: group; outlined: the ones summed)", SMALL + 0.5, va="top")
        _text(ax, WIDTH_PX / 2, y, f"channels of {sc.result} (outlined: this one)", SMALL + 0.5, va="top")
    _draw_legend(ax, lay)
    for n, line in enumerate(_caption(lay)):
        _text(ax, MARGIN, lay.rows["caption"] + 14 * n, line, SMALL + 0.5, va="top", color="#333333")
    return ax


def _draw_legend(ax: Axes, lay: Layout) -> None:
    y = lay.rows["legend"]
    for row in _legend_rows(lay):
        x = MARGIN
        for fill, hatch, label in row:
            if fill == "none":
                _rect(ax, x, y, 18, 12, fill=False, edgecolor=FOOTPRINT, linewidth=2.2)
            else:
                _rect(ax, x, y, 18, 12, facecolor=fill, edgecolor="#888888", linewidth=0.6, hatch=hatch or None)
            _text(ax, x + 24, y + 6, label, SMALL + 0.5, va="center")
            x += 24 + 6.2 * len(label) + 14
        y += 15


def _data_steps(scene: Scene) -> str:
    """What the plan does to the data before the contraction, in one line."""
    steps = [re.sub(r" \((stride-1 zeros|negative|im2col|sample-major)[^()]*\)", "", st.describe())
             .replace(" per spatial dim", "") for st in scene.plan.data_steps if not _moves_channels_only(st)]
    padding = getattr(scene.plan.conv, "padding", None)
    if padding and any(padding):
        steps.append(f"the conv pads {tuple(padding)} on both sides")
    stride = getattr(scene.plan.conv, "stride", None)
    if stride and any(v > 1 for v in stride):
        steps.append(f"read at stride {tuple(stride)}")
    dilation = getattr(scene.plan.conv, "dilation", None)
    if dilation and any(v > 1 for v in dilation):
        steps.append(f"kernel taps {tuple(dilation)} apart (dilation)")
    return f"{scene.data}: " + ("; ".join(steps) or "read as it is")


def _moves_channels_only(step: Any) -> bool:
    return getattr(type(step), "rows", None) is Spatially.rows


def _letters(scene: Scene) -> dict[tuple[int, ...], str]:
    """The letter of every kernel tap (by its source index, row-major over the kernel's spatial shape)."""
    shape = {"weight": scene.spec.weight_shape, "input": scene.spec.input_shape,
             "grad_output": scene.spec.output_shape}[scene.kernel][2:]
    return {t: _letter(j) for j, t in enumerate(itertools.product(*(range(k) for k in shape)))}


def frame_artists(ax: Axes, lay: Layout, frame: Frame, t: dict[str, Any]) -> list:
    """The parts of one frame that go with it: the footprint, the kernel, the current cell, the phase and the sum."""
    sc, out = lay.scene, []
    letters = _letters(sc)
    kernel_channel = frame.channels[0][1]
    kernel_lead = () if sc.kernel == "weight" else (0,)
    used = {tuple(c.key for c in k) for d, k in frame.links}
    for cells in _kernel_cells(lay, frame):  # the kernel this cell's contraction reads
        pos = lay.kernel.positions(cells)
        if pos is None:
            continue
        kind = _kind(cells, kernel=True)
        if kind == "tap" and tuple(c.key for c in cells) not in used:
            kind = "skipped"
        value = t[sc.kernel][(*kernel_lead, *kernel_channel, *(c.source for c in cells))] if kind == "tap" else None
        label = letters[tuple(c.source for c in cells)] if kind in ("tap", "skipped") and cells[0].source >= 0 else ""
        out += _cell(ax, lay.kernel, pos, kind, "" if value is None else _number(value))
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
        if real and all(c.source >= 0 for c in k):
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
    for pos, cells, cell in _result_cells(lay):
        if cell == frame.cell:
            kind = "out" if _reached(sc, cell) else "unreached"
            fill = FILLS["done"] if kind == "out" else None
            value = _number(t[sc.result][(*lead, *frame.channel, *cell)])
            return [*_cell(ax, lay.result, pos, kind, value, fill), *_phase_bar(ax, lay, pos, cells)]
    return []


def _phase_bar(ax: Axes, lay: Layout, pos: Sequence[int], cells: Sequence[Any]) -> list:
    """A bar in the colour of the cell's phase along the top of a result cell."""
    phase = [c.phase for c in cells]
    if any(p < 0 for p in phase) or any(c.kind == "cropped" for c in cells):
        return []
    x, y = lay.result.at(pos)
    colour = PHASES[_phase_number(phase, lay.scene.spec.stride) % len(PHASES)]
    return [_rect(ax, x + 1, y + 1, lay.cell - 2, max(4.0, lay.cell / 6), facecolor=colour, linewidth=0)]


def _current(ax: Axes, lay: Layout, frame: Frame) -> list:
    for pos, _, cell in _result_cells(lay):
        if cell == frame.cell:
            x, y = lay.result.at(pos)
            return [_rect(ax, x + 1, y + 1, lay.cell - 2, lay.cell - 2, fill=False, edgecolor=CURRENT, linewidth=3)]
    return []


def _phase_number(phase: Sequence[int], stride: Sequence[int]) -> int:
    n = 0
    for p, s in zip(phase, stride, strict=True):
        n = n * s + p
    return n


def _frame_text(ax: Axes, lay: Layout, frame: Frame, t: dict[str, Any]) -> list:
    sc = lay.scene
    letters = _letters(sc)
    index = _result_index(sc, frame)
    name = f"{sc.result}[{', '.join(map(str, index))}]"
    out = []
    if frame.phase is not None:
        rows = ", ".join(f"{r}::{s}" for r, s in zip(frame.phase, sc.spec.stride, strict=True))
        taps = sorted({letters[tuple(c.source for c in k)] for d, k in frame.links if all(c.kind == "row" for c in k)})
        out.append(_text(ax, MARGIN, lay.rows["phase"], f"phase rho = {frame.phase}: the rows {rows} of {sc.result}, "
                         f"from the taps {', '.join(taps) or '(none)'} of the {sc.kernel}", FONT, va="top",
                         color="#333333"))
    data_channel = frame.channels[0][0]
    terms = []
    for d, k in frame.links:
        if all(c.kind == "row" for c in d) and all(c.kind == "row" for c in k):
            v = t[sc.data][(0, data_channel, *(c.source for c in d))]
            terms.append(f"{_number(v)}·{letters[tuple(c.source for c in k)]}")
    value = _number(t[sc.result][index])
    if not frame.reached:
        line = f"{name} = 0: no tap of the {sc.kernel} reaches this cell"
    else:
        body = " + ".join(terms) if len(terms) <= 12 else f"the {len(terms)} products outlined"
        more = f" + the same over {len(frame.channels) - 1} more channel(s)" if len(frame.channels) > 1 else ""
        line = f"{name} = {body}{more} = {value}"
    out.append(_text(ax, MARGIN, lay.rows["sum"], line[:120], FONT, va="top"))
    return out


def _channels(ax: Axes, lay: Layout, frame: Frame) -> list:
    """Data channels and result channels as boxes coloured by group; the ones this frame sums, outlined."""
    sc, out, y = lay.scene, [], lay.rows["channels"]
    s = sc.spec
    data_c = s.y_channels if sc.direction == "x" else s.x_channels
    data_g = data_c // s.groups
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
