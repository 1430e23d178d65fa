"""What explain's frames show besides the cells' places: the numbers printed in them, the legend, the title and the
caption, each listing only what a layout draws (explain/placement.py sizes the figure from them).
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Sequence
from typing import Any

from convgrad.backends.fwdconv.contractions import Conv
from convgrad.backends.fwdconv.geometry import Cell
from convgrad.explain.canvas import (
    CAPTION_CHARS,
    FILLS,
    HATCHES,
    LABELS,
    LEGEND_CHAR_PX,
    MARGIN,
    PHASES,
    WIDTH_PX,
    Layout,
    cell_kind,
    channel_name,
    letter,
)
from convgrad.explain.frames import Frame, Index, Scene
from convgrad.explain.symbols import used_symbols

__all__ = ["caption", "data_steps", "kernel_cells", "legend_rows", "never_read", "number", "phase_number", "reached",
           "result_cells", "tap_letters", "title", "used_kinds", "values"]

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
    entries += [(PHASES[phase_number(p, stride) % len(PHASES)], "", f"bar: phase {channel_name(p)}") for p in
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
