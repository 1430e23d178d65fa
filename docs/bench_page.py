"""Put a real `convgrad bench` run on the bench page: its per-layer ratios as a table and its ratio chart.

    convgrad bench --suite smoke --backends fwdconv gemm auto --threads 1 --out bench-results
    python docs/bench_page.py bench-results        # rewrites the block in docs/cli/bench.md, copies the chart

The table goes between ``<!-- bench-run -->`` and ``<!-- /bench-run -->`` in docs/cli/bench.md, with the
machine, the command and the date the run recorded; the chart becomes docs/img/bench-ratios.png. A run is
timings of one machine at one moment: the page says so, and nothing checks the figures.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
PAGE = DOCS / "cli" / "bench.md"
CHART = DOCS / "img" / "bench-ratios.png"
TASKS = ("grad_input", "grad_weight", "both")


def table(data: dict[str, Any]) -> str:
    """The Markdown of one run: where it ran, then each layer's ratio to native per backend and task."""
    meta, rows = data["meta"], data["results"]
    cell = {(r["layer"], r["backend"], r["task"]): r for r in rows}
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    backends = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "native"]
    lines = [f"Measured with `{meta['command']}` on {meta['date'][:10]}: {meta['cpu_model']}, {meta['cores']} cores, "
             f"{meta['threads']} thread(s), torch {meta['torch']}, float32, median of {meta['repeats']} rounds. "
             "It is a shared 2-core machine with other work running beside it: "
             "the ratios move by tens of percent between runs, and a (!) marks a layer whose native time is "
             "implausible (a formulation over 10x faster), a measurement to repeat rather than a result.", "",
             "| layer | backend | grad_input x native | grad_weight x native | both x native ± IQR |",
             "|---|---|---|---|---|"]
    for layer in layers:
        mark = {t: " (!)" if cell[(layer, "native", t)].get("suspect_reference") else "" for t in TASKS}
        for b in backends:
            r = {t: cell[(layer, b, t)] for t in TASKS}
            lines.append(f"| {layer} | {b} | {r['grad_input']['ratio_to_native']:.2f}{mark['grad_input']} | "
                         f"{r['grad_weight']['ratio_to_native']:.2f}{mark['grad_weight']} | "
                         f"{r['both']['ratio_to_native']:.2f} ± {r['both']['ratio_iqr']:.2f}{mark['both']} |")
    return "\n".join(lines) + "\n"


def write(run: Path) -> None:
    data = json.loads((run / "results.json").read_text())
    text = PAGE.read_text()
    new, count = re.subn(r"(?s)(<!-- bench-run -->\n).*?(<!-- /bench-run -->)", lambda m: m[1] + table(data) + m[2],
                         text)
    if count != 1:
        raise SystemExit(f"{PAGE}: needs one <!-- bench-run --> ... <!-- /bench-run --> block")
    PAGE.write_text(new)
    shutil.copyfile(run / "ratios_float32.png", CHART)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the --out folder of a convgrad bench run (float32)")
    write(parser.parse_args(argv).run)


if __name__ == "__main__":
    main()
