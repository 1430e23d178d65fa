"""A training step of a small RepLKNet-style net (issue 28): plain torch against ``convgrad.patch``.

The net is ``per_sample_models.replknet_small(norm="batch")`` (a 3x3 stem, blocks of 31x31 depthwise + BatchNorm +
GELU + 1x1, batch 32 at 56x56 -> 28x28). After warm-up steps that let auto settle (tuning included in the first),
plain and patched steps alternate in rounds on two copies of the same net; each round's patched time is divided by
plain's (ratios, not absolute times: a shared machine is noisy). Peak memory: the bytes live in PyTorch's CPU
allocator during one step (the torch profiler's memory events). The DP side (per-sample norms, Opacus hooks and
ghost) runs through benchmarks/per_sample.py's ``--models replknet_small``.

    PYTHONPATH=src python benchmarks/large_kernel_step.py --threads 2 --repeats 5
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from large_kernels import peak_bytes
from per_sample_models import replknet_small

import convgrad as cg


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5, help="rounds of (plain, patched) steps (default 5)")
    p.add_argument("--warmup", type=int, default=12, help="patched steps before timing, for auto to settle")
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    plain = replknet_small(norm="batch")
    patched = cg.patch(copy.deepcopy(plain))
    x, y = torch.randn(args.batch, 3, 56, 56), torch.randint(0, 10, (args.batch,))
    steps = {"plain": _step(plain, x, y), "patch": _step(patched, x, y)}
    t0 = time.perf_counter()
    steps["patch"]()
    first = time.perf_counter() - t0
    for _ in range(args.warmup):
        steps["patch"]()
    steps["plain"]()
    ratios, times = [], {"plain": [], "patch": []}
    for _ in range(args.repeats):
        for name in ("plain", "patch"):
            t0 = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - t0)
        ratios.append(times["plain"][-1] / times["patch"][-1])
    peaks = {k: peak_bytes(f) / 2**20 for k, f in steps.items()}
    print(f"threads={args.threads} batch={args.batch}: plain step {statistics.median(times['plain']) * 1e3:.0f} ms, "
          f"patched {statistics.median(times['patch']) * 1e3:.0f} ms (first patched step, tuning included: "
          f"{first * 1e3:.0f} ms); patched x plain (median of {args.repeats} paired rounds): "
          f"{statistics.median(ratios):.2f}; peak allocated MiB plain {peaks['plain']:.0f}, "
          f"patched {peaks['patch']:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
