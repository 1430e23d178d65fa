"""Reports of `convgrad bench`: rich tables, results.json, results.md and PNG bar charts of the ratios.

Every ratio is a backend's time over native's, per round of the same run, the median over rounds
(below 1: faster than native). Summaries are geometric means over layers. ``targets`` checks the goals of issue 4.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from convgrad.cli.bench.timing import TASKS, LayerTiming

__all__ = ["best_single", "geomean", "rows", "summary", "targets", "to_json", "to_markdown", "write_plots"]


def geomean(values: Sequence[float]) -> float:
    """Geometric mean (nan for no values)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def _backends(results: list[LayerTiming]) -> list[str]:
    seen: dict[str, None] = {}
    for r in results:
        for backend, _ in r.samples:
            seen.setdefault(backend)
    return list(seen)


def best_single(r: LayerTiming) -> tuple[str, float]:
    """The fastest backend other than auto at both gradients together, and its median time."""
    times = {b: r.median(b, "both") for b, task in r.samples if task == "both" and b != "auto"}
    name = min(times, key=times.__getitem__)
    return name, times[name]


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
                "gflops": r.gflops(backend, task), "matmul_fraction": r.matmul_fraction(backend, task),
                "matmul_ms": r.matmul.median * 1e3, "matmul_size": r.matmul_size,
                "auto_choice": r.auto_choice.get(task) if backend == "auto" else None,  # both: split = per gradient
            })
    return out


def summary(results: list[LayerTiming]) -> list[dict[str, Any]]:
    """Per (dtype, backend, task): geometric-mean ratio to native and the worst layer."""
    out = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        for backend in _backends(group):
            for task in TASKS:
                ratios = {r.layer.name: r.ratio(backend, task) for r in group if (backend, task) in r.samples}
                worst = max(ratios, key=ratios.__getitem__)
                out.append({"dtype": dtype, "backend": backend, "task": task,
                            "geomean_ratio": geomean(list(ratios.values())), "max_ratio": ratios[worst],
                            "worst_layer": worst, "layers": len(ratios)})
    return out


def _find(summ: list[dict[str, Any]], dtype: str, backend: str, task: str) -> dict[str, Any] | None:
    return next((s for s in summ if (s["dtype"], s["backend"], s["task"]) == (dtype, backend, task)), None)


def targets(results: list[LayerTiming]) -> list[tuple[str, str, bool | None]]:
    """(goal, measured, met) for the goals of issue 4; met is None when the run lacks what a goal needs."""
    summ = summary(results)
    goals: list[tuple[str, str, bool | None]] = []

    def check(goal: str, dtype: str, backend: str, task: str, geo: float, worst: float | None) -> None:
        s = _find(summ, dtype, backend, task)
        if s is None:
            goals.append((goal, "not measured", None))
            return
        met = s["geomean_ratio"] <= geo and (worst is None or s["max_ratio"] <= worst)
        goals.append((goal, f"geomean {s['geomean_ratio']:.3f}, max {s['max_ratio']:.3f} ({s['worst_layer']})", met))

    check("fwdconv grad_input float32: geomean <= 1.10, every layer <= 1.5", "float32", "fwdconv", "grad_input",
          1.10, 1.5)
    check("fwdconv grad_weight float32: geomean <= 1.5, every layer <= 3.0", "float32", "fwdconv", "grad_weight",
          1.5, 3.0)
    check("auto both float32: geomean <= 0.95", "float32", "auto", "both", 0.95, None)
    vs_best = [r.ratio("auto", "both", best_single(r)[0]) for r in results
               if r.dtype == "float32" and ("auto", "both") in r.samples]
    if vs_best:
        goals.append(("auto both float32: every layer <= 1.03x the fastest single backend",
                      f"max {max(vs_best):.3f}, geomean {geomean(vs_best):.3f}", max(vs_best) <= 1.03))
    else:
        goals.append(("auto both float32: every layer <= 1.03x the fastest single backend", "not measured", None))
    check("gemm float64 (both): geomean <= 1.3", "float64", "gemm", "both", 1.3, None)
    s = _find(summ, "float64", "fwdconv", "both")
    goals.append(("fwdconv float64 (both): reported", "not measured" if s is None else
                  f"geomean {s['geomean_ratio']:.3f}, max {s['max_ratio']:.3f}", None))
    return goals


def to_json(results: list[LayerTiming], meta: dict[str, Any], path: Path) -> None:
    data = {"meta": meta, "summary": summary(results),
            "targets": [{"goal": g, "measured": m, "met": ok} for g, m, ok in targets(results)],
            "results": rows(results)}
    path.write_text(json.dumps(data, indent=1))


def _cell(r: LayerTiming, backend: str, task: str) -> str:
    s = r.samples[(backend, task)]
    return f"{s.median * 1e3:.2f} ± {s.iqr * 1e3:.2f} ({r.ratio(backend, task):.2f}x)"


def table_rows(results: list[LayerTiming]) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-layer table (shared by the rich table and the Markdown)."""
    header = ["layer", "dtype", "backend", *(f"{t} ms ± IQR (x native)" for t in TASKS), "both GFLOP/s",
              "both / matmul", "auto chose (input, weight, both)"]
    body = []
    for r in results:
        for backend in _backends([r]):
            choice = r.auto_choice if backend == "auto" else {}
            body.append([r.layer.name, r.dtype, backend, *(_cell(r, backend, t) for t in TASKS),
                         f"{r.gflops(backend, 'both'):.1f}", f"{r.matmul_fraction(backend, 'both'):.2f}",
                         ", ".join(choice.get(g, "") for g in ("grad_input", "grad_weight", "both")) if choice
                         else ""])
    return header, body


def to_markdown(results: list[LayerTiming], meta: dict[str, Any], path: Path) -> None:
    header, body = table_rows(results)
    lines = [f"# convgrad bench: suite {meta['suite']}", "",
             "| " + " | ".join(f"{k}: {v}" for k, v in meta.items() if k != "command") + " |", "",
             f"Command: `{meta['command']}`", "",
             "Times are medians over the rounds ± interquartile range; a ratio is the median over the rounds of "
             "the time over native's in the same round.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    lines += ["", "## Geometric means over layers", "", "| dtype | backend | task | geomean x native | max (layer) |",
              "|---|---|---|---|---|"]
    lines += [f"| {s['dtype']} | {s['backend']} | {s['task']} | {s['geomean_ratio']:.3f} | "
              f"{s['max_ratio']:.3f} ({s['worst_layer']}) |" for s in summary(results)]
    lines += ["", "## Targets (issue 4)", "", "| goal | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'-' if ok is None else 'yes' if ok else 'NO'} |" for g, m, ok in targets(results)]
    path.write_text("\n".join(lines) + "\n")


def write_plots(results: list[LayerTiming], out: Path) -> list[Path]:
    """One PNG per dtype: bars of every backend's ratio to native, per layer, one panel per task."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    paths = []
    for dtype in dict.fromkeys(r.dtype for r in results):
        group = [r for r in results if r.dtype == dtype]
        others = [b for b in _backends(group) if b != "native"]
        fig = Figure(figsize=(max(8.0, 0.6 * len(group) * max(1, len(others)) / 2), 10), layout="constrained")
        axes = fig.subplots(len(TASKS), 1, sharex=True)
        width = 0.8 / max(1, len(others))
        for ax, task in zip(axes, TASKS, strict=True):
            for j, backend in enumerate(others):
                xs = [i + (j - (len(others) - 1) / 2) * width for i in range(len(group))]
                ax.bar(xs, [r.ratio(backend, task) for r in group], width, label=backend)
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(ScalarFormatter())
            ax.yaxis.set_minor_formatter(ScalarFormatter())
            ax.set_ylabel(f"{task}\ntime / native")
        axes[0].legend(ncols=len(others), loc="upper left")
        axes[0].set_title(f"convgrad bench, {dtype}: ratio to native (below 1 = faster)")
        axes[-1].set_xticks(range(len(group)), [r.layer.name for r in group], rotation=60, ha="right")
        path = out / f"ratios_{dtype}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths
