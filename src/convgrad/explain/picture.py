"""Recipe.plot: the geometry of a backward, drawn from the ConvSpec with matplotlib (Agg, no display).

Two panels per figure. grad_input: for a forward conv, the zero-inserted and padded grad_output
that the flipped kernel slides over at stride 1 (inserted zeros, padding, cropped and original
entries coloured apart); for a transposed conv, the padded grad_output that the kernel reads at
stride s. grad_weight: the padded big side, its never-read leftover rows, and the taps of the
small side acting as the kernel. 2d configurations are drawn as grids, 1d and 3d as one strip per
spatial dim. Plotting is the one place that knows the step kinds' geometry rather than reading
the plan generically.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

if TYPE_CHECKING:
    from matplotlib.axes import Axes

    from convgrad.explain.recipe import Recipe
    from convgrad.spec import ConvSpec

# Zero-inserted view: a cell's category is the max over dims (cropped > padding > inserted zero > entry).
ZI_COLORS = ["#4c72b0", "#e5e5e5", "#f2c14e", "#8172b3"]
ZI_LABELS = ["grad_output entry", "inserted zero", "padding", "cropped (negative pad)"]
# Padded big-side view: category = padding + 2 * never read.
X_COLORS = ["#55a868", "#f2c14e", "#c44e52", "#e38d2c"]
X_LABELS = ["{x} entry", "padding", "real row never read (leftover r)", "padding never read"]


class Strip:
    """One spatial dim of a panel: cell categories, and the strip indices of the footprint's taps."""

    def __init__(self, cats: list[int], taps: list[int], labels: list[str]) -> None:
        self.cats, self.taps, self.labels = cats, taps, labels


def zero_inserted_strip(spec: ConvSpec, j: int) -> Strip:
    """grad_output of dim j zero-inserted by s, padded by transpose_pads; flipped-kernel taps of output 0."""
    s, d, k, z = spec.stride[j], spec.dilation[j], spec.kernel_size[j], spec.zero_inserted_size[j]
    lo, hi = spec.transpose_pads[j]
    cats = []
    for p in range(-max(lo, 0), z + max(hi, 0)):
        if p < 0 or p >= z:
            cats.append(2)
        elif p < -lo or p >= z + hi:
            cats.append(3)
        else:
            cats.append(1 if p % s else 0)
    start = max(lo, 0) - lo  # strip index of the padded tensor's first row
    return Strip(cats, [start + t * d for t in range(k)], [f"w{k - 1 - t}" for t in range(k)])


def padded_x_strip(spec: ConvSpec, j: int, taps_of: str) -> Strip:
    """The big side of dim j padded by (p_lo, p_hi), with the r never-read rows; taps of the kernel or of y."""
    i, (lo, hi), r = spec.x_size[j], spec.padding[j], spec.leftover[j]
    total = i + lo + hi
    cats = [int(q < lo or q >= lo + i) + 2 * int(q >= total - r) for q in range(total)]
    if taps_of == "kernel":
        d, k = spec.dilation[j], spec.kernel_size[j]
        return Strip(cats, [t * d for t in range(k)], [f"w{t}" for t in range(k)])
    s, o = spec.stride[j], spec.y_size[j]
    return Strip(cats, [t * s for t in range(o)], [f"y{t}" for t in range(o)])


def _grid(strips: list[Strip], combine: str) -> np.ndarray:
    """Category grid of a 2d panel from its two strips."""
    rows, cols = np.array(strips[0].cats)[:, None], np.array(strips[1].cats)[None, :]
    if combine == "max":
        return np.maximum(rows, cols)
    return ((rows % 2) | (cols % 2)) + 2 * ((rows >= 2) | (cols >= 2))


def _draw(ax: Axes, grid: np.ndarray, colors: list[str], rows: list[int], cols: list[int],
          labels: list[str] | None) -> None:
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=-0.5, vmax=len(colors) - 0.5, interpolation="nearest")
    h, w = grid.shape
    if max(h, w) <= 60:  # cell borders only while cells are big enough to see
        ax.set_xticks(np.arange(-0.5, w, 1), minor=True)
        ax.set_yticks(np.arange(-0.5, h, 1), minor=True)
        ax.grid(which="minor", color="white", linewidth=0.8)
        ax.tick_params(which="minor", length=0)
    ax.set_xticks([])
    ax.set_yticks([])
    if max(h, w) <= 60 and len(rows) * len(cols) <= 400:  # beyond that only the footprint's outline is legible
        ys, xs = np.meshgrid(rows, cols, indexing="ij")
        ax.scatter(xs.ravel(), ys.ravel(), s=60 if max(h, w) <= 30 else 12, facecolors="none", edgecolors="black",
                   linewidths=1.2)
    if labels is not None and w <= 30:
        for x, label in zip(cols, labels, strict=True):
            ax.annotate(label, (x, rows[0]), xytext=(0, 9), textcoords="offset points", ha="center", fontsize=7)
    ax.add_patch(Rectangle((min(cols) - 0.5, min(rows) - 0.5), max(cols) - min(cols) + 1, max(rows) - min(rows) + 1,
                           facecolor=(0, 0, 0, 0.12), edgecolor="black", linewidth=1.5, linestyle="--"))


def _panel(axes: list[Axes], strips: list[Strip], colors: list[str], combine: str, title: str) -> None:
    if len(strips) == 2 and len(axes) == 1:
        _draw(axes[0], _grid(strips, combine), colors, strips[0].taps, strips[1].taps, None)
        axes[0].set_title(textwrap.fill(title, 60), fontsize=9)
        return
    for j, (ax, st) in enumerate(zip(axes, strips, strict=True)):
        _draw(ax, np.array([st.cats]), colors, [0], st.taps, st.labels)
        ax.set_ylabel(f"dim {j}", rotation=0, ha="right", va="center", fontsize=8)
        if j == 0:
            ax.set_title(textwrap.fill(title, 60), fontsize=9)


def _c(value: object) -> str:
    """A tuple without spaces, so that title wrapping never splits it."""
    return str(value).replace(" ", "")


def plot(recipe: Recipe, path: str | Path | None = None) -> Figure:
    """The figure of Recipe.plot; saved to `path` when given."""
    spec = recipe.spec
    x_name, y_name = ("grad_output", "input") if spec.transposed else ("input", "grad_output")
    if spec.transposed:
        left = [padded_x_strip(spec, j, "kernel") for j in range(spec.n)]
        left_colors, left_labels, left_combine = X_COLORS, [s.format(x=x_name) for s in X_LABELS], "flags"
        left_title = (f"grad_input: grad_output padded by {_c(spec.padding)}, read by the kernel at stride "
                      f"{_c(spec.stride)}, dilation {_c(spec.dilation)}")
    else:
        left = [zero_inserted_strip(spec, j) for j in range(spec.n)]
        left_colors, left_labels, left_combine = ZI_COLORS, ZI_LABELS, "max"
        left_title = (f"grad_input: grad_output zero-inserted by {_c(spec.stride)}, padded by "
                      f"{_c(spec.transpose_pads)}; flipped kernel at stride 1, dilation {_c(spec.dilation)}")
    right = [padded_x_strip(spec, j, "y") for j in range(spec.n)]
    right_title = (f"grad_weight: {x_name} padded by {_c(spec.padding)}, leftover r={_c(spec.leftover)}; "
                   f"{y_name} as the kernel at stride {_c(spec.dilation)}, dilation {_c(spec.stride)}")
    grid = spec.n == 2
    rows = 1 if grid else spec.n
    width = max(len(st.cats) for st in left + right)
    fig = Figure(figsize=(11, 5.2) if grid else (max(10.0, min(16.0, 0.5 * width + 3)), 0.9 * rows + 1.8),
                 layout="constrained")
    axes = fig.subplots(rows, 2, squeeze=False)
    _panel(list(axes[:, 0]), left, left_colors, left_combine, left_title)
    _panel(list(axes[:, 1]), right, X_COLORS, "flags", right_title)
    entries = dict.fromkeys([*zip(left_colors, left_labels, strict=True), *((c, lb.format(x=x_name)) for c, lb in
                                                               zip(X_COLORS, X_LABELS, strict=True))])
    handles = [Patch(color=c, label=lb) for c, lb in entries]
    fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle(spec.describe(), fontsize=10)
    if path is not None:
        fig.savefig(Path(path), dpi=110)
    return fig
