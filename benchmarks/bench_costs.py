"""The reference costs that `convgrad bench` prices a run with (src/convgrad/cli/bench/costs.json), from bench runs.

Per (layer, dtype) of the runs' ``results.json``: the median seconds of each timed call (native and every backend,
per task; native's forward; the matmul), auto's tuning and settling (``tune_s``), and the run's matmul probe in
GFLOP/s (``estimate.matmul_gflops``, at the run's threads), by which ``convgrad.cli.bench.estimate`` scales them to
another machine. A later run overrides an earlier one's calls of the same layer, so runs with other backends add
to a table. The figures are seconds of the machine the runs ran on: run them alone on it (with other work beside
them, 2 threads cost 5x their quiet time on a 2-core VM, and the probe did not slow alike).

On a quiet machine (the figures are seconds of this machine; the layers' defaults are what is priced):

    convgrad bench --suite all --dtype float32 float64 --threads 2 --repeats 1 --min-time 0 --out /tmp/costs/all
    convgrad bench --suite large --threads 2 --repeats 1 --min-time 0 --out /tmp/costs/large
    convgrad bench --suite smoke --backends fwdconv gemm auto --threads 2 --repeats 1 --min-time 0 \\
        --out /tmp/costs/smoke
    PYTHONPATH=src python benchmarks/bench_costs.py /tmp/costs/all /tmp/costs/large /tmp/costs/smoke
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

OUT = Path(__file__).resolve().parents[1] / "src" / "convgrad" / "cli" / "bench" / "costs.json"


def table(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The costs of every (layer, dtype) the runs timed, keyed ``layer|dtype``."""
    layers: dict[str, Any] = {}
    for data in runs:
        for lay in data["layers"]:
            entry = layers.setdefault(f"{lay['layer']}|{lay['dtype']}", {"calls": {}})
            entry["matmul_gflops"] = data["meta"]["matmul_gflops"]
            entry["calls"]["forward"] = lay["forward_ms"] / 1e3
            entry["calls"]["matmul"] = lay["matmul_ms"] / 1e3
            if lay["tune_seconds"]:
                entry["tune_s"] = round(lay["tune_seconds"], 4)
        for row in data["results"]:
            calls = layers[f"{row['layer']}|{row['dtype']}"]["calls"]
            calls[f"{row['backend']}|{row['task']}"] = row["median_ms"] / 1e3
    for entry in layers.values():
        entry["calls"] = {k: float(f"{v:.4g}") for k, v in sorted(entry["calls"].items())}
    return layers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="the --out folders of convgrad bench runs")
    parser.add_argument("--out", type=Path, default=OUT, help=f"the table to write (default {OUT})")
    args = parser.parse_args(argv)
    runs = [json.loads((run / "results.json").read_text()) for run in args.runs]
    metas = [r["meta"] for r in runs]
    costs = {"machine": f"{metas[0]['cpu_model']}, {metas[0]['cores']} cores, {metas[0]['threads']} thread(s)",
             "torch": metas[0]["torch"], "date": metas[0]["date"][:10],
             "commands": [m["command"] for m in metas],
             "made_by": "PYTHONPATH=src python " + shlex.join(["benchmarks/bench_costs.py", *map(str, args.runs)]),
             "layers": table(runs)}
    args.out.write_text(json.dumps(costs, indent=1) + "\n")
    print(f"wrote {args.out}: {len(costs['layers'])} layers")


if __name__ == "__main__":
    sys.exit(main())
