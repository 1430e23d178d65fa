"""Reports of `convgrad bench`: rich tables, results.json, results.md and PNG bar charts.

Every ratio is a time over a reference measured in the same round, the median over rounds, with the
interquartile range of the per-round ratios. Two references: native's backward for the same task
("x native", below 1: faster than native), and native's forward convolution ("x fwd"): a backward does
twice the forward's multiply-adds, so 2x fwd is a backward that runs at the forward's efficiency.
Summaries are geometric means over layers.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convgrad.cli.bench.timing import TASKS, LayerTiming

__all__ = ["FORWARDS_PER_BACKWARD", "IMPLAUSIBLE_SPEEDUP", "SUMMARY_HEADER", "SUSPECT_NOTE", "TABLE_HEADER",
           "backend_colours", "geomean", "rows", "summary", "summary_rows", "suspect_reference", "table_rows",
           "to_json", "to_markdown", "write_plots"]

FORWARDS_PER_BACKWARD = 2  # grad_input and grad_weight each do one forward's multiply-adds
# A formulation is built from the same kernels native calls; one running more than 10x faster than native says
# that native's time is off (page faults, a slow kernel choice on that machine), not that the formulation is.
IMPLAUSIBLE_SPEEDUP = 10.0
SUSPECT_MARK = " (!)"
SUSPECT_NOTE = (f"(!): native's time is implausible (a formulation of the same gradient ran over "
                f"{IMPLAUSIBLE_SPEEDUP:g}x faster); rerun, or try --malloc keep, before trusting this layer's ratios")


def geomean(values: Sequence[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _backends(results: list[LayerTiming]) -> list[str]:
    seen: dict[str, None] = {}
    for r in results:
        for backend, _ in r.samples:
            seen.setdefault(backend)
    return list(seen)


def rows(results: list[LayerTiming]) -> list[dict[str, Any]]:
    """One flat record per (layer, dtype, backend, task): the content of results.json and the tables."""
    out = []
    for r in results:
        for (backend, task), sample in r.samples.items():
            out.append({
                "layer": r.layer.name, "network": r.layer.network, "dtype": r.dtype, "backend": backend, "task": task,
                "config": r.layer.spec().describe(), "gflop": r.layer.gflop() * (2 if task == "both" else 1),
                "median_ms": sample.median * 1e3, "iqr_ms": sample.iqr * 1e3,
                "samples_ms": [s * 1e3 for s in sample.seconds], "ratio_to_native": r.ratio(backend, task),
                "ratio_iqr": r.ratio_iqr(backend, task), "forward_ms": r.forward.median * 1e3,
                "forward_samples_ms": [s * 1e3 for s in r.forward.seconds],
                "x_forward": r.x_forward(backend, task), "x_forward_iqr": r.x_forward_iqr(backend, task),
                "gflops": r.gflops(backend, task), "matmul_fraction": r.matmul_fraction(backend, task),
                "matmul_ms": r.matmul.median * 1e3, "matmul_size": r.matmul_size,
                "auto_choice": r.auto_choice.get(task) if backend == "auto" else None,  # both: split = per gradient
                "suspect_reference": suspect_reference(r, task),
            })
    return out


def summary(results: list[LayerTiming]) -> list[dict[str, Any]]:
    """Per (dtype, backend, task): geometric means over layers of the ratio to native and of the multiple of
    native's forward, and the worst layer of each."""
    out = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        for backend in _backends(group):
            for task in TASKS:
                timed = [r for r in group if (backend, task) in r.samples]
                ratios = {r.layer.name: r.ratio(backend, task) for r in timed}
                fwd = {r.layer.name: r.x_forward(backend, task) for r in timed}
                worst, slowest = max(ratios, key=ratios.__getitem__), max(fwd, key=fwd.__getitem__)
                out.append({"dtype": dtype, "backend": backend, "task": task,
                            "geomean_ratio": geomean(list(ratios.values())), "max_ratio": ratios[worst],
                            "worst_layer": worst, "geomean_x_forward": geomean(list(fwd.values())),
                            "max_x_forward": fwd[slowest], "slowest_layer": slowest, "layers": len(ratios)})
    return out


def suspect_reference(r: LayerTiming, task: str) -> bool:
    """Native's time for ``task`` is implausible: some other backend ran more than IMPLAUSIBLE_SPEEDUP x faster."""
    return any(r.ratio(b, t) * IMPLAUSIBLE_SPEEDUP < 1 for b, t in r.samples if b != "native" and t == task)


def to_json(results: list[LayerTiming], meta: dict[str, Any], path: Path) -> None:
    data = {"meta": meta, "summary": summary(results), "results": rows(results)}
    path.write_text(json.dumps(data, indent=1))


def _ms(r: LayerTiming, backend: str, task: str) -> str:
    s = r.samples[(backend, task)]
    return f"{s.median * 1e3:.2f} ± {s.iqr * 1e3:.2f}"


def _times(value: float, iqr: float) -> str:
    return f"{value:.2f} ± {iqr:.2f}"


TABLE_HEADER = ("layer", "dtype", "backend", "fwd ms", "grad_input ms (x native)", "grad_weight ms (x native)",
                "both ms ± IQR", "both x native ± IQR", "both x fwd ± IQR", "both / matmul",
                "auto chose (input, weight, both)")


def table_rows(results: list[LayerTiming]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-layer table (shared by the rich table and the Markdown); native's forward
    time is on native's row."""
    body = []
    for r in results:
        for backend in _backends([r]):
            choice = r.auto_choice if backend == "auto" else {}
            mark = {t: SUSPECT_MARK if backend == "native" and suspect_reference(r, t) else "" for t in TASKS}
            grads = [f"{r.median(backend, t) * 1e3:.2f}{mark[t]} ({r.ratio(backend, t):.2f}x)" for t in TASKS[:2]]
            body.append([r.layer.name, r.dtype, backend,
                         f"{r.forward.median * 1e3:.2f}" if backend == "native" else "", *grads,
                         _ms(r, backend, "both") + mark["both"],
                         _times(r.ratio(backend, "both"), r.ratio_iqr(backend, "both")),
                         _times(r.x_forward(backend), r.x_forward_iqr(backend)),
                         f"{r.matmul_fraction(backend, 'both'):.2f}",
                         ", ".join(choice.get(g, "") for g in ("grad_input", "grad_weight", "both")) if choice
                         else ""])
    return list(TABLE_HEADER), body


SUMMARY_HEADER = ("dtype", "backend", "task", "geomean x native", "max x native (layer)", "geomean x fwd",
                  "max x fwd (layer)")


def summary_rows(results: list[LayerTiming]) -> list[list[str]]:
    """The rows of the geometric-mean table, in SUMMARY_HEADER's order."""
    return [[s["dtype"], s["backend"], s["task"], f"{s['geomean_ratio']:.3f}",
             f"{s['max_ratio']:.3f} ({s['worst_layer']})", f"{s['geomean_x_forward']:.2f}",
             f"{s['max_x_forward']:.2f} ({s['slowest_layer']})"] for s in summary(results)]


def to_markdown(results: list[LayerTiming], meta: dict[str, Any], path: Path) -> None:
    header, body = table_rows(results)
    lines = [f"# convgrad bench: suite {meta['suite']}", "",
             "| " + " | ".join(f"{k}: {v}" for k, v in meta.items() if k != "command") + " |", "",
             f"Command: `{meta['command']}`", "",
             "Times are medians over the rounds ± interquartile range. A ratio is the median over the rounds of the "
             "time over a reference timed in the same round, ± the interquartile range of those ratios: native's "
             "backward for the same task (x native), or native's forward convolution (x fwd; a backward does "
             f"{FORWARDS_PER_BACKWARD} forwards' multiply-adds).", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    if any(SUSPECT_MARK in cell for row in body for cell in row):
        lines += ["", SUSPECT_NOTE]
    lines += ["", "## Geometric means over layers", "", "| " + " | ".join(SUMMARY_HEADER) + " |",
              "|" + "---|" * len(SUMMARY_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(results)]
    path.write_text("\n".join(lines) + "\n")


_TICKS = (0.1, 0.2, 0.3, 0.5, 0.7, 1, 1.5, 2, 3, 5, 7, 10, 15, 20, 30, 50, 100, 200, 500)


def _figure(n_layers: int, n_bars: int, panels: int) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(10.0, 0.3 * n_layers * max(1, n_bars)), 3.4 * panels + 2.0), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def backend_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per backend, the same in every chart of a run (the ratio chart leaves native out, so matplotlib's
    colour cycle would shift by one): Okabe and Ito's colour-blind-safe palette, then tab10's, in the order of
    convgrad.backends() and then of ``names``."""
    import convgrad

    palette = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
               "#8c564b", "#7f7f7f", "#bcbd22", "#17becf"]
    order = list(dict.fromkeys([*convgrad.backends(), *names]))
    return {name: palette[i % len(palette)] for i, name in enumerate(order)}


def _bars(ax: Any, group: list[LayerTiming], backends: list[str], value: Any) -> None:
    """One bar per (layer, backend), grouped by layer, on a log axis labelled with plain numbers."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    width = 0.8 / max(1, len(backends))
    colours = backend_colours(_backends(group))
    values = []
    for j, backend in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(group))]
        values += [value(r, backend) for r in group]
        ax.bar(xs, values[-len(group):], width, label=backend, color=colours[backend])
    ax.set_yscale("log")
    low, high = min(min(values), 1.0) / 1.15, max(values) * 1.15
    ax.set_ylim(low, high)
    ax.yaxis.set_major_locator(FixedLocator([t for t in _TICKS if low <= t <= high]))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="y", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlim(-0.6, len(group) - 0.4)


def _finish(fig: Any, axes: Any, group: list[LayerTiming], title: str, path: Path) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    axes[0].set_title(title, loc="left")
    axes[-1].set_xticks(range(len(group)), [r.layer.name for r in group], rotation=60, ha="right")
    fig.savefig(path, dpi=110)


def _ratio_chart(group: list[LayerTiming], dtype: str, path: Path) -> None:
    others = [b for b in _backends(group) if b != "native"]
    fig, axes = _figure(len(group), len(others), len(TASKS))
    for ax, task in zip(axes, TASKS, strict=True):
        _bars(ax, group, others, lambda r, b, task=task: r.ratio(b, task))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"{task}\ntime / native")
    _finish(fig, axes, group, f"convgrad bench, {dtype}: time over native's in the same round (below 1 = faster), "
                              f"median over rounds", path)


def _forward_chart(group: list[LayerTiming], dtype: str, path: Path) -> None:
    backends = _backends(group)
    fig, axes = _figure(len(group), len(backends), 1)
    _bars(axes[0], group, backends, lambda r, b: r.x_forward(b))
    axes[0].axhline(FORWARDS_PER_BACKWARD, color="black", linewidth=1.0, linestyle="--",
                    label=f"{FORWARDS_PER_BACKWARD}x: the backward's multiply-adds")
    axes[0].set_ylabel("both gradients / native's forward")
    _finish(fig, axes, group, f"convgrad bench, {dtype}: the backward (grad_input and grad_weight) over native's "
                              f"forward in the same round,\nmedian over rounds", path)


def write_plots(results: list[LayerTiming], out: Path) -> list[Path]:
    """Two PNGs per dtype: ``ratios_<dtype>.png``, bars of every backend's ratio to native per layer, one panel per
    task; ``forward_<dtype>.png``, both gradients of every backend as a multiple of native's forward."""
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        for name, chart in (("ratios", _ratio_chart), ("forward", _forward_chart)):
            path = out / f"{name}_{dtype}.png"
            chart(group, dtype, path)
            paths.append(path)
    return paths
