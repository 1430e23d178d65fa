"""explain's view of the fft backend's plans (backends/fft/plans.py): text, script lines and a picture.

The fft plans compute a gradient as pad -> (phases) -> transform -> product per frequency bin -> inverse -> crop,
chunk by chunk. Their text and script are the plan's own steps, the ones the backend runs (``FftPlan.lines()``,
``FftStep.describe()``, ``FftPlan.code()``). The picture is drawn from the steps' arguments, not from frames: a
frequency bin mixes every input cell with every kernel cell, so there is no "which cells feed this output cell"
geometry to draw per step. What it shows, per spatial dim of one phase: the transform grid of L rows (the
transform's sizes), the rows holding data and the zero rows the transform pads (the circular correlation wraps
zeros onto zeros), the kernel's slots, and the rows the inverse keeps (its cuts). Animation and pages (frames)
refuse fft plans (``frames_refused``).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from convgrad.backends.fft import FftPlan, FftStep, backward_plan, shares_spectra
from convgrad.errors import MethodRefused
from convgrad.spec import ConvSpec, Shape

__all__ = ["METHOD", "code_lines", "frames_refused", "is_fft", "plan_lines", "plot", "shared_pass", "text_steps"]

METHOD = "fft"
# cell kinds of the picture, in colour order
ZERO, DATA, KEPT, DROPPED = 0, 1, 2, 3
COLOURS = ("#f2f2f2", "#4c78a8", "#54a24b", "#d9d9d9")


def is_fft(plan: Any) -> bool:
    """Whether ``plan`` is one of the fft backend's plans."""
    return isinstance(plan, FftPlan)


def shared_pass(plans: dict[str, Any]) -> list[str]:
    """A line saying that the fft backend runs grad_input's and grad_weight's plans as one pass when both gradients
    are asked for (``shares_spectra``: grad_output transformed once per chunk), else nothing."""
    pi, pw = plans.get("grad_input"), plans.get("grad_weight")
    if not (isinstance(pi, FftPlan) and isinstance(pw, FftPlan) and shares_spectra(pi, pw)):
        return []
    both = backward_plan(pi.spec)
    steps = _numbered(both) if both is not None else []
    return ["when both gradients are asked for, the fft backend runs their two plans below as one pass: each chunk "
            "of grad_output is transformed once and its spectrum read by both products (fft.execute_backward):",
            *steps]


def frames_refused(fn: str, gradient: str) -> MethodRefused:
    """The error for frames (animation, page, ``Recipe.scene``) of an fft plan."""
    return MethodRefused(fn, METHOD, f"has no frames for {gradient}: a frequency bin mixes every data cell with "
                         "every kernel cell, so no result cell reads a window of cells; Recipe.plot draws the "
                         "padded operands, the transform size and the crop instead", param="method")


def _names(plan: FftPlan) -> dict[str, str]:
    """The recipe's tensors each fft operand is: x, y (the big and the small side of the correlation), w."""
    big, small = ("grad_output", "input") if plan.spec.transposed else ("input", "grad_output")
    return {"x": big, "y": small, "w": "weight"}


def operands(plan: FftPlan) -> tuple[str, str]:
    """(data, kernel): the two tensors the plan combines, as the recipe names them."""
    names = _names(plan)
    return {"y_from_x": (names["x"], "weight"), "x_from_y": (names["y"], "weight"),
            "w_from_xy": (names["x"], names["y"])}[plan.kind]


def text_steps(plan: FftPlan) -> list[tuple[str, str, Shape]]:
    """(name, description, shape after it) of every step, in order."""
    return [(s.name, s.describe(), tuple(s.shape)) for s in plan.steps]


def _numbered(plan: FftPlan) -> list[str]:
    """The plan's lines (``FftPlan.lines``): each step numbered, each loop's head, indented by its depth."""
    return [f"   {'' if n is None else f'{n:>2}.':>3} {'  ' * depth}{text}" for n, depth, text in plan.lines()]


def plan_lines(name: str, plan: FftPlan, starts: dict[str, Shape]) -> list[str]:
    """The recipe text of one fft plan: what it combines, the transform size, then its steps."""
    data, kernel = operands(plan)
    shape = tuple(plan.steps[-1].shape)
    lines = [f"{name} {shape} = correlation of {data} and {kernel} by the convolution theorem [fft: transform "
             f"length L = {plan.sizes}, {plan.phase_count} phase(s), chunks of (groups, samples) {plan.chunks}]:",
             f"       {data:<12} {starts[data]}", f"       {kernel:<12} {starts[kernel]}"]
    if plan.spec.batch == 0:
        lines.append("   the sum is empty (batch 0): zeros")
    return [*lines, *_numbered(plan)]


def code_lines(plan: FftPlan, out: str) -> list[str]:
    """The script lines computing one gradient into ``out`` with the plan's own step lines (``FftPlan.code``)."""
    shape = tuple(plan.steps[-1].shape)
    lines = [f"# {plan.gradient}: fft ({plan.kind}), transform length L = {plan.sizes}"]
    if plan.spec.batch == 0:
        return [*lines, f"{out} = grad_output.new_zeros({shape})  # empty sum (batch 0)"]
    names = _names(plan)
    lines += [f"{v} = {names[v]}" for v in plan.inputs]
    return [*lines, "real = True  # the script's tensors are real", *plan.code(), f"{out} = out  # {shape}"]


def _step(plan: FftPlan, *ops: str) -> FftStep:
    """The plan's first step of one of these operations."""
    return next(s for s in plan.steps if s.op in ops)


def _dim_rows(plan: FftPlan, j: int) -> tuple[list[int], list[int], list[int]]:
    """Per spatial dim j, for the first live phase, the kinds of the L rows of: the data, the kernel, the result.

    Read from the steps that run: L from the forward transform's sizes, the phases, pads and slots from the dims it
    passes, the kept rows from the inverse's cuts (and, for x, the crop of its phases' pads to x's rows)."""
    spec = plan.spec
    transform = _step(plan, "x_spectra", "y_spectra").kwargs
    d = next(s.kwargs["dims"] for s in plan.steps if "dims" in s.kwargs)[j]
    size, s, phi = transform["sizes"][j], spec.stride[j], d.phases[0]
    lo = d.transform_pads[0]
    x_real = [DATA if lo <= r * s + phi < lo + spec.x_size[j] else ZERO for r in range(size)]
    held = {slot for slot in d.slots if 0 <= slot < d.taps}  # the first phase's slots that hold a tap
    taps = [DATA if r in held else ZERO for r in range(size)]
    y_rows = [DATA if r < spec.y_size[j] else ZERO for r in range(size)]
    first, last = _step(plan, "inverse", "x_inverse", "w_inverse").kwargs["cuts"][j]
    kept = [first <= r < size - last for r in range(size)]
    if plan.kind == "y_from_x":
        return x_real, taps, [KEPT if k else DROPPED for k in kept]
    if plan.kind == "x_from_y":
        return y_rows, taps, [KEPT if k and x == DATA else DROPPED for k, x in zip(kept, x_real)]
    return x_real, y_rows, [KEPT if k else DROPPED for k in kept]


def _grid(rows: list[list[int]]) -> np.ndarray:
    """The 2d picture of per-dim row kinds: a cell is the lowest kind of its two rows (zero beats data)."""
    if len(rows) == 1:
        return np.array([rows[0]])
    a, b = np.array(rows[-2]), np.array(rows[-1])
    both = np.minimum(a[:, None], b[None, :])
    keep = (a[:, None] == KEPT) & (b[None, :] == KEPT)
    return np.where(both >= KEPT, np.where(keep, KEPT, DROPPED), both)


_TITLES = {"y_from_x": ("x (its phase) on the L grid", "flipped kernel slots", "y: the crop keeps the first o rows"),
           "x_from_y": ("y on the L grid", "kernel slots", "x (this phase): kept rows, the pads cropped"),
           "w_from_xy": ("x (its phase) on the L grid", "y, reversed in the product", "w: the crop keeps Q slots")}


def _titled(plan: FftPlan, title: str) -> str:
    """A panel title with the backend's operand (x, y, w) named as the recipe's tensor: ``x = grad_output``."""
    head, rest = title.split(" ", 1) if " " in title else (title, "")
    name = head.rstrip(":,")
    return f"{name} = {_names(plan)[name]}{head[len(name):]} {rest}" if name in ("x", "y") else title


def plot(spec: ConvSpec, plans: dict[str, Any], gradients: tuple[str, ...], path: str | Path | None = None) -> Any:
    """The fft picture: per fft gradient, the data, the kernel and the result on one phase's transform grid."""
    from matplotlib.colors import ListedColormap
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    shown = [g for g in gradients if is_fft(plans[g])]
    height = 1.3 + (3.0 if spec.n > 1 else 1.6) * len(shown)  # inches: title and legend, then a row per gradient
    fig = Figure(figsize=(8, height), dpi=100)
    cmap = ListedColormap(COLOURS)
    for row, gradient in enumerate(shown):
        plan: FftPlan = plans[gradient]
        dims = [_dim_rows(plan, j) for j in range(spec.n)]
        for col in range(3):
            ax = fig.add_subplot(len(shown), 3, row * 3 + col + 1)
            ax.imshow(_grid([d[col] for d in dims]), cmap=cmap, vmin=0, vmax=3,
                      aspect="equal" if spec.n > 1 else "auto", interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            # two lines at most 32 wide: three one-line titles of 8 inches ran into each other
            ax.set_title(textwrap.fill(_titled(plan, _TITLES[plan.kind][col]), 32), fontsize=8)
            if col == 0:  # a 3d grid is drawn by its last two dims (``_grid``): say so, or (4, 4, 3) reads as (4, 3)
                shown_dims = "\nthe last two spatial dims" if spec.n > 2 else ""
                ax.set_ylabel(f"{gradient}\nL = {plan.sizes}{shown_dims}", fontsize=8)
            if col == 1:  # the steps under the middle panel
                steps = " -> ".join(s.name for s in plan.steps)
                ax.set_xlabel(f"{steps}\nper bin one product (a matmul over the channels of each of {spec.groups} "
                              f"group(s)); {plan.phase_count} phase(s), each on its own L grid", fontsize=7)
    others = [g for g in gradients if g not in shown]
    note = f"\n{', '.join(others)} not fft: plot(gradients=...) draws its frames" if others else ""
    fig.suptitle(f"fft: {spec.describe()}{note}", fontsize=8)
    fig.legend(handles=[Patch(color=c, label=lab) for c, lab in
                        zip(COLOURS, ("zero (padding to L)", "data / taps", "kept by the crop", "cropped"),
                            strict=True)], loc="lower center", ncol=4, fontsize=7)
    # the title's lines (a second one names the gradients drawn elsewhere) and the panels' two-line titles above
    fig.subplots_adjust(bottom=0.8 / height, top=1 - (0.6 + 0.15 * note.count("\n")) / height,
                        hspace=0.6 if spec.n > 1 else 1.1)
    if path is not None:
        fig.savefig(Path(path))
    return fig
