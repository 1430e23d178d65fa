"""Every fwdconv formulation, forced, against native on the layer suite: the data behind the plan rules.

For each layer, grad_input under each method of ``fwdconv.INPUT_METHODS`` (forward convs only) and
grad_weight under each of ``fwdconv.WEIGHT_METHODS`` are timed with torch.utils.benchmark, interleaved
with native, and printed as ratios to native (below 1: faster), next to the method the rules pick
(in brackets). Re-run it on a quiet machine to re-check the thresholds in backends/fwdconv/grad_input.py
(``SUBPIXEL_MAX_CHANNELS``, ``input_method``) and backends/fwdconv/grad_weight.py (``weight_method``).

    PYTHONPATH=src python benchmarks/fwdconv_methods.py --threads 2 --repeats 5
    PYTHONPATH=src python benchmarks/fwdconv_methods.py --layers 'resnet50.*' --dtype float64
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from fnmatch import fnmatch
from typing import Any

import torch
from torch.utils import benchmark

from convgrad.backends import get_backend
from convgrad.backends.fwdconv import INPUT_METHODS, WEIGHT_METHODS, execute, plan_input_grad, plan_weight_grad
from convgrad.cli.bench import keep_malloc
from convgrad.cli.bench.layers import SUITES, Layer
from convgrad.spec import ConvSpec


def _median_ratios(fns: dict[str, Callable[[], Any]], repeats: int, threads: int) -> dict[str, float]:
    timers = {k: benchmark.Timer("f()", globals={"f": f}, num_threads=threads) for k, f in fns.items()}
    for t in timers.values():
        t.timeit(1)  # warm-up: oneDNN primitives, plans
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, t in timers.items():
            samples[k].append(t.timeit(1).mean)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {k: v / med["native"] for k, v in med.items()} | {"native_ms": med["native"] * 1e3}


def _methods(spec: ConvSpec, t: dict[str, torch.Tensor]) -> tuple[dict[str, Callable[[], Any]], ...]:
    native = get_backend("native")
    x, w, gy = t["input"], t["weight"], t["grad_output"]
    gi: dict[str, Callable[[], Any]] = {"native": lambda: native.input_grad(spec, w, gy)}
    for m in () if spec.transposed else INPUT_METHODS:
        try:
            plan = plan_input_grad(spec, m)
        except ValueError:
            continue
        gi[m] = lambda plan=plan: execute(plan, gy, w)
    data, kernel = (gy, x) if spec.transposed else (x, gy)
    gw: dict[str, Callable[[], Any]] = {"native": lambda: native.weight_grad(spec, x, gy)}
    for m in WEIGHT_METHODS:
        try:
            plan = plan_weight_grad(spec, m)
        except ValueError:
            continue
        gw[m] = lambda plan=plan: execute(plan, data, kernel)
    return gi, gw


def _line(layer: Layer, gradient: str, chosen: str, ratios: dict[str, float]) -> str:
    cells = " ".join(f"{k}={v:.2f}" for k, v in ratios.items() if k not in ("native", "native_ms"))
    return f"{layer.name:24s} {gradient:11s} [{chosen}] {cells}  (native {ratios['native_ms']:.1f} ms)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", nargs="+", default=["*"], help="glob patterns of layer names")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--malloc", choices=["keep", "system"], default="keep", help="as in `convgrad bench`")
    args = parser.parse_args()
    if args.malloc == "keep":
        print(f"malloc: {keep_malloc()}")
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    for layer in SUITES["default"]:
        if not any(fnmatch(layer.name, p) for p in args.layers):
            continue
        spec = layer.spec()
        t = {k: torch.randn(shape, dtype=dtype) for k, shape in
             (("input", spec.input_shape), ("weight", spec.weight_shape), ("grad_output", spec.output_shape))}
        gi, gw = _methods(spec, t)
        if len(gi) > 1:
            print(_line(layer, "grad_input", plan_input_grad(spec).method, _median_ratios(gi, args.repeats,
                                                                                        args.threads)), flush=True)
        print(_line(layer, "grad_weight", plan_weight_grad(spec).method, _median_ratios(gw, args.repeats,
                                                                                      args.threads)), flush=True)


if __name__ == "__main__":
    main()
