"""Paired timing of two source trees: is the new tree as fast as the old one, within the noise between rounds?

Runs ``python -m convgrad bench`` alternately with PYTHONPATH=OLD_SRC and PYTHONPATH=NEW_SRC, ``--rounds`` times,
in alternating order (old first in even rounds, new first in odd ones) so that a drift of the machine's load
falls on both trees alike. Every run is its own process with the autotune cache off, so neither tree sees the
other's choices. Each run writes results.json; for every (layer, backend, task, dtype) the script takes the
ratio new / old of a metric within one round, then reports the median of those ratios over the rounds and their
spread (min..max), per row and as the geomean over rows. A geomean whose spread contains 1.0 is within noise.

Metrics (``--metric``): ``speedup`` (default) is each backend's speed-up over native (native's median time over
its own), measured in the same process, so a change of the machine's load between the two runs of a round cancels
(native's own rows are left out: they are 1.0 by definition); new/old above 1 is the new tree faster. ``median_ms``
compares times directly (native included; new/old below 1 is the new tree faster), which shows a change in native's
path too but carries the load drift.

Usage (arguments the script does not know go to ``convgrad bench``; the default is ``--suite smoke``)::

    git worktree add /tmp/old <old commit>
    python benchmarks/paired_trees.py /tmp/old/src src --rounds 5 -- --suite smoke --repeats 7
    python benchmarks/paired_trees.py /tmp/old/src src --rounds 3 --metric median_ms --backends fwdconv

The runs' results stay in ``--out`` (default: a temporary folder, removed afterwards).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

Key = tuple[str, str, str, str]  # (layer, backend, task, dtype)


def check_tree(src: Path) -> None:
    """Fail unless ``import convgrad`` with PYTHONPATH=src imports the copy under src (not the installed one)."""
    code = "import convgrad, sys; sys.stdout.write(convgrad.__file__)"
    path = subprocess.run([sys.executable, "-c", code], env=_env(src), capture_output=True, text=True, check=True)
    if not Path(path.stdout).resolve().is_relative_to(src.resolve()):
        raise SystemExit(f"paired_trees: PYTHONPATH={src} imports convgrad from {path.stdout}, not from that tree")


def _env(src: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(src.resolve()), CONVGRAD_AUTOTUNE_CACHE="off")


def run_bench(src: Path, out: Path, bench_args: list[str]) -> dict[Key, dict[str, float]]:
    """One ``convgrad bench`` process on the tree at src; its rows by key."""
    cmd = [sys.executable, "-m", "convgrad", "bench", *bench_args, "--quiet", "--out", str(out)]
    done = subprocess.run(cmd, env=_env(src), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"paired_trees: {' '.join(cmd)} with PYTHONPATH={src} failed ({done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    rows = json.loads((out / "results.json").read_text())["results"]
    return {(r["layer"], r["backend"], r["task"], r["dtype"]): r for r in rows}


_IQR = {"speedup": "speedup_iqr", "median_ms": "iqr_ms"}  # each metric's IQR over the bench's own repeats


def spreads(runs: list[dict[Key, dict[str, float]]], metric: str) -> dict[Key, float]:
    """The largest IQR / median of the metric over the bench's repeats within one run, per key (the noise a
    single run already shows)."""
    out: dict[Key, float] = {}
    for run in runs:
        for key, row in run.items():
            value, iqr = row.get(metric), row.get(_IQR[metric])
            if value and iqr is not None and math.isfinite(value) and math.isfinite(iqr):
                out[key] = max(out.get(key, 0.0), iqr / value)
    return out


def ratios(old: dict[Key, dict[str, float]], new: dict[Key, dict[str, float]], metric: str) -> dict[Key, float]:
    """new / old of the metric for every key both runs timed (native's rows left out for speedup)."""
    out = {}
    for key in old.keys() & new.keys():
        if metric == "speedup" and key[1] == "native":
            continue
        a, b = old[key].get(metric), new[key].get(metric)
        if a and b and math.isfinite(a) and math.isfinite(b):
            out[key] = b / a
    return out


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def report(rounds: list[dict[Key, float]], choices: dict[Key, set[str]], noise: dict[Key, float]) -> str:
    """Per-row median ratio and min..max over rounds, then the geomean per round and its median and spread."""
    keys = sorted(set().union(*rounds)) if rounds else []
    lines = [f"{'layer':<24} {'backend':<14} {'task':<12} {'dtype':<9} {'new/old':>8}  {'min..max over rounds':>20}"
             f"  {'IQR/median in a run':>19}"]
    for key in keys:
        vals = [r[key] for r in rounds if key in r]
        note = f"  auto chose {sorted(choices[key])}" if len(choices.get(key, ())) > 1 else ""
        lines.append(f"{key[0]:<24} {key[1]:<14} {key[2]:<12} {key[3]:<9} {statistics.median(vals):8.3f}  "
                     f"{min(vals):9.3f}..{max(vals):<9.3f}  {noise.get(key, float('nan')):18.0%}{note}")
    per_round = [geomean([r[k] for k in keys if k in r]) for r in rounds]
    lines.append("")
    lines.append("geomean new/old per round: " + " ".join(f"{g:.3f}" for g in per_round))
    if per_round:
        lo, hi = min(per_round), max(per_round)
        verdict = ("one round has no spread between rounds to judge by: run --rounds 3 or more" if len(per_round) == 1
                   else f"1.0 is {'within' if lo <= 1.0 <= hi else 'outside'} the spread between rounds")
        lines.append(f"geomean new/old: median {statistics.median(per_round):.3f}, min..max {lo:.3f}..{hi:.3f} "
                     f"over {len(per_round)} round(s), {len(keys)} rows; {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_src", type=Path, help="the old tree's src folder (the one holding convgrad/)")
    parser.add_argument("new_src", type=Path, help="the new tree's src folder")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds, each one run per tree (3)")
    parser.add_argument("--metric", choices=("speedup", "median_ms"), default="speedup",
                        help="what is compared (see the module doc; default speedup)")
    parser.add_argument("--out", type=Path, help="keep every run's results here (default: a temporary folder)")
    args, bench_args = parser.parse_known_args(argv)
    bench_args = [a for a in bench_args if a != "--"]
    if not any(a == "--suite" or a.startswith("--suite=") for a in bench_args):
        bench_args = ["--suite", "smoke", *bench_args]
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds} must be at least 1")
    if any(a in ("--out", "--quiet") or a.startswith("--out=") for a in bench_args):
        parser.error("--out and --quiet are set by paired_trees (use its own --out to keep the runs)")
    for src in (args.old_src, args.new_src):
        check_tree(src)
    out = args.out or Path(tempfile.mkdtemp(prefix="paired_trees_"))
    rounds: list[dict[Key, float]] = []
    choices: dict[Key, set[str]] = {}
    noise: dict[Key, float] = {}
    try:
        for i in range(args.rounds):
            order = [("old", args.old_src), ("new", args.new_src)]
            runs = {name: run_bench(src, out / f"round{i}_{name}", bench_args)
                    for name, src in (order if i % 2 == 0 else order[::-1])}
            rounds.append(ratios(runs["old"], runs["new"], args.metric))
            for key, v in spreads(list(runs.values()), args.metric).items():
                noise[key] = max(noise.get(key, 0.0), v)
            for run in runs.values():
                for key, row in run.items():
                    if row.get("auto_choice"):
                        choices.setdefault(key, set()).add(str(row["auto_choice"]))
            print(f"round {i + 1}/{args.rounds}: geomean new/old {geomean(list(rounds[-1].values())):.3f}",
                  file=sys.stderr, flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(out, ignore_errors=True)
    print(f"paired convgrad bench {' '.join(bench_args)}: old={args.old_src} new={args.new_src}, metric "
          f"{args.metric}, {args.rounds} round(s), order alternating")
    print(report(rounds, choices, noise))


if __name__ == "__main__":
    main()
