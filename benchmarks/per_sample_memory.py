"""Peak memory of per-sample norms of large-kernel layers against the layer's plain backward (issue 28, item 4).

Per layer, float32: the peak of live bytes in PyTorch's CPU allocator during one call (torch profiler memory events,
``large_kernels.peak_bytes``; the layer's input, weight and grad_output are allocated before and do not count) of

* the plain backward: native's grad_input and grad_weight (what a non-private step computes for the layer);
* per-sample norms, ``convgrad.per_sample_grad_norms`` by each method asked for (default "fft" and "auto");
* all per-sample weight gradients by "fft" (its result alone is N x weight).

and, computed from the shapes (not run: one sample's columns can exceed the machine), the im2col columns that
"unfold" and "ghost" copy per sample, against the input. Memory does not depend on the load, so these ratios are
facts of the method; the times beside them are one call each on whatever machine ran it (noisy).

    PYTHONPATH=src python benchmarks/per_sample_memory.py --threads 2
    PYTHONPATH=src python benchmarks/per_sample_memory.py --layers replknet.dw31 --methods fft  # one layer

Layers: RepLKNet-31B's 31x31 depthwise layer of ``convgrad bench --suite large`` (batch 4, 256 channels, 28x28),
replknet_small's (benchmarks/per_sample_models.py: batch 32, 64 channels, 28x28) and a 1d long depthwise conv.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from large_kernels import peak_bytes

import convgrad as cg
from convgrad.backends import auto, get_backend
from convgrad.spec import ConvSpec

# name: (input shape, weight shape, padding, groups)
LAYERS: dict[str, tuple[tuple[int, ...], tuple[int, ...], int, int]] = {
    "replknet.dw31": ((4, 256, 28, 28), (256, 1, 31, 31), 15, 256),
    "replknet_small.dw31": ((32, 64, 28, 28), (64, 1, 31, 31), 15, 64),
    "long1d.dw255": ((8, 128, 1024), (128, 1, 255), 127, 128),
}


def _seconds(f: Callable[[], object]) -> float:
    start = time.perf_counter()
    f()
    return time.perf_counter() - start


def measure(name: str, methods: list[str]) -> list[str]:
    """Markdown rows of one layer: each call's peak MiB, its ratio to the plain backward's, one call's time."""
    shape, weight, padding, groups = LAYERS[name]
    spec = ConvSpec.from_shapes(shape, weight, padding=padding, groups=groups)
    x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
    kw = dict(padding=padding, groups=groups)
    calls: dict[str, Callable[[], object]] = {
        "plain backward (native grad_input + grad_weight)": lambda: get_backend("native").gradients(
            spec, gy, x, w, True, True)}
    for m in methods:
        calls[f"per-sample norms, method={m}"] = lambda m=m: cg.per_sample_grad_norms(x, weight, gy, method=m, **kw)
    calls["per-sample weight gradients, method=fft"] = lambda: cg.per_sample_weight_grad(x, weight, gy, method="fft",
                                                                                         **kw)
    rows, plain = [], 0
    with auto.tuning_mode("tune"):
        for what, f in calls.items():
            f()  # auto's tuning and first-call costs happen here, before the measured calls
            seconds = _seconds(f)
            peak = peak_bytes(f)
            plain = plain or peak
            rows.append(f"| {name} | {what} | {peak / 2**20:.1f} | {peak / plain:.2f} | {seconds * 1e3:.0f} |")
            print(rows[-1], flush=True)
    columns = spec.x_channels * spec.taps * spec.positions * x.element_size()  # unfold/ghost's im2col, one sample
    rows.append(f"| {name} | im2col columns of one sample (unfold, ghost; computed, not run) | {columns / 2**20:.1f} | "
                f"{columns / plain:.2f} | |")
    print(rows[-1], flush=True)
    return rows


HEADER = ("| layer | call | peak MiB | x plain backward | one call ms (noisy) |\n"
          "|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS))
    p.add_argument("--methods", nargs="+", default=["fft", "auto"], help="per-sample norm methods (default fft auto)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, help="also write the table to this markdown file")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(HEADER, flush=True)
    lines = [HEADER] + [row for name in args.layers for row in measure(name, args.methods)]
    if args.out:
        args.out.write_text("`PYTHONPATH=src python benchmarks/per_sample_memory.py " + " ".join(argv or sys.argv[1:])
                            + "`\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
