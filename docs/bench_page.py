"""Put real `convgrad bench` runs on the pages: a suite's per-layer speed-ups and chart, and a `--model` run.

    convgrad bench --suite smoke --backends fwdconv gemm auto --threads 1 --out bench-results
    python docs/bench_page.py bench-results        # rewrites the block in docs/cli/bench.md, copies the chart

    convgrad bench --model convgrad.cli.bench.examples:replknet_block --input-shape 2,64,56,56 --threads 1 --json \
        > docs/bench_model_run.json
    python docs/bench_page.py --model docs/bench_model_run.json   # rewrites the blocks of MODEL_PAGES

The suite's table goes between ``<!-- bench-run -->`` and ``<!-- /bench-run -->`` in docs/cli/bench.md, with the
machine, the command and the date the run recorded; the chart becomes docs/img/bench-speedups.png. The ``--model``
run's JSON is kept as docs/bench_model_run.json, and what the command prints for it (``model_print.show``, 100
columns) goes between ``<!-- bench-model-run -->`` and ``<!-- /bench-model-run -->`` on each page of
``MODEL_PAGES``; tests/test_bench_model.py checks that the blocks are that JSON's. A run is timings of one machine
at one moment, and auto's choices are made from timings: the pages say so, and nothing checks the figures.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
PAGE = DOCS / "cli" / "bench.md"
CHART = DOCS / "img" / "bench-speedups.png"
TASKS = ("grad_input", "grad_weight", "both")
MODEL_RUN = DOCS / "bench_model_run.json"
MODEL_PAGES = (DOCS / "cli" / "bench.md", DOCS / "how-do-i.md")
MODEL_BLOCK = re.compile(r"(?s)(<!-- bench-model-run -->\n).*?(<!-- /bench-model-run -->)")


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


def model_block(text: str) -> str:
    """The Markdown of one `convgrad bench --model` run (its --json output): where and when it ran, the command, and
    what the command prints for it at 100 columns."""
    from convgrad.cli import console
    from convgrad.cli.bench.model import ModelBench
    from convgrad.cli.bench.model_print import show

    r = ModelBench.from_json(text)
    out = io.StringIO()
    show(console(file=out, width=100, no_color=True, force_terminal=False, highlight=False), r)
    m, command = r.machine, r.settings["command"].replace(" --json", "")
    return "\n".join([
        f"*An example run, on {r.settings['date'][:10]}: {m['cpu_model']}, {m['cores']} cores, {m['threads']} "
        "thread(s), a shared machine with other work beside it. Timings differ from run to run and between machines, "
        "and so may what auto chooses where two candidates are close.*", "", "```text", f"$ {command}",
        *(line.rstrip() for line in out.getvalue().rstrip("\n").splitlines()), "```", ""])


def write_model(run: Path) -> None:
    """Keep ``run`` as MODEL_RUN and write its block on every page of MODEL_PAGES."""
    text = run.read_text()
    block = model_block(text)
    for page in MODEL_PAGES:
        new, count = MODEL_BLOCK.subn(lambda m: m[1] + block + m[2], page.read_text())
        if count != 1:
            raise SystemExit(f"{page}: needs one <!-- bench-model-run --> ... <!-- /bench-model-run --> block")
        page.write_text(new)
    if run.resolve() != MODEL_RUN.resolve():
        MODEL_RUN.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, nargs="?", help="the --out folder of a convgrad bench run (float32)")
    parser.add_argument("--model", type=Path, metavar="JSON", help="the --json output of a convgrad bench --model run")
    args = parser.parse_args(argv)
    if (args.run is None) == (args.model is None):
        parser.error("give a suite run's folder or --model JSON")
    if args.model is not None:
        write_model(args.model)
    else:
        write(args.run)


if __name__ == "__main__":
    main()
