"""The cost of auto's tuning: a training step's first call against a steady one, cold and with a warm cache.

Every run is a fresh process (tuning is remembered per process). Per model, float32:
    plain     torch alone, unpatched (its own first step pays oneDNN's first-call costs too)
    cold      ``convgrad.patch(model)``, auto tuning on first use, no cache file
    warm      the same with ``CONVGRAD_AUTOTUNE_CACHE`` naming a file that a previous run of 21 steps filled
    fixed     ``CONVGRAD_AUTOTUNE=fixed``: native kernels through convgrad, no tuning
Each reports its first step and the median of ``--steps`` steady steps after it; the extra cost of
tuning is a run's first step minus plain's first step. Models: ``resnet18`` (CIFAR ResNet-18 with
BatchNorm, batch 32, 32x32) and ``demo`` (the network of ``convgrad demo``, batch 64, 8x8).

CPU time (all threads) is reported beside wall time: on a machine shared with other work it is the
steadier measure of the work done, best with ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads then
sleep instead of spinning, which otherwise counts as CPU time and slows everything down).

``--paired N`` also compares steady steps within one process: the model under ``convgrad.patch``
(its choices settled by 30 warm-up steps) against an unpatched copy, N interleaved rounds, the
median of the per-round ratios and their IQR.

``--per-sample b|c`` times DP-SGD's per-sample step instead (benchmarks/per_sample.py's convgrad contender:
``PerSampleGrads`` over the model, then ``norms()`` (b) or ``clip_and_accumulate`` (c)) on
benchmarks/per_sample_models.py's models (GroupNorm; ``resnet18``, ``small_cnn``, ...; batch 32): "plain" is
that model's plain step, the other runs its per-sample step, whose first call tunes the per-sample methods. A cold
per-sample run also counts the race's whole-batch calls (option calls, Book-Keeping passes); ``--race`` lists each
tuning's choice (the method per layer shape) and its options' times over the fastest.

Usage:
    PYTHONPATH=src python benchmarks/first_step.py --threads 2 --paired 15
    PYTHONPATH=src python benchmarks/first_step.py --per-sample c --models resnet18 small_cnn --runs plain cold fixed
    PYTHONPATH=src python benchmarks/first_step.py --per-sample c --models resnet18 --runs cold --race
    PYTHONPATH=src python benchmarks/first_step.py --models demo --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RUNS = ("plain", "cold", "warm", "fixed")


class _Block(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def resnet18() -> nn.Module:
    """CIFAR ResNet-18: 3x3 stem, no max-pool, four stages of two basic blocks, BatchNorm."""
    layers: list[nn.Module] = [nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    c = 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_Block(c, c_out, stride), _Block(c_out, c_out, 1)]
        c = c_out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, 10)]
    return nn.Sequential(*layers)


def _setup(name: str) -> tuple[nn.Module, Any]:
    """The model and a function running one training step (forward, loss, backward, SGD update)."""
    torch.manual_seed(0)
    if name == "demo":
        from convgrad.cli import _demo_train as demo

        return _setup_for(name, demo.DigitsNet(nn))
    return _setup_for(name, resnet18())


def _per_sample_setup(name: str, run: str, quantity: str) -> tuple[nn.Module, Any]:
    """A step of per_sample_models' model: plain (run "plain") or convgrad's per-sample step for ``quantity``."""
    sys.path.insert(0, str(Path(__file__).parent))
    import per_sample
    import per_sample_models

    torch.manual_seed(0)
    model = per_sample_models.MODELS[name]()
    x, y = per_sample.data(name)
    setup = per_sample.setup_plain if run == "plain" else per_sample.setup_convgrad
    inner = setup(model, quantity)

    def step() -> None:
        per_sample._zero(model)
        inner(x, y)
    return model, step


def _count_option_calls() -> dict[str, int]:
    """Count the per-sample race's whole-batch calls (option calls, and Book-Keeping passes), by wrapping
    ``per_sample.tuning.options`` and ``book_keeping``: the evidence of what a tuning ran, steadier than a clock."""
    from convgrad.per_sample import tuning

    counts = {"option calls": 0, "book-keeping calls": 0}
    real_options, real_pass = tuning.options, tuning.book_keeping

    def options(*a: Any, **k: Any) -> dict[str, Any]:
        def counted(run: Any) -> Any:
            def call(n: int) -> Any:
                counts["option calls"] += 1
                return run(n)
            return call
        return {name: counted(run) for name, run in real_options(*a, **k).items()}

    def book_keeping(*a: Any) -> Any:
        counts["book-keeping calls"] += 1
        return real_pass(*a)

    tuning.options, tuning.book_keeping = options, book_keeping  # type: ignore[assignment]
    return counts


def _race_choices() -> list[str]:
    """Each per-sample tuning's key and choice: the method per layer shape, options timed, time over the fastest."""
    from convgrad.per_sample import tuning

    rows = []
    for (spec, purpose, *_), c in tuning._choices.items():
        best = min(c.times.values()) if c.times else 1.0
        ratios = " ".join(f"{n} {t / best:.2f}" for n, t in sorted(c.times.items(), key=lambda kv: kv[1]))
        rows.append(f"{purpose} x{spec.input_shape} w{spec.weight_shape} stride{spec.stride}: {c.backend} ({ratios})")
    return rows


def worker(name: str, run: str, steps: int, threads: int, per_sample: str | None = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    counts = _count_option_calls() if per_sample and run == "cold" else {}
    if per_sample:
        model, step = _per_sample_setup(name, run, per_sample)
    else:
        model, step = _setup(name)
    if run != "plain" and not per_sample:
        import convgrad as cg

        cg.patch(model)
    times, cpu = [], []
    for _ in range(steps + 1):
        start, start_cpu = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    out: dict[str, Any] = {"model": name, "run": run, "first_s": times[0], "steady_s": statistics.median(times[1:]),
                           "first_cpu_s": cpu[0], "steady_cpu_s": statistics.median(cpu[1:]), "threads": threads}
    if run in ("cold", "warm"):
        from convgrad.backends import auto
        from convgrad.per_sample import tuning

        out["tuned"] = len(tuning._choices) if per_sample else len(auto._choices)
        if per_sample:
            out["race"] = _race_choices()
    return {**out, **counts}


def paired(name: str, rounds: int, threads: int, warmup: int = 30) -> dict[str, Any]:
    """Steady steps of the patched model over plain torch's, interleaved in one process."""
    import copy

    import convgrad as cg

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, plain_step = _setup(name)
    twin = copy.deepcopy(model)
    _, patched_step = _setup_for(name, cg.patch(twin))
    for _ in range(warmup):  # tuning, then the comparisons that settle each choice
        patched_step()
    plain_step()
    ratios = []
    for r in range(rounds):
        order = (plain_step, patched_step) if r % 2 == 0 else (patched_step, plain_step)
        times = {}
        for fn in order:
            start = time.perf_counter()
            fn()
            times[fn] = time.perf_counter() - start
        ratios.append(times[patched_step] / times[plain_step])
    q = statistics.quantiles(ratios, n=4)
    return {"model": name, "ratio": statistics.median(ratios), "iqr": (q[0], q[2]), "rounds": rounds}


def _setup_for(name: str, model: nn.Module) -> tuple[nn.Module, Any]:
    """A training step of an existing model (as _setup builds it), with its own optimizer and the same data."""
    g = torch.Generator().manual_seed(0)
    if name == "demo":
        from convgrad.cli import _demo_train as demo

        x, y = torch.rand(demo.BATCH, 1, 8, 8, generator=g), torch.randint(0, 10, (demo.BATCH,), generator=g)
        loss = lambda: demo._loss(model, x, y)  # noqa: E731
    else:
        x, y = torch.randn(32, 3, 32, 32, generator=g), torch.randint(0, 10, (32,), generator=g)
        loss = lambda: F.cross_entropy(model(x), y)  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss().backward()
        opt.step()
    return model, step


def run_one(name: str, run: str, args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    env = {**os.environ, "CONVGRAD_AUTOTUNE_CACHE": "0", "CONVGRAD_AUTOTUNE": "tune"}
    if run == "warm":
        env["CONVGRAD_AUTOTUNE_CACHE"] = str(cache)
    if run == "fixed":
        env["CONVGRAD_AUTOTUNE"] = "fixed"
    cmd = [sys.executable, __file__, "--worker", name, run, "--steps", str(args.steps), "--threads", str(args.threads),
           *(["--per-sample", args.per_sample] if args.per_sample else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        return {"model": name, "run": run, "error": (proc.stderr.strip().splitlines() or ["(no output)"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["resnet18", "demo"],
                   help="resnet18, demo; with --per-sample: benchmarks/per_sample_models.py's names")
    p.add_argument("--per-sample", choices=("b", "c"), help="time the per-sample step: norms (b) or clipped sum (c)")
    p.add_argument("--runs", nargs="+", choices=RUNS, default=list(RUNS))
    p.add_argument("--steps", type=int, default=5, help="steady steps after the first (default 5)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--paired", type=int, default=0, metavar="N", help="also N paired rounds of steady steps")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "RUN"), help=argparse.SUPPRESS)
    p.add_argument("--paired-worker", metavar="MODEL", help=argparse.SUPPRESS)
    p.add_argument("--race", action="store_true", help="with --per-sample: list each per-sample tuning's choice and "
                   "its options' times over the fastest")
    args = p.parse_args(argv)
    known = ("resnet18", "demo") if not args.per_sample else None
    if known and not set(args.models) <= set(known):
        p.error(f"--models: choose from {known} (per-sample models need --per-sample)")
    if args.paired and args.per_sample:
        p.error("--paired compares the patched plain step; it does not combine with --per-sample")
    if args.worker:
        print(json.dumps(worker(*args.worker, args.steps, args.threads, args.per_sample)))
        return 0
    if args.paired_worker:
        print(json.dumps(paired(args.paired_worker, args.paired, args.threads)))
        return 0
    print("| model | run | first step (s) | steady step (s) | first - plain's first (s) | first step CPU (s) | "
          "steady step CPU (s) | first - plain's first, CPU (s) | configurations tuned | first - steady (s) | "
          "race option calls | race book-keeping calls |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp) / "autotune.json"
            if "warm" in args.runs:  # fill the cache file: a cold run that persists
                env = {**os.environ, "CONVGRAD_AUTOTUNE_CACHE": str(cache), "CONVGRAD_AUTOTUNE": "tune"}
                subprocess.run([sys.executable, __file__, "--worker", name, "cold", "--steps", "20", "--threads",
                                str(args.threads), *(["--per-sample", args.per_sample] if args.per_sample else [])],
                               capture_output=True, env=env, check=True, timeout=args.timeout)
            results = {run: run_one(name, run, args, cache) for run in args.runs}
        plain = results.get("plain", {})
        for run, r in results.items():
            if "error" in r:
                print(f"| {name} | {run} | error: {r['error']} | | | | | | | | | |")
                continue
            extra = f"{r['first_s'] - plain['first_s']:+.2f}" if "first_s" in plain else ""
            extra_cpu = f"{r['first_cpu_s'] - plain['first_cpu_s']:+.2f}" if "first_cpu_s" in plain else ""
            print(f"| {name} | {run} | {r['first_s']:.2f} | {r['steady_s']:.3f} | {extra} | {r['first_cpu_s']:.2f} | "
                  f"{r['steady_cpu_s']:.3f} | {extra_cpu} | {r.get('tuned', '')} | "
                  f"{r['first_s'] - r['steady_s']:+.2f} | {r.get('option calls', '')} | "
                  f"{r.get('book-keeping calls', '')} |")
        for run, r in results.items():
            for row in r.get("race", []) if args.race else []:
                print(f"    {name} {run}: {row}")
    for name in args.models if args.paired else ():
        env = {**os.environ, "CONVGRAD_AUTOTUNE_CACHE": "0", "CONVGRAD_AUTOTUNE": "tune"}
        proc = subprocess.run([sys.executable, __file__, "--paired-worker", name, "--paired", str(args.paired),
                               "--threads", str(args.threads)], capture_output=True, text=True, env=env,
                              timeout=args.timeout)
        if proc.returncode != 0:
            print(f"{name} paired: error: {(proc.stderr.strip().splitlines() or ['(no output)'])[-1]}")
            continue
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        print(f"{name}: steady step under convgrad.patch / plain torch = {r['ratio']:.3f} "
              f"(IQR {r['iqr'][0]:.3f}-{r['iqr'][1]:.3f}, {r['rounds']} paired rounds)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
