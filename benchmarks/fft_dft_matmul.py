"""A 2d real DFT as two matmuls against pocketfft's rfftn, on many tiny planes (issue 28, UniRepLKNet's 13x13).

For each even 5-smooth size L, ``--planes`` planes of L x L (UniRepLKNet-T's stage 3 at batch 8: 2,560 planes,
transformed at 20 x 20): ``torch.fft.rfftn`` against the same half spectrum computed by matmuls, the last dim by a
real (L, 2F) DFT matrix (one GEMM over all rows) and the first by the (2L, 2L) real form of the complex DFT (one
GEMM over all planes' bins), with the layout copy between them; both timed as CPU time (best of ``--reps``), so that
the ratio holds on a shared machine. A ratio above 1 would make the matmul DFT worth a size rule in the fft
backend's cost model; the table says where it is.

    PYTHONPATH=src python benchmarks/fft_dft_matmul.py --threads 1 [--planes 2560] [--out FILE]
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from collections.abc import Callable

import torch
from fft_sizes import cpu_time

SIZES = (8, 10, 12, 16, 20, 24, 30, 32, 40, 48, 64)


def dft_matmul(x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """The half spectrum of the planes x (P, L, L) by two GEMMs: a callable returning (2, L, P, F) (re, im)."""
    p, n = x.shape[0], x.shape[-1]
    bins = n // 2 + 1
    rows = torch.arange(n, dtype=torch.float64)
    angle = -2 * math.pi * torch.outer(rows, torch.arange(bins, dtype=torch.float64)) / n  # (L, F)
    last = torch.stack([angle.cos(), angle.sin()], -1).reshape(n, 2 * bins).to(x.dtype)  # (L, 2F)
    full = -2 * math.pi * torch.outer(rows, rows) / n  # (L, L)
    c, s = full.cos().to(x.dtype), full.sin().to(x.dtype)
    first = torch.cat([torch.cat([c, -s], 1), torch.cat([s, c], 1)], 0)  # (2L, 2L): [re; im] -> [re; im]

    def run() -> torch.Tensor:
        half = (x.reshape(p * n, n) @ last).reshape(p, n, bins, 2)  # (P, L, F, 2)
        half = half.permute(3, 1, 0, 2).reshape(2 * n, p * bins)  # (2*L, P*F)
        return (first @ half).reshape(2, n, p, bins)  # (2, L, P, F)

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--planes", type=int, default=2560)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = ["| L | rfftn ms | matmul DFT ms | rfftn / matmul | max error / max |", "|---|---|---|---|---|"]
    for n in SIZES:
        x = torch.randn(args.planes, n, n)
        fft, matmul = (lambda x=x: torch.fft.rfftn(x, dim=(-2, -1))), dft_matmul(x)
        ref, got = fft(), matmul()
        err = float((torch.complex(got[0], got[1]).permute(1, 0, 2) - ref).abs().max() / ref.abs().max())
        a, b = cpu_time(fft, args.reps), cpu_time(matmul, args.reps)
        lines.append(f"| {n} | {a * 1e3:.2f} | {b * 1e3:.2f} | {a / b:.2f} | {err:.1e} |")
        print(lines[-1], flush=True)
    if args.out:
        command = ("PYTHONPATH=src python benchmarks/fft_dft_matmul.py "
                   + shlex.join(sys.argv[1:] if argv is None else argv))
        head = [f"torch {torch.__version__}, {args.threads} thread(s), {args.planes} planes, float32, CPU time, "
                f"best of {args.reps} (noisy: a shared machine).", "", f"    {command}", ""]
        with open(args.out, "w") as f:
            f.write("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
