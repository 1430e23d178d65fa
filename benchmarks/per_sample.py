"""Per-sample gradients on CPU: convgrad against Opacus, BackPACK, torch.func and a plain backward.

Models: a CIFAR-shaped ResNet-18 (GroupNorm, affine=False) and a VGG-11, batch 32,
32x32 inputs, float32. Quantities, one training step each:
    a  all per-sample gradients (N, *param.shape)
    b  per-sample gradient norms only (N,)
    c  one clipped, summed DP-SGD gradient (.grad = Σ_n clip(g_n, C))
Each (model, contender, quantity) runs in a fresh subprocess. Time is the median of
--repeats steps after one warm-up step; memory is ru_maxrss minus the RSS after the
model, the data and the contender's wrappers are set up (so it includes the warm-up).

Usage (extra libraries: benchmarks/requirements.txt, installed as in benchmarks/README.md):
    PYTHONPATH=src python benchmarks/per_sample.py                      # everything, 3 repeats
    PYTHONPATH=src python benchmarks/per_sample.py --models resnet18 --quantities a --repeats 1
Results go to benchmarks/results/per_sample.{json,md}.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

BATCH, CLASSES, MAX_NORM = 32, 10, 1.0
CONTENDERS = ["plain", "convgrad", "opacus", "backpack", "torch.func"]
QUANTITIES = {"a": "all per-sample gradients", "b": "per-sample norms only", "c": "clipped summed gradient"}


# ---- models ---------------------------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.gn1 = nn.GroupNorm(32, c_out, affine=False)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.gn2 = nn.GroupNorm(32, c_out, affine=False)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.GroupNorm(32, c_out, affine=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.gn1(self.conv1(x)))
        out = self.gn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


def resnet18() -> nn.Module:
    """CIFAR ResNet-18 (3x3 stem, no max-pool), GroupNorm(32) without affine parameters: 11.2M parameters."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.GroupNorm(32, 64, affine=False), nn.ReLU()]
    c = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(c, c_out, stride), BasicBlock(c_out, c_out, 1)]
        c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


def vgg11() -> nn.Module:
    """CIFAR VGG-11 (conv 3x3 + ReLU, five max-pools, one linear classifier): 9.2M parameters."""
    layers: list[nn.Module] = []
    c = 3
    for v in (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"):
        if v == "M":
            layers.append(nn.MaxPool2d(2))
        else:
            layers += [nn.Conv2d(c, int(v), 3, padding=1), nn.ReLU()]
            c = int(v)
    layers += [nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)


MODELS = {"resnet18": resnet18, "vgg11": vgg11}


# ---- contenders: setup(model) once, then step(x, y) per measured step ------------------------------------------
def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum")


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
        for attr in ("grad_sample", "grad_batch", "batch_l2"):
            if hasattr(p, attr):
                setattr(p, attr, None)


def _clip_sum(model: nn.Module, per_sample: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    norms = torch.stack([g.flatten(1).square().sum(1) for g in per_sample]).sum(0).sqrt()
    factors = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
    for p, g in zip(params, per_sample, strict=True):
        p.grad = torch.tensordot(factors, g, dims=1)


def setup_plain(model: nn.Module, quantity: str) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _zero(model)
        _loss(model(x), y).backward()
    return step


def setup_convgrad(model: nn.Module, quantity: str) -> Any:
    import convgrad as cg

    psg = cg.PerSampleGrads(model, loss_reduction="sum", norms_only=quantity != "a")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _zero(model)
        with psg:
            _loss(model(x), y).backward()
        if quantity == "b":
            psg.norms()
        elif quantity == "c":
            psg.clip_and_accumulate(MAX_NORM)
    return step


def setup_opacus(model: nn.Module, quantity: str) -> Any:
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", force_functorch=False)
    opt = DPOptimizer(torch.optim.SGD(gsm.parameters(), lr=0.0), noise_multiplier=0.0, max_grad_norm=MAX_NORM,
                      expected_batch_size=BATCH, loss_reduction="sum")
    params = [p for p in gsm.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        _loss(gsm(x), y).backward()
        if quantity == "b":
            torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
        elif quantity == "c":
            opt.clip_and_accumulate()  # Opacus's own per-sample clipping, into p.summed_grad
    return step


def setup_backpack(model: nn.Module, quantity: str) -> Any:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad, BatchL2Grad

    model = extend(model)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _zero(model)
        with backpack(BatchL2Grad() if quantity == "b" else BatchGrad()):
            _loss(model(x), y).backward()
        if quantity == "b":
            torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()
        elif quantity == "c":
            _clip_sum(model, [p.grad_batch for p in params], params)
    return step


def setup_torch_func(model: nn.Module, quantity: str) -> Any:
    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return _loss(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    live = dict(model.named_parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        _zero(model)
        grads = per_sample(params, x, y)
        if quantity == "b":
            torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        elif quantity == "c":
            _clip_sum(model, list(grads.values()), [live[k] for k in grads])
        else:
            for k, g in grads.items():
                live[k].grad_sample = g
    return step


SETUPS = {"plain": setup_plain, "convgrad": setup_convgrad, "opacus": setup_opacus, "backpack": setup_backpack,
          "torch.func": setup_torch_func}


# ---- one measurement, in this (fresh) process ------------------------------------------------------------------
def _rss_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def worker(model_name: str, contender: str, quantity: str, repeats: int, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = MODELS[model_name]()
    x, y = torch.randn(BATCH, 3, 32, 32), torch.randint(0, CLASSES, (BATCH,))
    step = SETUPS[contender](model, quantity)
    gc.collect()
    base = _rss_kib()
    times, cpu = [], []
    for _ in range(repeats + 1):  # the first step warms up and is not timed
        t0, c0 = time.perf_counter(), time.process_time()
        step(x, y)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"model": model_name, "contender": contender, "quantity": quantity, "time_s": statistics.median(times[1:]),
            "times_s": times[1:], "cpu_s": statistics.median(cpu[1:]), "peak_mib": (peak - base) / 1024,
            "threads": threads, "torch": torch.__version__}


# ---- driver ------------------------------------------------------------------------------------------------------
def run_one(args: argparse.Namespace, model: str, contender: str, quantity: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", model, contender, quantity, "--repeats", str(args.repeats),
           "--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        err = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"model": model, "contender": contender, "quantity": quantity, "error": err}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| model | quantity | contender | time (s) | CPU time (s) | peak memory (MiB) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['quantity']} | {r['contender']} | error: {r['error']} | | |")
        else:
            lines.append(f"| {r['model']} | {r['quantity']} | {r['contender']} | {r['time_s']:.2f} | "
                         f"{r['cpu_s']:.2f} | {r['peak_mib']:.0f} |")
    return "\n".join(lines)


def targets(results: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, checked per model."""
    ok = {(r["model"], r["contender"], r["quantity"]): r for r in results if "error" not in r}
    out = []
    for m in sorted({r["model"] for r in results}):
        def get(c: str, q: str, key: str, m: str = m) -> float | None:
            r = ok.get((m, c, q))
            return None if r is None else r[key]

        ours_t, ours_m = get("convgrad", "a", "time_s"), get("convgrad", "a", "peak_mib")
        for c, factor in (("opacus", 1.5), ("backpack", 2.0), ("torch.func", 1.2)):
            t = get(c, "a", "time_s")
            if ours_t and t:
                out.append(f"{m} (a) vs {c}: {t / ours_t:.2f}x faster (target >= {factor}x)")
        mems = [v for c in ("opacus", "backpack", "torch.func") if (v := get(c, "a", "peak_mib")) is not None]
        if ours_m is not None and mems:
            out.append(f"{m} (a) memory: {ours_m:.0f} MiB, lowest other {min(mems):.0f} MiB (target <=)")
        bm, bt = get("convgrad", "b", "peak_mib"), get("convgrad", "b", "time_s")
        if ours_m and bm and ours_t and bt:
            out.append(f"{m} (b): {ours_m / max(bm, 1e-9):.1f}x less memory than (a) (target >= 3x), "
                       f"time {bt:.2f}s vs (a) {ours_t:.2f}s (target <=)")
        ct, pt = get("convgrad", "c", "time_s"), get("plain", "c", "time_s")
        if ct and pt:
            out.append(f"{m} (c): {ct / pt:.2f}x the plain backward's time (target <= 2.5x)")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    p.add_argument("--quantities", nargs="+", choices=list(QUANTITIES), default=list(QUANTITIES))
    p.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up step (default 3)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per subprocess (default 900)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_sample")
    p.add_argument("--worker", nargs=3, metavar=("MODEL", "CONTENDER", "QUANTITY"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.repeats, args.threads)))
        return 0
    from rich.console import Console
    from rich.progress import track

    jobs = [(m, c, q) for m in args.models for q in args.quantities for c in args.contenders
            if not (c == "plain" and q != args.quantities[0])]  # the floor is the same step for every quantity
    args.out.parent.mkdir(parents=True, exist_ok=True)
    console, results = Console(), []
    for job in track(jobs, description="per-sample benchmark", console=console):
        r = run_one(args, *job)
        console.print(r if "error" in r else {k: r[k] for k in ("model", "contender", "quantity", "time_s", "cpu_s",
                                                               "peak_mib")})
        results.append(r)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # partial results survive
    floors = [r for r in results if r["contender"] == "plain"]  # the plain backward is the floor of every quantity
    results += [{**r, "quantity": q} for r in floors for q in args.quantities if q != r["quantity"]]
    results.sort(key=lambda r: (r["model"], r["quantity"], CONTENDERS.index(r["contender"])))
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    md = markdown(results) + "\n\n" + "\n".join(f"- {t}" for t in targets(results)) + "\n"
    args.out.with_suffix(".md").write_text(md)
    console.print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
