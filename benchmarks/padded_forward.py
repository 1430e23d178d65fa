"""Where torch's CPU forward is faster on an input padded beforehand (zero padding) than with its own padding.

For each layer (depthwise, grouped with 4, 8 or 16 channels per group, dense; k in {5, 7, 9, 13, 17, 31},
p = k//2, a few sizes; 1d, 2d, 3d; a few non-square kernels; then stride, dilation, asymmetric pads, dtypes,
channels last), float32 unless named, one thread: convgrad's native forward (``aten.convolution(x, w, padding=p)``)
against ``fwdconv.padded_forward`` (``aten.convolution(pad(x, p), w, padding=0)``, "padded"), in one process,
interleaved, CPU time of this thread (``time.thread_time``). Reports the medians in ms, their ratio (native /
padded: > 1 means the padded forward is faster) and the oneDNN implementation each one ran (from oneDNN's verbose
log; "-": none), which explains the cut: on this AVX2 machine oneDNN's jit depthwise kernel (``jit_dw``) refuses
a padding of 5 or more in the last (width) dim, its direct kernel for 8 or more channels per group (``jit:avx2``)
one of 4 or more, and the layer then runs oneDNN's im2col + gemm convolution (``x64:gemm:jit``), several times
slower on large kernels; on the padded input (padding 0) the jit kernel runs.

``--suites large all`` times the forward layers of those ``convgrad bench`` suites instead, each named with what
the rule (``fwdconv.worth_padding``) says of it.

Usage (results/padded_forward.md was made by the first, then the second appended):
    PYTHONPATH=src python benchmarks/padded_forward.py --out benchmarks/results/padded_forward.md
    PYTHONPATH=src python benchmarks/padded_forward.py --suites large all --budget 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from convgrad.backends.fwdconv import padded_forward, worth_padding
from convgrad.backends.native import forward as native_forward
from convgrad.cli.bench.layers import SUITES
from convgrad.spec import ConvSpec


@dataclass(frozen=True)
class Config:
    kind: str
    input: tuple[int, ...]
    weight: tuple[int, ...]
    groups: int
    padding: tuple[tuple[int, int], ...] | None = None  # None: k//2 on both sides
    stride: int = 1
    dilation: int = 1
    dtype: torch.dtype = torch.float32
    channels_last: bool = False
    layer: ConvSpec | None = None  # a bench layer's own spec

    def spec(self) -> ConvSpec:
        if self.layer is not None:
            return self.layer
        pads = self.padding or tuple((k // 2, k // 2) for k in self.weight[2:])
        return ConvSpec.from_shapes(self.input, self.weight, self.stride, pads, self.dilation, groups=self.groups)


def configs() -> Iterator[Config]:
    """The sweep: depthwise and 4-per-group layers, square kernels with p = k//2, and a few non-square ones; then
    the edges of the cut (stride, dilation, a channel multiplier, asymmetric pads, dtypes, channels last)."""
    for k in (5, 7, 9, 13, 17, 31):
        for size in (14, 28, 56):
            yield Config("2d dw", (2, 32, size, size), (32, 1, k, k), 32)
            if size <= 28:
                yield Config("2d g4", (2, 32, size, size), (32, 4, k, k), 8)
            if size <= 28 and k <= 17:
                yield Config("2d g8", (2, 32, size, size), (32, 8, k, k), 4)
                yield Config("2d dense", (2, 16, size, size), (16, 16, k, k), 1)
        for length in (500, 4000):
            yield Config("1d dw", (2, 64, length), (64, 1, k), 64)
            yield Config("1d g4", (2, 64, length), (64, 4, k), 16)
            yield Config("1d g16", (2, 64, length), (64, 16, k), 4)
        if k <= 13:
            for size in (12, 24):
                yield Config("3d dw", (1, 16, size, size, size), (16, 1, k, k, k), 16)
    for kernel in ((51, 5), (5, 51), (31, 5), (5, 31), (13, 3), (3, 13)):
        yield Config("2d dw", (2, 32, 56, 56), (32, 1, *kernel), 32)
    x, dw = (2, 32, 28, 28), (32, 1, 13, 13)
    yield Config("2d dw batch 1", (1, 32, 28, 28), dw, 32)
    yield Config("2d dw stride 2", x, dw, 32, stride=2)
    yield Config("2d dw dilation 2", x, (32, 1, 7, 7), 32, dilation=2)
    yield Config("2d dw x2 multiplier", x, (64, 1, 13, 13), 32)
    for pads in (((6, 6), (5, 4)), ((6, 6), (4, 5)), ((6, 6), (5, 5)), ((6, 6), (6, 5))):
        yield Config("2d dw asymmetric", x, (32, 1, 13, 12), 32, padding=pads)
    yield Config("2d dw 11x11 p5", x, (32, 1, 11, 11), 32)
    yield Config("2d dw channels last", x, dw, 32, channels_last=True)
    yield Config("2d dw bfloat16", x, dw, 32, dtype=torch.bfloat16)
    yield Config("2d dw float64", x, dw, 32, dtype=torch.float64)
    for kernel, pads in (((9, 3), ((4, 4), (1, 1))), ((3, 9), ((1, 1), (4, 4))), ((9, 9), ((4, 4), (3, 3)))):
        yield Config("2d g8 non-square", x, (32, 8, *kernel), 4, padding=pads)
    yield Config("2d g8 channels last", x, (32, 8, 13, 13), 4, channels_last=True)
    yield Config("2d g8 float64", x, (32, 8, 13, 13), 4, dtype=torch.float64)
    yield Config("3d dense", (1, 16, 16, 16, 16), (16, 16, 9, 9, 9), 1)


def bench_layers(suites: list[str]) -> Iterator[Config]:
    """The forward layers of ``convgrad bench``'s suites, named with what ``worth_padding`` says of them."""
    for suite in suites:
        for layer in SUITES[suite]:
            spec = layer.spec()
            if not spec.transposed:
                admitted = worth_padding(spec, torch.empty(0))
                yield Config(f"{layer.name} ({'admitted' if admitted else 'refused'})", layer.input_shape,
                             layer.weight_shape, spec.groups, layer=spec)


def onednn_impl(call: Callable[[], object]) -> str:
    """The implementation oneDNN ran for the convolution in ``call`` ("-" where no oneDNN primitive ran)."""
    with tempfile.TemporaryFile(mode="w+") as log:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(log.fileno(), 1)  # oneDNN writes its verbose log to the C stdout
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                call()
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        impls = [line.split(",")[6] for line in log if ",primitive,exec,cpu,convolution," in line]
    return impls[-1] if impls else "-"


def timed(call: Callable[[], object]) -> float:
    start = time.thread_time()
    call()
    return time.thread_time() - start


def measure(config: Config, budget: float) -> dict[str, object]:
    spec = config.spec()
    x, w = torch.randn(config.input, dtype=config.dtype), torch.randn(config.weight, dtype=config.dtype)
    if config.channels_last:
        x, w = x.to(memory_format=torch.channels_last), w.to(memory_format=torch.channels_last)
    native = lambda: native_forward(spec, x, w, None)  # noqa: E731
    padded = lambda: padded_forward(spec, x, w)  # noqa: E731
    impls = onednn_impl(native), onednn_impl(padded)
    times: dict[str, list[float]] = {"native": [], "padded": []}
    spent, rounds = 0.0, 0
    while rounds < 3 or (spent < budget and rounds < 15):  # interleaved: a drift of the machine hits both alike
        for name, call in (("native", native), ("padded", padded)):
            t = timed(call)
            times[name].append(t)
            spent += t
        rounds += 1
    a, b = statistics.median(times["native"]), statistics.median(times["padded"])
    return {"kind": config.kind, "input": config.input, "weight": config.weight,
            "pads": spec.padding, "native_ms": a * 1e3, "padded_ms": b * 1e3, "ratio": a / b, "impl": impls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=0.6, help="seconds of CPU time per layer (at least 3 rounds)")
    parser.add_argument("--out", help="write the table (markdown) here too")
    parser.add_argument("--suites", nargs="+", help="time these bench suites' forward layers instead of the sweep")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lines = [f"torch {torch.__version__} CPU, 1 thread, float32 unless the kind names a dtype, "
             f"CPU time of the thread, median of interleaved calls; noisy (a shared machine): read the ratios.",
             "", "Command: `PYTHONPATH=src python " + " ".join(["benchmarks/padded_forward.py", *sys.argv[1:]]) + "`",
             "", "| kind | input | weight | pads (lo, hi) | native ms | padded ms | native / padded "
             "| oneDNN native -> padded |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for config in bench_layers(args.suites) if args.suites else configs():
        r = measure(config, args.budget)
        line = (f"| {r['kind']} | {r['input']} | {r['weight']} | {r['pads']} | {r['native_ms']:.2f} | "
                f"{r['padded_ms']:.2f} | {r['ratio']:.2f} | {' -> '.join(r['impl'])} |")  # type: ignore[arg-type]
        lines.append(line)
        print(line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("# The padded forward's sweep (benchmarks/padded_forward.py)\n\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
