"""Per-sample gradients on one device: convgrad against torch.func and a plain backward, no other library.

The models and the contenders' steps are those of ``benchmarks/per_sample.py``; this script
runs them on the device it is given (CUDA by default) in one process, round-robin: each round
times one step of every contender (quantities a: all per-sample gradients, c: the clipped sum),
so load that comes and goes hits all of them alike. Reported: the median over rounds, its ratio
to the plain step of the same rounds, and the peak memory allocated on the device (CUDA only).

Usage (run by benchmarks/gpu_check.sh):
    PYTHONPATH=src python benchmarks/gpu_per_sample.py --out results/ --repeats 10
    PYTHONPATH=src python benchmarks/gpu_per_sample.py --device cpu --models resnet18 --batch 2 --image-size 8 \
        --repeats 1                                                                              # a quick check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.benchmark import Timer

sys.path.insert(0, str(Path(__file__).parent))
import per_sample as ps  # the model zoo and the contenders' steps

CONTENDERS = {k: ps.SETUPS[k] for k in ("plain", "convgrad", "torch.func")}  # no library to install


def _peak_mib(device: torch.device, step: Any, x: torch.Tensor, y: torch.Tensor) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step(x, y)
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**20


def run_model(name: str, device: torch.device, batch: int, repeats: int, size: int = 32) -> list[dict[str, Any]]:
    """Every (contender, quantity) of one model, timed in interleaved rounds after one warm-up step each."""
    gen = torch.Generator().manual_seed(0)
    channels, *spatial = ps.INPUT_SHAPES[name]  # one sample's shape; images are resized to size x size
    shape = (channels, size, size) if len(spatial) == 2 else (channels, *spatial)
    x = torch.randn(batch, *shape, generator=gen).to(device)
    y = torch.randint(0, ps.CLASSES, (batch,), generator=gen).to(device)
    steps, rows = {}, []
    for contender, setup in CONTENDERS.items():
        for quantity in ("a", "c"):
            if contender == "plain" and quantity == "c":
                continue
            torch.manual_seed(0)
            step = setup(ps.MODELS[name]().to(device), quantity)
            step(x, y)  # warm-up: tuning, allocator, kernels
            key = (contender, quantity)
            steps[key] = step
            rows.append({"model": name, "contender": contender, "batch": batch,
                         "quantity": None if contender == "plain" else quantity,
                         "device": str(device), "peak_mib": _peak_mib(device, step, x, y), "times_s": []})
    for _ in range(repeats):
        for row, step in zip(rows, steps.values(), strict=True):
            timer = Timer("step(x, y)", globals={"step": step, "x": x, "y": y})  # synchronises CUDA
            row["times_s"].append(timer.timeit(1).median)
    plain = statistics.median(rows[0]["times_s"])
    for row in rows:
        row["median_s"] = statistics.median(row["times_s"])
        row["x_plain"] = row["median_s"] / plain
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | contender | quantity | median step | × plain | peak memory |", "|---|---|---|---|---|---|"]
    for r in rows:
        mem = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f} MiB"
        what = ps.QUANTITIES[r["quantity"]] if r["quantity"] else "ordinary backward only"
        lines.append(f"| {r['model']} | {r['contender']} | {what} "
                     f"| {1e3 * r['median_s']:.2f} ms | {r['x_plain']:.2f} | {mem} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=sorted(ps.MODELS),
                   default=sorted(set(ps.MODELS) - set(ps.TIMM)))  # timm's only when named: timm may be missing
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--batch", type=int, default=ps.BATCH, help=f"samples per step (default {ps.BATCH})")
    p.add_argument("--repeats", type=int, default=10, help="interleaved rounds (default 10)")
    p.add_argument("--image-size", type=int, default=32, help="height and width of the inputs; vgg11 needs 32 "
                   "(default 32)")
    p.add_argument("--out", type=Path, default=None, help="folder for per_sample.json and per_sample.md")
    args = p.parse_args(argv)
    if min(args.repeats, args.batch, args.image_size) < 1:
        p.error(f"--repeats {args.repeats}, --batch {args.batch} and --image-size {args.image_size} must be at "
                f"least 1")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device!r} is not a device torch knows")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    rows = [r for m in args.models for r in run_model(m, device, args.batch, args.repeats, args.image_size)]
    table = markdown(rows)
    print(table, end="")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "per_sample.json").write_text(json.dumps(rows, indent=1))
        (args.out / "per_sample.md").write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
