"""The per-sample race's cost model against the clock: each option's estimate over the cheapest beside its measured
time over the fastest, on every conv layer shape of per_sample_models' clipped DP-SGD step (purpose "clip", with
storing where the memory rule allows it): the figures behind ``convgrad.per_sample.tuning.PRUNE``.

Per layer shape, every option ``per_sample.tuning.raced`` offers is timed on the whole batch (none pruned): a warm-up
call, then the best of ``--calls`` calls; an option without "+store" adds the Book-Keeping pass, timed the same way
once per shape, as the race counts it. float32, batch 32, random x and y of the layer's shapes.

Usage:
    PYTHONPATH=src python benchmarks/per_sample_prune.py --threads 2
    PYTHONPATH=src python benchmarks/per_sample_prune.py --models small_cnn --calls 1   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))


def _shapes(name: str) -> list[tuple[Any, bool]]:
    """(spec, store) of each distinct clip tuning of the model's clipped step, in the order the backward meets them:
    one step in fixed mode, recording ``per_sample.tuning.method_for``'s arguments."""
    import per_sample

    from convgrad import tuning as modes
    from convgrad.per_sample import tuning

    seen: dict[Any, bool] = {}
    real = tuning.method_for

    def record(spec: Any, x: torch.Tensor, y: torch.Tensor, purpose: str, store: bool = False) -> str:
        if purpose == "clip":
            seen.setdefault((spec, store), store)
        return real(spec, x, y, purpose, store)

    tuning.method_for = record  # type: ignore[assignment]
    try:
        import per_sample_models

        torch.manual_seed(0)
        model = per_sample_models.MODELS[name]()
        x, y = per_sample.data(name)
        with modes.tuning_mode("fixed"):
            per_sample.setup_convgrad(model, "c")(x, y)
    finally:
        tuning.method_for = real  # type: ignore[assignment]
    return list(seen)


def _best(fn: Callable[[], object], calls: int) -> float:
    fn()  # warm-up: the first call at a shape pays one-time costs
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["resnet18", "small_cnn", "vgg11", "wrn16_4", "unet"])
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--calls", type=int, default=3, help="timed calls per option after its warm-up (default 3)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from convgrad.per_sample import tuning

    print(f"{args.threads} threads, float32, best of {args.calls} calls after a warm-up; ratios to the cheapest "
          f"estimate and to the fastest time on each layer shape\n")
    print("| model | x | w | stride | store | option | estimate / cheapest | time / fastest | ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    pairs = []
    for name in args.models:
        for spec, store in _shapes(name):
            x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)
            sides = (y, x) if spec.transposed else (x, y)
            est = tuning.estimates(spec, "clip", store)
            if not store:  # every option ends with the same pass: the race prunes on the norms' estimates
                est = tuning.estimates(spec, "norms", False)
            names = tuning.raced(spec, "clip", store)
            with torch.no_grad():
                kept = tuning.book_keeping(spec, *sides)
                book = _best(lambda s=spec, xy=sides: tuning.book_keeping(s, *xy), args.calls)
                runs = tuning.options(spec, *sides, "clip", store, kept=kept)
                seconds = {n: _best(lambda r=runs[n], m=spec.batch: r(m), args.calls) + (0.0 if "+" in n else book)
                           for n in names}
            low, fast = min(est[n] for n in names), min(seconds.values())
            for n in sorted(names, key=seconds.__getitem__):
                pairs.append((est[n] / low, seconds[n] / fast))
                print(f"| {name} | {tuple(spec.input_shape[1:])} | {tuple(spec.weight_shape)} | {spec.stride[0]} | "
                      f"{'yes' if store else 'no'} | {n} | {est[n] / low:.2f} | {seconds[n] / fast:.2f} | "
                      f"{seconds[n] * 1e3:.1f} |", flush=True)
    for margin in (2.0, 2.5, 3.0, 4.0):
        over = [t for e, t in pairs if e > margin]
        print(f"\nestimated over {margin}x the cheapest: {len(over)} options; their time over the fastest: "
              f"min {min(over):.2f}" if over else f"\nestimated over {margin}x the cheapest: none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
