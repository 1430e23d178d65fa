"""Backends against native on a small layer suite: time ratios and peak memory.

For each layer and dtype, one backward (grad_input and grad_weight together,
``Backend.backward``) is timed for native and every other backend with
torch.utils.benchmark, in interleaved rounds of the same run; the ratio is the
median time over native's median time. Memory: each (layer, dtype, backend) runs
once in a fresh subprocess, after a warm-up call on a tiny version of the layer
(which loads code and initialises thread pools), which resets the peak RSS (``echo 5 >
/proc/self/clear_refs``) and reports the peak (VmHWM) after the call minus the RSS
(VmRSS) just before it: the peak extra resident memory of one backward, result
tensors included (Linux only).

Threads are set explicitly: torch.set_num_threads(--threads) and threadpoolctl for
NumPy's BLAS; both, the BLAS kernel threadpoolctl reports and the OPENBLAS_*
variables are recorded. Those variables slow a current NumPy where they are set;
to time NumPy fairly, unset them for this one command:

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE PYTHONPATH=src python benchmarks/backends.py
    PYTHONPATH=src python benchmarks/backends.py --quick          # about a minute: validates the harness
    PYTHONPATH=src python benchmarks/backends.py --threads 1 --cpu-time   # a busy machine: 1 thread, CPU time

A busy machine makes 2-thread wall times meaningless, for gemm above all: every OpenMP
parallel region then waits for a time slice, and gemm runs some hundred regions per
backward (chunks x taps) where native runs a few.

The suite reuses the layers of convgrad.cli.bench.layers (the speed work's suite) when that
module exists, otherwise the same shapes defined here. Results go to
benchmarks/results/backends.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.utils.benchmark as tb
from threadpoolctl import threadpool_info, threadpool_limits

from convgrad.backends import backend_names, get_backend
from convgrad.spec import ConvSpec

# name -> (kind, input_shape, weight_shape, kwargs); kind "dense" or "depthwise"
FALLBACK: dict[str, tuple[str, tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "resnet50.3x3@56": ("dense", (8, 64, 56, 56), (64, 64, 3, 3), {"padding": 1}),
    "resnet50.1x1reduce": ("dense", (8, 256, 56, 56), (64, 256, 1, 1), {}),
    "resnet50.3x3s2": ("dense", (8, 128, 56, 56), (128, 128, 3, 3), {"stride": 2, "padding": 1}),
    "mobilenetv2.dw3x3": ("depthwise", (16, 144, 56, 56), (144, 1, 3, 3), {"padding": 1, "groups": 144}),
    "wav2vec2.k3s2": ("dense", (2, 512, 3199), (512, 512, 3), {"stride": 2}),
    "r3d18.3x3x3": ("dense", (2, 128, 8, 28, 28), (128, 128, 3, 3, 3), {"padding": 1}),
}
QUICK = {  # tiny shapes for --quick: same kinds of layer, milliseconds each
    "resnet50.3x3@56": ("dense", (2, 16, 28, 28), (16, 16, 3, 3), {"padding": 1}),
    "mobilenetv2.dw3x3": ("depthwise", (2, 32, 28, 28), (32, 1, 3, 3), {"padding": 1, "groups": 32}),
    "wav2vec2.k3s2": ("dense", (2, 64, 400), (64, 64, 3), {"stride": 2}),
}
MIB = 2**20


def suite(quick: bool) -> dict[str, tuple[str, ConvSpec]]:
    """name -> (kind, spec); the speed work's layer definitions when present, else FALLBACK."""
    if quick:
        return {n: (k, ConvSpec.from_shapes(i, w, **kw)) for n, (k, i, w, kw) in QUICK.items()}
    try:
        from convgrad.cli.bench.layers import SUITES
    except ImportError:
        return {n: (k, ConvSpec.from_shapes(i, w, **kw)) for n, (k, i, w, kw) in FALLBACK.items()}
    named = {layer.name: layer for layer in SUITES["default"]}
    return {n: (k, named[n].spec() if n in named else ConvSpec.from_shapes(i, w, **kw))
            for n, (k, i, w, kw) in FALLBACK.items()}


def tensors(spec: ConvSpec, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g, dtype=dtype) for s in  # type: ignore[return-value]
                 (spec.output_shape, spec.input_shape, spec.weight_shape))


def time_layer(spec: ConvSpec, dtype: torch.dtype, backends: list[str], rounds: int, min_time: float,
               threads: int, cpu_time: bool) -> dict[str, float]:
    """Median seconds of one backward per backend, the backends interleaved in each round."""
    gy, x, w = tensors(spec, dtype)
    samples: dict[str, list[float]] = {b: [] for b in backends}
    clock = {"timer": time.process_time} if cpu_time else {}
    for _ in range(rounds):
        for name in backends:
            timer = tb.Timer("b.backward(spec, gy, x, w, True, True)", num_threads=threads, **clock,
                             globals={"b": get_backend(name), "spec": spec, "gy": gy, "x": x, "w": w})
            samples[name].append(timer.blocked_autorange(min_run_time=min_time).median)
    return {b: statistics.median(v) for b, v in samples.items()}


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # reported in kB


def _tiny(spec: ConvSpec) -> ConvSpec:
    """The same convolution with batch 1 and the smallest valid spatial size, for a warm-up call."""
    size = (1,) * spec.n if spec.transposed else spec.kernel_extent
    return ConvSpec.from_shapes((1, spec.in_channels, *size), spec.weight_shape, spec.stride, spec.padding,
                                spec.dilation, spec.transposed, spec.output_padding, spec.groups)


def memory_child(spec_args: str, dtype: str, backend: str, threads: int) -> None:
    """In a fresh process: peak extra resident bytes of one backward, printed as JSON."""
    torch.set_num_threads(threads)
    threadpool_limits(threads)
    spec = ConvSpec.from_shapes(**json.loads(spec_args))
    b = get_backend(backend)
    b.backward(tiny := _tiny(spec), *tensors(tiny, getattr(torch, dtype)), True, True)  # loads code, inits pools
    gy, x, w = tensors(spec, getattr(torch, dtype))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets the peak RSS (VmHWM) to the current RSS, so the imports' peak does not count
    base = _status_bytes("VmRSS")
    grads = b.backward(spec, gy, x, w, True, True)
    peak = _status_bytes("VmHWM")
    print(json.dumps({"extra": peak - base, "results": sum(t.numel() * t.element_size() for t in grads
                                                           if t is not None)}))


def measure_memory(spec: ConvSpec, dtype: str, backend: str, threads: int) -> dict[str, Any]:
    args = json.dumps({"input_shape": spec.input_shape, "weight_shape": spec.weight_shape, "stride": spec.stride,
                       "padding": [list(p) for p in spec.padding], "dilation": spec.dilation,
                       "transposed": spec.transposed, "output_padding": spec.output_padding,
                       "groups": spec.groups})
    out = subprocess.run([sys.executable, __file__, "--memory-child", args, dtype, backend, str(threads)],
                         capture_output=True, text=True, check=True, env=os.environ.copy())
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def environment(threads: int) -> dict[str, Any]:
    return {
        "cpu": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "blas_threads": threads,
        "torch_blas": "MKL" if torch.backends.mkl.is_available() else "other",
        "onednn": torch.backends.mkldnn.is_available(),
        "threadpools": [{k: i.get(k) for k in ("user_api", "internal_api", "version", "architecture", "num_threads",
                                               "filepath")} for i in threadpool_info()],
        "OPENBLAS_CORETYPE": os.environ.get("OPENBLAS_CORETYPE"),
        "OPENBLAS_L2_SIZE": os.environ.get("OPENBLAS_L2_SIZE"),
        "memory_method": ("fresh subprocess per (layer, dtype, backend): VmHWM after one backward (peak reset by "
                          "/proc/self/clear_refs) minus VmRSS before it"),
    }


def geomeans(rows: list[dict[str, Any]], backends: list[str]) -> list[dict[str, Any]]:
    out = []
    for dtype in sorted({r["dtype"] for r in rows}):
        for kind in ("dense", "depthwise"):
            sel = [r for r in rows if r["dtype"] == dtype and r["kind"] == kind]
            for b in backends:
                if b != "native" and sel:
                    gm = math.exp(statistics.fmean(math.log(r["ratio"][b]) for r in sel))
                    out.append({"dtype": dtype, "kind": kind, "backend": b, "geomean_ratio": gm})
    return out


def markdown(rows: list[dict[str, Any]], summary: list[dict[str, Any]], env: dict[str, Any],
             backends: list[str], cap: int) -> str:
    others = [b for b in backends if b != "native"]
    head = ["layer", "dtype", "native ms", *(f"{b} / native" for b in others), "native MiB", "gemm MiB"]
    lines = ["# Backends against native", "", f"Environment: `{json.dumps(env)}`", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        mem = r.get("memory", {})
        nat, gem = (mem.get(b, {}).get("extra") for b in ("native", "gemm"))
        cells = [r["layer"], r["dtype"], f"{r['seconds']['native'] * 1e3:.1f}",
                 *(f"{r['ratio'][b]:.2f}x" for b in others),
                 "" if nat is None else f"{nat / MIB:.0f}", "" if gem is None else f"{gem / MIB:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "| dtype | layers | backend | geomean ratio |", "|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['dtype']} | {s['kind']} | {s['backend']} | {s['geomean_ratio']:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2, help="torch and BLAS threads (default 2)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "float64"], choices=["float32", "float64"])
    p.add_argument("--backends", nargs="+", default=[b for b in ("gemm", "numpy", "fwdconv") if b in backend_names()])
    p.add_argument("--layers", nargs="+", help="only these layer names")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians over them (default 5)")
    p.add_argument("--min-time", type=float, default=0.5, help="seconds per blocked_autorange (default 0.5)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time with process CPU time instead of wall time; only with --threads 1 (on a busy "
                        "machine it ignores waiting for a core; with more threads it would count spinning)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--quick", action="store_true", help="tiny layers, 1 round, 0.05 s: validates the harness")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    p.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        spec_args, dtype, backend, threads = args.memory_child
        memory_child(spec_args, dtype, backend, int(threads))
        return 0
    if args.cpu_time and args.threads != 1:
        p.error(f"--cpu-time needs --threads 1, got --threads {args.threads}")
    if args.quick:
        args.rounds, args.min_time = 1, 0.05
    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    backends = ["native", *args.backends]
    layers = suite(args.quick)
    if args.layers:
        layers = {n: v for n, v in layers.items() if n in args.layers}
    cap = get_backend("gemm").max_workspace_bytes if "gemm" in backend_names() else 0
    rows = []
    for name, (kind, spec) in layers.items():
        for dtype in args.dtypes:
            secs = time_layer(spec, getattr(torch, dtype), backends, args.rounds, args.min_time, args.threads,
                              args.cpu_time)
            row = {"layer": name, "kind": kind, "dtype": dtype, "config": spec.describe(), "seconds": secs,
                   "ratio": {b: secs[b] / secs["native"] for b in backends}}
            if not args.no_memory:
                row["memory"] = {b: measure_memory(spec, dtype, b, args.threads) for b in ("native", "gemm", "numpy")
                                 if b in backends}
            rows.append(row)
            ratios = " ".join(f"{b} {row['ratio'][b]:.2f}x" for b in backends[1:])
            print(f"{name:20s} {dtype}  native {secs['native'] * 1e3:8.2f} ms  {ratios}", flush=True)
    env = {**environment(args.threads), "clock": "process CPU time" if args.cpu_time else "wall time",
           "rounds": args.rounds, "min_time_s": args.min_time}
    summary = geomeans(rows, backends)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "backends.json").write_text(json.dumps({"environment": env, "rows": rows, "summary": summary,
                                                        "workspace_cap": cap}, indent=1))
    (args.out / "backends.md").write_text(markdown(rows, summary, env, backends, cap))
    print(markdown(rows, summary, env, backends, cap)[-1500:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
