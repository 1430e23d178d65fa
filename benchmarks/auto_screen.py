"""How well a sub-batch ranks auto's options: the data behind ``convgrad.tuning``'s screening rule.

auto screens its options on a slice of the batch before it times the survivors on the whole
batch (``convgrad.tuning.tuner``). That is safe only if an option that is much slower
than the best on the slice is not close to the best on the whole batch. This script times every
backend's grad_input, grad_weight and both gradients at the full batch and at the screening
batch, interleaved in rounds, on the layers of ``convgrad bench`` and the convolutions of a CIFAR
ResNet-18 at batch 32, and reports for every (layer, gradient, backend):

- ``screen``: its time over the best option's at the screening batch, from the first round alone
  (what one screening sees: a warm-up call, then one timed call);
- ``full``: the same ratio at the full batch, median over the rounds.

Then, for a range of drop factors D, it counts the options a screening with D would have dropped
although at the full batch they were within ``PREFER_NATIVE`` of the best (the rule's misses),
and the share of options it drops.

Usage:
    PYTHONPATH=src python benchmarks/auto_screen.py --threads 2 --rounds 5
    PYTHONPATH=src python benchmarks/auto_screen.py --layers 'resnet18*' --rounds 3
Results go to benchmarks/results/auto_screen.json (raw times) and print as a table.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from convgrad.backends import backend_names, get_backend
from convgrad.cli.bench.layers import SUITES, Layer, _conv
from convgrad.spec import ConvSpec
from convgrad.tuning import PREFER_NATIVE, screen_batch

BACKENDS = [b for b in ("native", "fwdconv", "gemm") if b in backend_names()]
TASKS = ("grad_input", "grad_weight", "both")
_R18 = "ResNet-18 (CIFAR)"
RESNET18 = (
    _conv("resnet18.stem", _R18, "conv1", 32, 3, 64, 32, 3, padding=1),
    _conv("resnet18.64@32", _R18, "layer1", 32, 64, 64, 32, 3, padding=1),
    _conv("resnet18.64-128s2", _R18, "layer2.0 conv1", 32, 64, 128, 32, 3, stride=2, padding=1),
    _conv("resnet18.128@16", _R18, "layer2", 32, 128, 128, 16, 3, padding=1),
    _conv("resnet18.1x1s2@32", _R18, "layer2.0 shortcut", 32, 64, 128, 32, 1, stride=2),
    _conv("resnet18.256@8", _R18, "layer3", 32, 256, 256, 8, 3, padding=1),
    _conv("resnet18.512@4", _R18, "layer4", 32, 512, 512, 4, 3, padding=1),
    _conv("resnet18.256-512s2", _R18, "layer4.0 conv1", 32, 256, 512, 8, 3, stride=2, padding=1),
)


def _calls(spec: ConvSpec, t: dict[str, torch.Tensor], n: int) -> dict[tuple[str, str], Any]:
    x, w, gy = t["input"][:n], t["weight"], t["grad_output"][:n]
    s = spec.with_batch(n)
    out = {}
    for name in BACKENDS:
        b = get_backend(name)
        out[(name, "grad_input")] = lambda b=b: b.input_grad(s, w, gy)
        out[(name, "grad_weight")] = lambda b=b: b.weight_grad(s, x, gy)
        out[(name, "both")] = lambda b=b: b.backward(s, gy, x, w, True, True)
    return out


def _time(fn: Any) -> float:
    fn()  # warm-up: the same option's previous call, as the tuner does
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(layer: Layer, rounds: int) -> dict[str, Any]:
    spec = layer.spec()
    g = torch.Generator().manual_seed(0)
    t = {k: torch.randn(shape, generator=g) for k, shape in
         (("input", spec.input_shape), ("weight", spec.weight_shape), ("grad_output", spec.output_shape))}
    sub = screen_batch(spec.batch)
    sizes = {"full": spec.batch, "screen": sub}
    fns = {(size, *key): fn for size, n in sizes.items() for key, fn in _calls(spec, t, n).items()}
    times: dict[str, list[float]] = {"|".join(k): [] for k in fns}
    keys = list(fns)
    with torch.no_grad():
        for r in range(rounds):
            for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                times["|".join(k)].append(_time(fns[k]))
    return {"layer": layer.name, "batch": spec.batch, "screen_batch": sub, "times": times}


def _ratios(rec: dict[str, Any], size: str, task: str, first_only: bool) -> dict[str, float]:
    pick = (lambda s: s[0]) if first_only else statistics.median
    t = {b: pick(rec["times"][f"{size}|{b}|{task}"]) for b in BACKENDS}
    best = min(t.values())
    return {b: v / best for b, v in t.items()}


def report(records: list[dict[str, Any]], drops: tuple[float, ...]) -> str:
    lines = ["| layer | N / screen | gradient | " + " | ".join(f"{b} screen / full" for b in BACKENDS) + " |",
             "|---|---|---|" + "---|" * len(BACKENDS)]
    pairs = []
    for rec in records:
        for task in TASKS:
            screen, full = _ratios(rec, "screen", task, True), _ratios(rec, "full", task, False)
            pairs += [(rec["layer"], task, b, screen[b], full[b]) for b in BACKENDS]
            cells = " | ".join(f"{screen[b]:.2f} / {full[b]:.2f}" for b in BACKENDS)
            lines.append(f"| {rec['layer']} | {rec['batch']} / {rec['screen_batch']} | {task} | {cells} |")
    lines.append("")
    for d in drops:
        dropped = [p for p in pairs if p[3] > d]
        misses = [p for p in dropped if p[4] <= PREFER_NATIVE]
        lines.append(f"drop factor {d:.2f}: drops {len(dropped)}/{len(pairs)} options, misses {len(misses)}"
                     + "".join(f"\n    miss: {m[0]} {m[1]} {m[2]} screen {m[3]:.2f} full {m[4]:.2f}" for m in misses))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", default=["*"], help="glob patterns of layer names (default: all)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "auto_screen.json")
    p.add_argument("--report", type=Path, help="only print the report of an earlier --out file")
    args = p.parse_args(argv)
    drops = (1.2, 1.3, 1.5, 1.75, 2.0, 2.5, 3.0)
    if args.report:
        print(report(json.loads(args.report.read_text()), drops))
        return 0
    torch.set_num_threads(args.threads)
    layers = [la for la in (*SUITES["default"], *RESNET18) if any(fnmatch.fnmatch(la.name, g) for g in args.layers)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for layer in layers:
        records.append(measure(layer, args.rounds))
        args.out.write_text(json.dumps(records, indent=1))
        print(f"{layer.name} done", file=sys.stderr, flush=True)
    print(report(records, drops))
    return 0


if __name__ == "__main__":
    sys.exit(main())
