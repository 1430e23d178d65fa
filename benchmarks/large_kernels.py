"""Large kernels (issue 28): fft, auto and fft-conv-pytorch against native on `convgrad bench --suite large`.

Per layer, float32, in one process and interleaved (ratios, not absolute times, are what this measures; on a shared
machine they are noisy): native's forward and backward (both gradients), fft's forward and backward, auto's forward
and backward after it has settled (the calls go on until neither choice has a race pending; a pick marked
"(unsettled)" was still racing, one marked "(retuned)" changed during the timing) and the backend it chose
for the forward, grad_input and grad_weight, fft-conv-pytorch 1.2.0's forward + backward (autograd through its FFT
conv; forward convs only) against fft's and auto's forward + backward, and the peak of live bytes in PyTorch's CPU
allocator during one backward by native, fft and auto (the torch profiler's memory events, profile_memory=True).

    PYTHONPATH=src python benchmarks/large_kernels.py --threads 2 [--layers 'replknet*' ...] [--min-time 0.5]

Prints a markdown table; ``--out FILE`` also writes it with the command line. ``--memory-only`` times nothing: per
layer, the peaks of fft's forward, grad_input and grad_weight, each call alone, against native's (issue 28's target:
each at most 2x native's), in ``benchmarks/results/fft_memory.md``:

    PYTHONPATH=src python benchmarks/large_kernels.py --memory-only --out benchmarks/results/fft_memory.md
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch.utils import benchmark

from convgrad.backends import auto, get_backend
from convgrad.backends.native import forward as native_forward
from convgrad.cli.bench import model as model_bench
from convgrad.cli.bench.layers import Layer, select
from convgrad.spec import ConvSpec


def _time(f: Callable[[], object], min_time: float) -> float:
    # Timer runs at 1 thread unless told: auto's choices are keyed by the thread count, so at 1 thread it would tune
    # afresh inside the timing (and every contender would run at 1 thread, not --threads)
    timer = benchmark.Timer("f()", globals={"f": f}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_time).median


def time_interleaved(calls: dict[str, Callable[[], object]], min_time: float, rounds: int = 3,
                     measure: Callable[[Callable[[], object], float], float] = _time) -> dict[str, float]:
    """Each call's median time over ``rounds`` rounds, every call timed once per round (``measure(f, seconds)``),
    after one warm-up call of each. Interleaved, so that what one contender leaves behind (fft's multi-GB, many-second
    calls on a dense layer) or a change of load weighs on every contender alike, not on those timed after it."""
    for f in calls.values():
        f()
    samples: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            samples[k].append(measure(f, min_time / rounds))
    return {k: statistics.median(v) for k, v in samples.items()}


def peak_bytes(f: Callable[[], object]) -> int:
    """Peak of live bytes allocated during one call of f, after a first call (``convgrad bench``'s measure: the torch
    profiler's memory events, CPU allocator)."""
    f()
    return model_bench.peak_bytes(f, torch.device("cpu"))


def _fft_conv_pytorch(spec: ConvSpec, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor
                      ) -> Callable[[], object] | None:
    """fft-conv-pytorch's forward + backward, for forward convs (padding made explicit), or None."""
    try:
        from fft_conv_pytorch import fft_conv
    except ModuleNotFoundError:
        return None
    if spec.transposed:
        return None
    pads = [v for lo, hi in reversed(spec.padding) for v in (lo, hi)]
    xs, ws = x.detach().requires_grad_(), w.detach().requires_grad_()

    def step() -> object:
        y = fft_conv(torch.nn.functional.pad(xs, pads), ws, None, 0, "constant", spec.stride, spec.dilation,
                     spec.groups)
        return torch.autograd.grad(y, (xs, ws), gy)

    return step


def pick(choice: object) -> str:
    """A choice's name per gradient, ``gi/gw`` ("native/native" for none), "(unsettled)" while a race is pending."""
    if choice is None:
        return "native/native"
    name: str = choice.backend  # type: ignore[attr-defined]
    named = "/".join(choice.parts) if name == "split" else f"{name}/{name}"  # type: ignore[attr-defined]
    return named + (" (unsettled)" if choice.pending else "")  # type: ignore[attr-defined]


def settle(call: Callable[[], object], key: Callable[[], object], most: int = 256) -> str:
    """Call until auto's choice for ``key`` exists with no race pending (at most ``most`` calls: an exploration of
    five options runs up to 7 rounds of 2 calls each, 70 calls); ``pick`` of it."""
    for _ in range(most):
        call()
        choice = key()
        if choice is not None and not choice.pending:  # type: ignore[attr-defined]
            break
    return pick(key())


def measure(layer: Layer, min_time: float) -> dict[str, object]:
    spec = layer.spec()
    x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
    native, fft = get_backend("native"), get_backend("fft")
    calls = {
        "native_fwd": lambda: native_forward(spec, x, w, None),
        "fft_fwd": lambda: fft.forward(spec, x, w),  # type: ignore[attr-defined]
        "native_bwd": lambda: native.gradients(spec, gy, x, w, True, True),
        "fft_bwd": lambda: fft.gradients(spec, gy, x, w, True, True),
    }
    contender = _fft_conv_pytorch(spec, x, w, gy)
    if contender is not None:
        calls["fftconv_step"] = contender
    with auto.tuning_mode("tune"):
        auto.clear()
        backend = get_backend("auto")
        calls["auto_fwd"] = lambda: auto.forward(spec, x, w, None)
        calls["auto_bwd"] = lambda: backend.gradients(spec, gy, x, w, True, True)
        keys = {"bwd": lambda: auto.chosen(spec, "both", gy), "fwd": lambda: auto.chosen(spec, "forward", x)}
        picked = {"bwd": settle(calls["auto_bwd"], keys["bwd"]), "fwd": settle(calls["auto_fwd"], keys["fwd"])}
        times = time_interleaved(calls, min_time)
        # a choice forgotten by the drift watch and tuned again inside the timing: its tuning calls were timed
        picked = {k: v if pick(keys[k]()) == v else f"{v} (retuned)" for k, v in picked.items()}
        peaks = {"native": peak_bytes(calls["native_bwd"]), "fft": peak_bytes(calls["fft_bwd"]),
                 "auto": peak_bytes(calls["auto_bwd"])}
    name, _, note = picked["fwd"].partition(" ")  # the forward has one result: "fft/fft" -> "fft"
    fwd = " ".join([name.split("/")[0], *([note] if note else [])])
    return {"layer": layer.name, "times": times, "auto": f"{fwd}; {picked['bwd']}", "peaks": peaks}


NOT_TIMED = "n/a"  # fft-conv-pytorch has no transposed convolution (or is not installed): no speed-up to give


def _row(r: dict[str, object]) -> str:
    t: dict[str, float] = r["times"]  # type: ignore[assignment]
    p: dict[str, int] = r["peaks"]  # type: ignore[assignment]
    step = {k: t[f"{k}_fwd"] + t[f"{k}_bwd"] for k in ("native", "fft", "auto")}
    contender = t.get("fftconv_step")  # a float nan here printed "nan" cells (HiFi-GAN's transposed conv)
    vs = {k: NOT_TIMED if contender is None else f"{contender / step[k]:.2f}" for k in ("fft", "auto")}
    mib = " | ".join(f"{p[k] / 2**20:.1f}" for k in ("native", "fft", "auto"))
    return (f"| {r['layer']} | {t['native_fwd'] * 1e3:.1f} | {t['native_bwd'] * 1e3:.1f} | "
            f"{t['native_fwd'] / t['fft_fwd']:.2f} | {t['native_bwd'] / t['fft_bwd']:.2f} | "
            f"{t['native_fwd'] / t['auto_fwd']:.2f} | {t['native_bwd'] / t['auto_bwd']:.2f} | {r['auto']} | "
            f"{step['native'] / step['auto']:.2f} | {vs['fft']} | {vs['auto']} | {mib} |")


# Every ratio of times is a speed-up, the reference's time over the contender's (above 1: the contender is faster), as
# convgrad bench reports it (convgrad.cli.bench.report)
HEADER = ("| layer | native fwd ms | native bwd ms | fft fwd speed-up vs native | fft bwd speed-up vs native | "
          "auto fwd speed-up vs native | auto bwd speed-up vs native | auto picks (fwd; gi/gw) | "
          "auto step speed-up vs native | fft step speed-up vs fft-conv-pytorch | "
          "auto step speed-up vs fft-conv-pytorch | native bwd peak MiB | fft bwd peak MiB | auto bwd peak MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
CONVENTION = ("a speed-up is the reference's time over the contender's (above 1: faster); n/a: fft-conv-pytorch has "
              "no transposed convolution")


CALLS = ("forward", "grad_input", "grad_weight")


def memory(spec: ConvSpec, which: Sequence[str] = CALLS) -> dict[str, tuple[int, int]]:
    """Per call of ``which`` (of CALLS), the peak bytes of native's and of fft's, each call alone (``peak_bytes``; the
    tensors it is given are allocated before and do not count)."""
    x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
    native, fft = get_backend("native"), get_backend("fft")
    calls = {"forward": (lambda: native_forward(spec, x, w, None), lambda: fft.forward(spec, x, w)),  # type: ignore[attr-defined]
             "grad_input": (lambda: native.input_grad(spec, w, gy), lambda: fft.input_grad(spec, w, gy)),
             "grad_weight": (lambda: native.weight_grad(spec, x, gy), lambda: fft.weight_grad(spec, x, gy))}
    return {k: (peak_bytes(calls[k][0]), peak_bytes(calls[k][1])) for k in which}


def _memory_row(name: str, peaks: dict[str, tuple[int, int]]) -> str:
    cells = [f"{n / 2**20:.2f} | {f / 2**20:.2f} | {f / n:.2f}" for n, f in (peaks[k] for k in CALLS)]
    return f"| {name} | " + " | ".join(cells) + f" | {max(f / n for n, f in peaks.values()):.2f} |"


MEMORY_HEADER = ("| layer | forward native MiB | forward fft MiB | forward fft x native | grad_input native MiB | "
                 "grad_input fft MiB | grad_input fft x native | grad_weight native MiB | grad_weight fft MiB | "
                 "grad_weight fft x native | worst x native |\n|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", metavar="PATTERN")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timing (default 0.3)")
    p.add_argument("--out", type=Path)
    p.add_argument("--memory-only", action="store_true",
                   help="no timing: the peak memory of fft's forward, grad_input and grad_weight against native's")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [MEMORY_HEADER if args.memory_only else HEADER]
    print(lines[0], flush=True)
    for layer in select("large", args.layers):
        line = (_memory_row(layer.name, memory(layer.spec())) if args.memory_only
                else _row(measure(layer, args.min_time)))
        lines.append(line)
        print(line, flush=True)
    if args.out:
        command = "PYTHONPATH=src python " + shlex.join(["benchmarks/large_kernels.py", *(argv or sys.argv[1:])])
        note = ("peak of live bytes in PyTorch's CPU allocator during one call, float32 (the torch profiler's memory "
                "events): independent of the load" if args.memory_only else f"noisy: a shared machine; {CONVENTION}")
        args.out.write_text(f"`{command}` (threads={args.threads}; {note})\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
