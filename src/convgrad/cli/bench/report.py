"""Reports of `convgrad bench`: rich tables, results.json, results.md and PNG bar charts.

One convention for every ratio between two backends, in every table, chart and results file: the **speed-up**,
native's time over the backend's, measured in the same round (above 1: faster than native), the median over
rounds with the interquartile range of the per-round speed-ups. The backward is also given **in forwards**: its
time as a multiple of native's forward convolution in the same round (a time, not a comparison of backends): a
backward does twice the forward's multiply-adds, so 2 forwards is a backward that runs at the forward's efficiency.
Summaries are geometric means over layers.

A speed-up is flagged ``(!)`` where its measurement is suspect: its rounds disagree (the interquartile range over
half the speed-up itself), or auto kept re-tuning during the rounds. A large speed-up alone is no sign of a bad
measurement: the ``large`` suite exists to show fft's 20x on kernels where native's direct convolution is slow.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convgrad.cli.bench.timing import TASKS, LayerTiming

__all__ = ["CONVENTIONS", "FORWARDS_PER_BACKWARD", "SUMMARY_HEADER", "SUSPECT_MARK", "TABLE_HEADER", "UNSTEADY",
           "backend_colours", "geomean", "layer_line", "layer_rows", "rows", "summary", "summary_rows", "suspect",
           "suspect_note", "table_rows", "to_json", "to_markdown", "write_plots"]

FORWARDS_PER_BACKWARD = 2  # grad_input and grad_weight each do one forward's multiply-adds
# A speed-up whose per-round values have an interquartile range above this share of their median is a measurement to
# repeat: the rounds disagree. Within a run on a shared 2-core machine the IQR of a steady row stays under it
UNSTEADY = 0.5
SUSPECT_MARK = " (!)"
CONVENTIONS = {
    "speedup": "native's time over the backend's, timed in the same round (above 1: faster than native); the median "
               "over rounds, with the interquartile range of the per-round speed-ups",
    "in_forwards": "the backend's time over native's forward convolution in the same round (2: the forward's "
                   "efficiency, since a backward does two forwards' multiply-adds)",
}


def geomean(values: Sequence[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _backends(results: list[LayerTiming]) -> list[str]:
    seen: dict[str, None] = {}
    for r in results:
        for backend, _ in r.samples:
            seen.setdefault(backend)
    return list(seen)


def _tasks(results: list[LayerTiming]) -> list[str]:
    return [t for t in TASKS if any(t in r.tasks for r in results)]


def suspect(r: LayerTiming, backend: str, task: str, repeats: int | None = None) -> str:
    """Why this speed-up is a measurement to repeat, or "": the rounds disagree (its IQR over UNSTEADY of it), or
    auto's choices changed in ``repeats`` rounds (every round it was allowed to time again)."""
    if backend == "native":
        return ""
    if backend == "auto" and repeats is not None and r.retimed >= repeats:
        return "auto kept re-tuning during the rounds"
    value, iqr = r.speedup(backend, task), r.speedup_iqr(backend, task)
    if iqr > UNSTEADY * value:
        return f"the rounds disagree (IQR {iqr:.2f} over half of {value:.2f})"
    return ""


def suspect_note(meta: dict[str, Any]) -> str:
    """What (!) means and what to do about it, with the advice that applies to this run's options."""
    note = ("(!): a measurement to repeat before trusting it: the rounds disagree (the interquartile range of the "
            f"speed-up is over {UNSTEADY:.0%} of it) or auto kept re-tuning; rerun on a quieter machine, or with more "
            "--repeats or a longer --min-time")
    if str(meta.get("malloc", "")).startswith("system"):
        note += ("; with --malloc system every call that allocates pays its page faults again: rerun with --malloc "
                 "keep (the default)")
    return note


def rows(results: list[LayerTiming], repeats: int | None = None) -> list[dict[str, Any]]:
    """One flat record per (layer, dtype, backend, task): the content of results.json and the tables."""
    out = []
    for r in results:
        for (backend, task), sample in r.samples.items():
            out.append({
                "layer": r.layer.name, "network": r.layer.network, "dtype": r.dtype, "backend": backend, "task": task,
                "config": r.layer.spec().describe(), "gflop": r.layer.gflop() * (2 if task == "both" else 1),
                "median_ms": sample.median * 1e3, "iqr_ms": sample.iqr * 1e3,
                "samples_ms": [s * 1e3 for s in sample.seconds], "speedup": r.speedup(backend, task),
                "speedup_iqr": r.speedup_iqr(backend, task), "forward_ms": r.forward.median * 1e3,
                "forward_samples_ms": [s * 1e3 for s in r.forward.seconds],
                "in_forwards": r.in_forwards(backend, task), "in_forwards_iqr": r.in_forwards_iqr(backend, task),
                "gflops": r.gflops(backend, task), "matmul_fraction": r.matmul_fraction(backend, task),
                "matmul_ms": r.matmul.median * 1e3, "matmul_size": r.matmul_size,
                "auto_choice": r.auto_choice.get(task) if backend == "auto" else None,  # both: split = per gradient
                "suspect": suspect(r, backend, task, repeats) or None,
            })
    return out


def layer_line(r: LayerTiming, repeats: int | None = None) -> str:
    """One layer's answer in a line, as a run not on a terminal prints it: each backend's speed-up on both gradients,
    what auto chose, and what its tuning cost (a training run's first steps pay it) when over a second."""
    parts = []
    for backend in (b for b, t in r.samples if t == "both" and b != "native"):
        mark = SUSPECT_MARK if suspect(r, backend, "both", repeats) else ""
        chose = f" (chose {r.auto_choice['both']})" if backend == "auto" and "both" in r.auto_choice else ""
        parts.append(f"{backend} {r.speedup(backend, 'both'):.2f}x{mark}{chose}")
    tuned = f"; auto's tuning took {r.tune_seconds:.0f} s" if r.tune_seconds >= 1 else ""
    return (f"{r.layer.name} {r.dtype} in {r.seconds:.0f} s: speed-up vs native on both gradients: "
            f"{', '.join(parts)}{tuned}")


def layer_rows(results: list[LayerTiming], repeats: int | None = None) -> list[dict[str, Any]]:
    """One record per (layer, dtype): what the layer cost (``benchmarks/bench_costs.py`` reads them) and its line."""
    return [{"layer": r.layer.name, "dtype": r.dtype, "line": layer_line(r, repeats), "seconds": r.seconds,
             "first_seconds": r.first_seconds,
             "tune_seconds": r.tune_seconds, "retimed": r.retimed, "rounds": len(r.forward.seconds),
             "matmul_size": r.matmul_size, "matmul_ms": r.matmul.median * 1e3, "forward_ms": r.forward.median * 1e3,
             "matmul_gflops": 2 * r.matmul_size ** 3 / 1e9 / r.matmul.median} for r in results]


def summary(results: list[LayerTiming]) -> list[dict[str, Any]]:
    """Per (dtype, backend, task): geometric means over layers of the speed-up and of the time in native forwards,
    and the layer of each's worst (least speed-up, most forwards)."""
    out = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        for backend in _backends(group):
            for task in _tasks(group):
                timed = [r for r in group if (backend, task) in r.samples]
                speedups = {r.layer.name: r.speedup(backend, task) for r in timed}
                fwd = {r.layer.name: r.in_forwards(backend, task) for r in timed}
                worst, slowest = min(speedups, key=speedups.__getitem__), max(fwd, key=fwd.__getitem__)
                out.append({"dtype": dtype, "backend": backend, "task": task,
                            "geomean_speedup": geomean(list(speedups.values())), "min_speedup": speedups[worst],
                            "worst_layer": worst, "geomean_in_forwards": geomean(list(fwd.values())),
                            "max_in_forwards": fwd[slowest], "slowest_layer": slowest, "layers": len(speedups)})
    return out


def _write(path: Path, text: str) -> None:
    """Replace ``path`` whole (a stopped run never leaves half a file): write beside it, then rename."""
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    os.replace(part, path)


def to_json(results: list[LayerTiming], meta: dict[str, Any], path: Path, repeats: int | None = None) -> None:
    data = {"meta": meta | {"conventions": CONVENTIONS}, "summary": summary(results),
            "results": rows(results, repeats), "layers": layer_rows(results, repeats)}
    _write(path, json.dumps(data, indent=1))


def _ms(r: LayerTiming, backend: str, task: str) -> str:
    s = r.samples[(backend, task)]
    return f"{s.median * 1e3:.2f} ± {s.iqr * 1e3:.2f}"


def _times(value: float, iqr: float) -> str:
    return f"{value:.2f} ± {iqr:.2f}"


TABLE_HEADER = ("layer", "dtype", "backend", "fwd ms", "grad_input ms (speed-up)", "grad_weight ms (speed-up)",
                "both ms ± IQR", "both speed-up ± IQR", "both in fwds ± IQR", "both FLOP/s ÷ matmul's",
                "auto chose (input, weight, both)")


def table_rows(results: list[LayerTiming], repeats: int | None = None) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-layer table (shared by the rich table and the Markdown); native's forward
    time is on native's row. A task not timed (``--quick`` times both gradients only) is an empty cell."""
    body = []
    for r in results:
        for backend in _backends([r]):
            choice = r.auto_choice if backend == "auto" else {}
            mark = {t: SUSPECT_MARK if suspect(r, backend, t, repeats) else "" for t in r.tasks}
            grads = [f"{r.median(backend, t) * 1e3:.2f} ({r.speedup(backend, t):.2f}x){mark[t]}" if t in r.tasks
                     else "" for t in TASKS[:2]]
            body.append([r.layer.name, r.dtype, backend,
                         f"{r.forward.median * 1e3:.2f}" if backend == "native" else "", *grads,
                         _ms(r, backend, "both"),
                         _times(r.speedup(backend, "both"), r.speedup_iqr(backend, "both")) + mark["both"],
                         _times(r.in_forwards(backend), r.in_forwards_iqr(backend)),
                         f"{r.matmul_fraction(backend, 'both'):.2f}",
                         ", ".join(choice.get(g, "-") for g in TASKS) if choice else ""])
    return list(TABLE_HEADER), body


SUMMARY_HEADER = ("dtype", "backend", "task", "geomean speed-up", "least speed-up (layer)", "geomean in fwds",
                  "most fwds (layer)")


def summary_rows(results: list[LayerTiming]) -> list[list[str]]:
    """The rows of the geometric-mean table, in SUMMARY_HEADER's order."""
    return [[s["dtype"], s["backend"], s["task"], f"{s['geomean_speedup']:.3f}",
             f"{s['min_speedup']:.3f} ({s['worst_layer']})", f"{s['geomean_in_forwards']:.2f}",
             f"{s['max_in_forwards']:.2f} ({s['slowest_layer']})"] for s in summary(results)]


def to_markdown(results: list[LayerTiming], meta: dict[str, Any], path: Path, repeats: int | None = None) -> None:
    header, body = table_rows(results, repeats)
    lines = [f"# convgrad bench: suite {meta['suite']}", "",
             "| " + " | ".join(f"{k}: {v}" for k, v in meta.items() if k != "command") + " |", "",
             f"Command: `{meta['command']}`", "",
             "Times are medians over the rounds ± interquartile range. A **speed-up** is native's time over the "
             "backend's for the same task, timed in the same round (above 1: faster than native), the median over "
             "the rounds ± the interquartile range of those speed-ups. **in fwds** is a time: the backend's over "
             f"native's forward convolution in the same round (a backward does {FORWARDS_PER_BACKWARD} forwards' "
             "multiply-adds, so 2 is the forward's efficiency). **both** is one call for both gradients (native's "
             "shares work between them, and auto chooses it on its own), so its speed-up need not lie between "
             "grad_input's and grad_weight's.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    if any(SUSPECT_MARK in cell for row in body for cell in row):
        lines += ["", suspect_note(meta)]
    lines += ["", "## Geometric means over layers", "", "| " + " | ".join(SUMMARY_HEADER) + " |",
              "|" + "---|" * len(SUMMARY_HEADER)]
    lines += ["| " + " | ".join(row) + " |" for row in summary_rows(results)]
    _write(path, "\n".join(lines) + "\n")


def _ticks(low: float, high: float) -> list[float]:
    """Tick values of a log axis, 1-1.5-2-3-5-7 in every decade (1-2-5 past one and a half decades, 1 past four),
    from the largest at or below ``low`` to the smallest at or above ``high``: the axis then starts and ends on a
    labelled tick, so that every panel has at least two."""
    decades = math.log10(high / low)
    steps = (1, 1.5, 2, 3, 5, 7) if decades <= 1.5 else (1, 2, 5) if decades <= 4 else (1,)
    values = [float(f"{s}e{e}") for e in range(math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1)
              for s in steps]
    below = max(v for v in values if v <= low * (1 + 1e-9))
    above = min(v for v in values if v >= high * (1 - 1e-9))
    return [v for v in values if below <= v <= above]


def _figure(n_layers: int, n_bars: int, panels: int) -> tuple[Any, Any]:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(10.0, 0.3 * n_layers * max(1, n_bars)), 3.4 * panels + 2.0), layout="constrained")
    axes = fig.subplots(panels, 1, sharex=True, squeeze=False)[:, 0]
    return fig, axes


def backend_colours(names: Sequence[str]) -> dict[str, str]:
    """One colour per backend, the same in every chart of a run (the speed-up chart leaves native out, so
    matplotlib's colour cycle would shift by one): Okabe and Ito's colour-blind-safe palette, then tab10's, in the
    order of convgrad.backends() and then of ``names``."""
    import convgrad

    palette = ["#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442", "#000000",
               "#8c564b", "#7f7f7f", "#bcbd22", "#17becf"]
    order = list(dict.fromkeys([*convgrad.backends(), *names]))
    return {name: palette[i % len(palette)] for i, name in enumerate(order)}


def _bars(ax: Any, group: list[LayerTiming], backends: list[str], value: Any, line: float,
          start: float | None = None) -> None:
    """One bar per (layer, backend), grouped by layer, on a log axis labelled with plain numbers at every panel's
    ends (_ticks) that takes in ``line``; a bar starts at ``start`` (1 for a speed-up, so that it points up for a
    gain and down for a loss), or at the axis' bottom."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    width = 0.8 / max(1, len(backends))
    colours = backend_colours(_backends(group))
    heights = {b: [_value(value, r, b) for r in group] for b in backends}
    values = [h for hs in heights.values() for h in hs if not math.isnan(h)]
    ticks = _ticks(min([*values, line]) / 1.15, max([*values, line]) * 1.15)
    bottom = ticks[0] if start is None else start
    ax.set_yscale("log")
    for j, backend in enumerate(backends):
        xs = [i + (j - (len(backends) - 1) / 2) * width for i in range(len(group))]
        ax.bar(xs, [h - bottom for h in heights[backend]], width, bottom=bottom, label=backend,
               color=colours[backend])
    ax.set_ylim(ticks[0], ticks[-1])
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(axis="y", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_xlim(-0.6, len(group) - 0.4)


def _value(value: Any, r: LayerTiming, backend: str) -> float:
    """``value(r, backend)``, or nan where that backend or task was not timed on this layer (no bar)."""
    try:
        return float(value(r, backend))
    except KeyError:
        return math.nan


def _finish(fig: Any, axes: Any, group: list[LayerTiming], title: str, path: Path) -> None:
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels))
    axes[0].set_title(title, loc="left")
    axes[-1].set_xticks(range(len(group)), [r.layer.name for r in group], rotation=60, ha="right")
    part = path.with_name(path.stem + ".part" + path.suffix)
    fig.savefig(part, dpi=110)
    os.replace(part, path)


def _speedup_chart(group: list[LayerTiming], dtype: str, path: Path) -> None:
    others = [b for b in _backends(group) if b != "native"]
    tasks = _tasks(group)
    fig, axes = _figure(len(group), len(others), len(tasks))
    for ax, task in zip(axes, tasks, strict=True):
        _bars(ax, group, others, lambda r, b, task=task: r.speedup(b, task), 1.0, start=1.0)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_ylabel(f"{task}\nspeed-up vs native")
    _finish(fig, axes, group, f"convgrad bench, {dtype}: speed-up over native, median over rounds\n(native's time "
                              f"÷ the backend's in the same round; above 1 = faster)", path)


def _forward_chart(group: list[LayerTiming], dtype: str, path: Path) -> None:
    backends = _backends(group)
    fig, axes = _figure(len(group), len(backends), 1)
    _bars(axes[0], group, backends, lambda r, b: r.in_forwards(b), FORWARDS_PER_BACKWARD)
    axes[0].axhline(FORWARDS_PER_BACKWARD, color="black", linewidth=1.0, linestyle="--",
                    label=f"{FORWARDS_PER_BACKWARD} forwards: the backward's multiply-adds")
    axes[0].set_ylabel("both gradients, in native forwards\n(time ÷ native's forward)")
    _finish(fig, axes, group, f"convgrad bench, {dtype}: both gradients in native forwards, median over rounds\n"
                              f"(their time ÷ native's forward in the same round; lower = faster)", path)


def write_plots(results: list[LayerTiming], out: Path) -> list[Path]:
    """Two PNGs per dtype: ``speedups_<dtype>.png``, bars of every backend's speed-up over native per layer, one panel
    per task; ``forward_<dtype>.png``, both gradients of every backend in native forwards."""
    import matplotlib

    matplotlib.use("Agg")
    paths = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        for name, chart in (("speedups", _speedup_chart), ("forward", _forward_chart)):
            path = out / f"{name}_{dtype}.png"
            chart(group, dtype, path)
            paths.append(path)
    return paths
