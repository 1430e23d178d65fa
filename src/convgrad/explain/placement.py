"""Where explain's frames go and what they show: the frames chosen, the panels placed, the numbers, the legend.

Plain decisions for explain/render.py, which draws them: which frames fit a budget (the first channel of
each group, a corner of the result, and for large layers a corner of the data and kernel), where each
panel's cells go in pixels (figures 800 px wide at 100 dpi, cells 20 to 36 px), the small-integer
tensors whose numbers are printed, and the legend and caption lines, which list only what is drawn.
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from convgrad.backends.fwdconv.contractions import Conv
from convgrad.backends.fwdconv.geometry import Cell
from convgrad.explain.frames import Frame, Index, Scene
from convgrad.explain.symbols import used_symbols

__all__ = ["DPI", "FILLS", "GROUP_COLOURS", "HATCHES", "LEGEND", "LEGEND_CHAR_PX", "LEGEND_LINE_PX",
           "MIN_CELL_PX", "OKABE_ITO", "PHASES", "WIDTH_PX", "Layout",
           "Panel", "Window", "caption", "frames_needed", "layout", "legend_rows", "select", "values"]

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
        notes.append(f"result channel{'s' if len(firsts) > 1 else ''} {', '.join(map(_c, firsts))} of {len(channels)}"
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


def _c(channel: Index) -> str:
    return str(channel[0]) if len(channel) == 1 else "(" + ", ".join(map(str, channel)) + ")"


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


# ---- what the frames show -----------------------------------------------------------------------------------------

def values(scene: Scene) -> dict[str, Any]:
    """Small-integer example tensors (one sample) and the result they give: the numbers printed in the cells."""
    import torch

    from convgrad.backends.native import forward
    from convgrad.functional import conv_backward

    spec = scene.spec
    one = {"input": (1, *spec.input_shape[1:]), "weight": spec.weight_shape, "grad_output": (1, *spec.output_shape[1:])}
    gen = torch.Generator().manual_seed(3)
    t = {name: torch.randint(0, 4, shape, generator=gen).double() for name, shape in one.items()}
    nonzero = torch.tensor([-2.0, -1.0, 1.0, 2.0, 3.0], dtype=torch.float64)
    t["weight"] = nonzero[torch.randint(0, 5, spec.weight_shape, generator=gen)]
    hyper = dict(stride=spec.stride, padding=spec.padding, dilation=spec.dilation, groups=spec.groups)
    if scene.gradient == "forward":
        t["output"] = forward(spec.with_batch(1), t["input"], t["weight"], None)  # (1, C_out, *o)
    else:
        gi, gw, _ = conv_backward(t["grad_output"], t["input"], t["weight"], None, **hyper,
                                  transposed=spec.transposed, output_padding=spec.output_padding,
                                  output_mask=(True, True, False), backend="fwdconv")
        t["grad_input"], t["grad_weight"] = gi, gw
    return t


def number(v: Any) -> str:
    """A cell's number in at most 4 characters (thousands as k); -0.0 (a sum of no products) prints as 0."""
    v = round(float(v), 1) + 0.0  # + 0.0: -0.0 becomes 0.0
    if abs(v) >= 1000:
        return f"{v / 1000:.0f}k" if abs(v) < 999_500 else f"{v / 1e6:.0f}M"
    return f"{v:.0f}" if v.is_integer() else f"{v:.1f}"


def used_kinds(lay: Layout) -> set[str]:
    kinds = {cell_kind(cells) for _, cells in lay.data.every()}
    kinds |= {cell_kind(cells, kernel=True) for f in lay.frames for cells in kernel_cells(lay, f)}
    if any(u is not None and not reached(lay.scene, u) for _, _, u in result_cells(lay)):
        kinds.add("unreached")
    if any(c.kind == "cropped" for d in lay.result.dims for c in d):
        kinds.add("cropped")
    if never_read(lay):
        kinds.add("never")
    return kinds


def reached(scene: Scene, cell: Index) -> bool:
    """Whether any product of the cell multiplies two entries: in every dim, some product of its row does."""
    def real(c: Cell) -> bool:
        return c.kind == "row"

    return all(any(real(d) and real(k) for d, k in a.cells[u].links)  # type: ignore[union-attr]
               for a, u in zip(scene.axes, cell, strict=True))


def result_cells(lay: Layout) -> list[tuple[tuple[int, ...], tuple[Any, ...], Index | None]]:
    """(canvas positions, per-dim cells, result cell or None for a cropped one) of every drawn result cell."""
    index = [{c.key: j for j, c in enumerate(a.cells)} for a in lay.scene.axes]
    out = []
    for pos, cells in lay.result.every():
        cropped = any(c.kind == "cropped" for c in cells)
        out.append((pos, cells, None if cropped else tuple(ix[c.key] for ix, c in zip(index, cells, strict=True))))
    return out


def never_read(lay: Layout) -> set[tuple[int, ...]]:
    """Canvas positions of data entries that no result cell of the scene reads."""
    never = [lay.scene.never_read(j) for j in range(lay.scene.spec.n)]
    out = set()
    for pos, cells in lay.data.every():
        if all(c.source >= 0 for c in cells) and any(c.source in nv for c, nv in zip(cells, never, strict=True)):
            if all(c.kind in ("row", "cropped") for c in cells):
                out.add(pos)
    return out


def kernel_cells(lay: Layout, frame: Frame) -> list[tuple[Any, ...]]:
    """The kernel cells this frame's contraction sees (its phase's kernel), per N-d cell."""
    dims = []
    for j, view in enumerate(frame.views):
        cells = list(view[1].cells) + list(view[1].dropped) if view is not None else list(lay.kernel.dims[j])
        dims.append(cells)
    return list(itertools.product(*dims))


def legend_rows(lay: Layout) -> list[list[tuple[str, str, str]]]:
    """Legend entries (fill, hatch, label), in rows that fit 800 px: only what this scene draws."""
    names = {"data": lay.scene.data, "kernel": lay.scene.kernel, "result": lay.scene.result}
    kinds = used_kinds(lay)
    order = ["row", "never", "zero", "pad", "cropped", "skipped", "tap", "zero_tap", "done", "unreached"]
    labels = {**LABELS, "tap": LABELS["tap"] if lay.scene.kernel == "weight" else "{kernel} entry (the kernel here)"}
    entries = [(FILLS.get(k, FILLS["row"]), HATCHES.get(k, "" if k != "never" else ".."), labels[k].format(**names))
               for k in order if k in kinds or k == "done"]
    stride = lay.scene.spec.stride
    entries += [(PHASES[phase_number(p, stride) % len(PHASES)], "", f"bar: phase {_c(p)}") for p in
                sorted({tuple(c.phase for c in cells) for _, cells, u in result_cells(lay)
                        if u is not None and all(c.phase >= 0 for c in cells)})]
    entries.append(("none", "", "blue outline, letter: a cell read for the black-framed cell, and the tap it meets"))
    rows, row, width = [], [], 0
    for e in entries:
        w = 24 + LEGEND_CHAR_PX * len(e[2]) + 14
        if row and width + w > WIDTH_PX - 2 * MARGIN:
            rows.append(row)
            row, width = [], 0
        row.append(e)
        width += w
    return [*rows, row] if row else rows


def caption(lay: Layout) -> list[str]:
    plan, spec = lay.scene.plan, lay.scene.spec
    parts = [f"{spec.describe()}; plan: {plan.method}" + (f" ({plan.reason})" if plan.reason else "")]
    if lay.note:
        parts.append("shown: " + lay.note)
    if lay.scene.gradient == "grad_weight" and spec.batch > 1:
        parts.append(f"one sample shown; grad_weight adds the same sum over all {spec.batch} samples")
    words = " ".join([title(lay.scene), data_steps(lay.scene), *(["phase rho"] if any(f.phase for f in lay.frames)
                                                                  else [])])
    parts += [f"{name}: {definition}" for name, definition in used_symbols(words)]
    return textwrap.wrap(". ".join(parts), CAPTION_CHARS)


def title(scene: Scene) -> str:
    return (f"{scene.result} {scene.result_shape} = conv of {scene.data} with {scene.kernel}"
            f"{' flipped' if scene.flips else ''} as the kernel")

def data_steps(scene: Scene) -> str:
    """What the plan does to the data before the contraction, in one line."""
    steps = [label for label in (st.label() for st in scene.plan.data_steps) if label]  # "": no rows move
    conv = scene.plan.conv
    if isinstance(conv, Conv):  # a plain conv: its own padding, stride and dilation shape the picture
        if any(conv.padding):
            steps.append(f"the conv pads {_per_dim(conv.padding)} on both sides")
        if any(v > 1 for v in conv.stride):
            steps.append(f"read at stride {_per_dim(conv.stride)}")
        if any(v > 1 for v in conv.dilation):
            steps.append(f"kernel taps {_per_dim(conv.dilation)} apart (dilation)")
    elif hasattr(conv, "phases"):
        steps.append("each phase pads it as it needs and reads it at stride 1")
    return f"{scene.data}: " + ("; ".join(steps) or "read as it is")


def _per_dim(values: Sequence[int]) -> str:
    """Per-dim integers in prose: ``2`` in 1d, ``(2, 1)`` otherwise (code.py's ``_dims`` writes them as code)."""
    return str(values[0]) if len(values) == 1 else str(tuple(values))


def tap_letters(scene: Scene) -> dict[tuple[int, ...], str]:
    """The letter of every kernel tap (by its source index, row-major over the kernel's spatial shape)."""
    shape = {"weight": scene.spec.weight_shape, "input": scene.spec.input_shape,
             "grad_output": scene.spec.output_shape}[scene.kernel][2:]
    if math.prod(shape) > 26:  # too many taps to letter: the outlines and the kernel's numbers say it
        return {}
    return {t: letter(j) for j, t in enumerate(itertools.product(*(range(k) for k in shape)))}

def phase_number(phase: Sequence[int], stride: Sequence[int]) -> int:
    n = 0
    for p, s in zip(phase, stride, strict=True):
        n = n * s + p
    return n
