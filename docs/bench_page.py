"""Put a real `convgrad bench` run on the bench page: its per-layer speed-ups as a table and its speed-up chart.

    convgrad bench --suite smoke --backends fwdconv gemm auto --threads 1 --out bench-results
    python docs/bench_page.py bench-results        # rewrites the block in docs/cli/bench.md, copies the chart

The table goes between ``<!-- bench-run -->`` and ``<!-- /bench-run -->`` in docs/cli/bench.md, with the
machine, the command and the date the run recorded; the chart becomes docs/img/bench-speedups.png. A run is
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
CHART = DOCS / "img" / "bench-speedups.png"
TASKS = ("grad_input", "grad_weight", "both")


def table(data: dict[str, Any]) -> str:
    """The Markdown of one run: where it ran, then each layer's speed-up over native per backend and task."""
    meta, rows = data["meta"], data["results"]
    cell = {(r["layer"], r["backend"], r["task"]): r for r in rows}
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    backends = [b for b in dict.fromkeys(r["backend"] for r in rows) if b != "native"]
    lines = [f"Measured with `{meta['command']}` on {meta['date'][:10]}: {meta['cpu_model']}, {meta['cores']} cores, "
             f"{meta['threads']} thread(s), torch {meta['torch']}, float32, median of {meta['repeats']} rounds. "
             "It is a shared 2-core machine with other work running beside it: the speed-ups move by tens of percent "
             "between runs, and a (!) marks a measurement to repeat (its rounds disagree), not a result. A speed-up "
             "is native's time over the backend's in the same round: above 1 is faster than native.", "",
             "What it printed before the tables (not on a terminal):", "", "```text", meta["plan"],
             *(f"[{i}/{len(data['layers'])}] {lay['line']}" for i, lay in enumerate(data["layers"], 1)), "```", "",
             "| layer | backend | grad_input speed-up | grad_weight speed-up | both speed-up ± IQR |",
             "|---|---|---|---|---|"]
    for layer in layers:
        for b in backends:
            r = {t: cell[(layer, b, t)] for t in TASKS}
            mark = {t: " (!)" if r[t].get("suspect") else "" for t in TASKS}
            lines.append(f"| {layer} | {b} | {r['grad_input']['speedup']:.2f}{mark['grad_input']} | "
                         f"{r['grad_weight']['speedup']:.2f}{mark['grad_weight']} | "
                         f"{r['both']['speedup']:.2f} ± {r['both']['speedup_iqr']:.2f}{mark['both']} |")
    return "\n".join(lines) + "\n"


def write(run: Path) -> None:
    data = json.loads((run / "results.json").read_text())
    text = PAGE.read_text()
    new, count = re.subn(r"(?s)(<!-- bench-run -->\n).*?(<!-- /bench-run -->)", lambda m: m[1] + table(data) + m[2],
                         text)
    if count != 1:
        raise SystemExit(f"{PAGE}: needs one <!-- bench-run --> ... <!-- /bench-run --> block")
    PAGE.write_text(new)
    shutil.copyfile(run / "speedups_float32.png", CHART)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the --out folder of a convgrad bench run (float32)")
    write(parser.parse_args(argv).run)


if __name__ == "__main__":
    main()
