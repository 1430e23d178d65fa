"""Large kernels (issue 28): fft, auto and fft-conv-pytorch against native on `convgrad bench --suite large`.

Per layer, float32, in one process and interleaved (ratios, not absolute times, are what this measures; on a shared
machine they are noisy): native's forward and backward (both gradients), fft's forward and backward, auto's backward
after tuning (and the backend it chose per gradient), fft-conv-pytorch 1.2.0's forward + backward (autograd through
its FFT conv; forward convs only), and the peak of live bytes in PyTorch's CPU allocator during one backward by native
and by fft (the torch profiler's memory events).

    PYTHONPATH=src python benchmarks/large_kernels.py --threads 2 [--layers 'replknet*' ...] [--min-time 0.5]

Prints a markdown table; ``--out FILE`` also writes it with the command line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import benchmark

from convgrad.backends import auto, get_backend
from convgrad.backends.native import forward as native_forward
from convgrad.cli.bench.layers import Layer, select
from convgrad.spec import ConvSpec


def _time(f: Callable[[], object], min_time: float) -> float:
    f()
    return benchmark.Timer("f()", globals={"f": f}).blocked_autorange(min_run_time=min_time).median


def _peak_bytes(f: Callable[[], object]) -> int:
    """Peak of live bytes allocated during one call of f (torch profiler memory events, CPU allocator)."""
    f()
    with tempfile.TemporaryDirectory() as tmp:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            f()
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    live = peak = 0
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        peak = max(peak, live)
    return peak


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
    with auto.tuning_mode("tune"):
        auto.clear()
        backend = get_backend("auto")
        for _ in range(16):  # screening, then the rounds that settle a close call
            backend.gradients(spec, gy, x, w, True, True)
        choice = auto.chosen(spec, "both", gy)
        picked = choice.backend if choice else "native"
        if picked == "split" and choice:
            picked = "/".join(choice.parts)
        calls["auto_bwd"] = lambda: backend.gradients(spec, gy, x, w, True, True)
        times = {k: _time(f, min_time) for k, f in calls.items()}
    contender = _fft_conv_pytorch(spec, x, w, gy)
    times["fftconv_step"] = _time(contender, min_time) if contender else float("nan")
    peaks = {"native": _peak_bytes(calls["native_bwd"]), "fft": _peak_bytes(calls["fft_bwd"])}
    return {"layer": layer.name, "times": times, "auto": picked, "peaks": peaks}


def _row(r: dict[str, object]) -> str:
    t: dict[str, float] = r["times"]  # type: ignore[assignment]
    p: dict[str, int] = r["peaks"]  # type: ignore[assignment]
    step_native, step_fft = t["native_fwd"] + t["native_bwd"], t["fft_fwd"] + t["fft_bwd"]
    vs_contender = t["fftconv_step"] / step_fft if t["fftconv_step"] == t["fftconv_step"] else float("nan")
    return (f"| {r['layer']} | {t['native_fwd'] * 1e3:.1f} | {t['native_bwd'] * 1e3:.1f} | "
            f"{t['native_fwd'] / t['fft_fwd']:.2f} | {t['native_bwd'] / t['fft_bwd']:.2f} | "
            f"{t['native_bwd'] / t['auto_bwd']:.2f} | {r['auto']} | {step_native / step_fft:.2f} | "
            f"{vs_contender:.2f} | {p['native'] / 2**20:.1f} | {p['fft'] / 2**20:.1f} |")


HEADER = ("| layer | native fwd ms | native bwd ms | fft fwd x native | fft bwd x native | auto bwd x native | "
          "auto picks | fft step x native | fft step x fft-conv-pytorch | native bwd peak MiB | fft bwd peak MiB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", nargs="+", metavar="PATTERN")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.3, help="seconds per timing (default 0.3)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [HEADER]
    print(HEADER, flush=True)
    for layer in select("large", args.layers):
        line = _row(measure(layer, args.min_time))
        lines.append(line)
        print(line, flush=True)
    if args.out:
        command = "PYTHONPATH=src python " + shlex.join(["benchmarks/large_kernels.py", *(argv or sys.argv[1:])])
        args.out.write_text(f"`{command}` (threads={args.threads}; noisy: a shared machine)\n\n" + "\n".join(lines)
                            + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
