"""One tuning of "auto": probe the options against native, time the agreeing ones, pick the winner.

An option is a callable computing one gradient (or both) with one backend, or "split" (the two
per-gradient winners one after the other). Options are timed in interleaved rounds, each on its
second call in a row, and compared by the median over rounds of their time over native's in the
same round. See ``convgrad.backends.auto`` for how the choices are used.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PREFER_NATIVE", "SPLIT_MARGIN", "Choice", "tune"]

# agreement with native on the probe: max |a - native| <= RTOL * max |native| + ATOL (per real dtype)
_AGREE = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-3, 1e-6), torch.float16: (2e-2, 1e-3),
          torch.bfloat16: (5e-2, 1e-2)}
# Rounds of one tuning: at least _MIN_ROUNDS; a clear call (runner-up _CLEAR_MARGIN slower than the best) stops
# there. A close call goes on with the options within _CLEAR_MARGIN of the best (and native, the reference), up to
# _CLOSE_ROUNDS rounds or _TIME_BUDGET_S of wall time, whichever comes later, but never past _MAX_ROUNDS or
# _CLOSE_BUDGET_S (warm-up calls count). Three rounds of a 70 ms layer had U-Net's up-conv tune fwdconv 3% faster
# than native; `convgrad bench` then measured it 1.07x native.
_MIN_ROUNDS, _CLOSE_ROUNDS, _MAX_ROUNDS = 3, 7, 15
_TIME_BUDGET_S, _CLOSE_BUDGET_S = 1.0, 3.0
_CLEAR_MARGIN = 1.1
# Another backend replaces the incumbent (native, or the backend that won both gradients) only when it beats it by
# more than PREFER_NATIVE; "split" must beat every backend by SPLIT_MARGIN. A tuning's timings carry noise, and the
# speeds drift within a process, so a winner by less than that may be slower when measured again. A smaller
# margin lost more than it won in `convgrad bench` (2 threads, 36 rounds): at 1.5%, U-Net's up-conv chose gemm and
# ResNet-50's 3x3 at 7 chose fwdconv, then measured 1.068x and 1.050x native; a win lost to the margin costs at most
# its size (wav2vec2's k3/2: 3.7%, which the incumbent rule now keeps). Split is held to 5%: it is two calls that
# share nothing (native's backward reorders grad_output once for both gradients), and tunings flattered it by up
# to 6%: U-Net's up-conv tuned split over 3% faster than native, then measured 1.044x native.
PREFER_NATIVE, SPLIT_MARGIN = 1.03, 1.05

Result = Any  # a gradient, or a (grad_input, grad_weight) pair


@dataclass(frozen=True)
class Choice:
    """The outcome of one tuning: the winner, each agreeing candidate's median time (s), the rejected ones, and
    the batch size timed (0: unknown)."""

    backend: str
    times: dict[str, float]
    rejected: tuple[str, ...] = ()
    batch: int = 0


def tune(options: dict[str, Callable[[], Result]], device: torch.device, batch: int = 0,
         incumbent: str = "native") -> tuple[Choice, Result]:
    """Probe every option against "native", then time the agreeing ones in interleaved rounds; the option with
    the lowest median ratio to native within a round wins if it beats the incumbent by the margin (``_winner``).

    Returns the choice (``batch`` recorded in it) and the winner's probe result.
    """
    with torch.no_grad():
        outs = {name: option() for name, option in options.items()}  # the probe, also the warm-up
        ref = outs["native"]
        if not _finite(ref):
            return Choice("native", {}, (), batch), ref
        ok = [n for n in options if n == "native" or _agrees(outs[n], ref)]
        samples = _rounds({n: options[n] for n in ok}, device)
    winner = _winner(_paired(samples), incumbent)
    times = {n: statistics.median(s) for n, s in samples.items()}
    return Choice(winner, times, tuple(n for n in options if n not in ok), batch), outs[winner]


def _agrees(out: Result, ref: Result) -> bool:
    if isinstance(ref, tuple):
        return all(_agrees(o, r) for o, r in zip(out, ref, strict=True))
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    real = torch.empty((), dtype=ref.dtype).real.dtype
    rtol, atol = _AGREE.get(real, (1e-3, 1e-6))
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return ref.numel() == 0 or float((out - ref).abs().max()) <= rtol * scale + atol


def _finite(ref: Result) -> bool:
    return all(bool(torch.isfinite(r).all()) for r in (ref if isinstance(ref, tuple) else (ref,)))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(option: Callable[[], Result], device: torch.device) -> tuple[Result, float]:
    _sync(device)
    start = time.perf_counter()
    out = option()
    _sync(device)
    return out, time.perf_counter() - start


def _winner(ratios: dict[str, float], incumbent: str = "native") -> str:
    """The incumbent (native; for both gradients, the backend that won each of them), unless another backend's own
    call beats it by more than PREFER_NATIVE; "split" only if it beats every backend's own call by SPLIT_MARGIN."""
    incumbent = incumbent if incumbent in ratios else "native"
    singles = [n for n in ratios if n != "split"]
    best = min(singles, key=lambda n: (ratios[n], n != incumbent))
    winner = best if ratios[best] * PREFER_NATIVE <= ratios[incumbent] else incumbent
    if "split" in ratios and ratios["split"] * SPLIT_MARGIN <= ratios[best]:
        winner = "split"
    return winner


def _paired(samples: dict[str, list[float]]) -> dict[str, float]:
    """Each option's median over rounds of its time over native's in the same round (native: 1.0).

    Paired within a round, load that comes and goes during the tuning cancels out of each ratio; the
    median, not the best time, is what a layer then runs at (`convgrad bench` reports the same statistic).
    An option dropped from later rounds is paired with native's first rounds only.
    """
    ref = samples["native"]
    return {n: statistics.median(t / r for t, r in zip(s, ref)) for n, s in samples.items()}


def _rounds(options: dict[str, Callable[[], Result]], device: torch.device) -> dict[str, list[float]]:
    """Each option's times over interleaved rounds (order rotating); how many rounds, and which options stay
    in them, is said where _MIN_ROUNDS is set."""
    active, samples, spent = list(options), {n: [] for n in options}, 0.0
    for r in range(_MAX_ROUNDS):
        for n in active[r % len(active):] + active[:r % len(active)]:
            # timed on its second call in a row, as torch.utils.benchmark (and so `convgrad bench`) times it: a
            # first call after another option ran in that option's cache and heap state. Timed alone, ResNet-50's
            # 1x1 expand tuned "split" 5% faster than native, then ran 4.5-5.8% slower than native.
            warm = _timed(options[n], device)[1]
            seconds = _timed(options[n], device)[1]
            samples[n].append(seconds)
            spent += warm + seconds
        if r + 1 < _MIN_ROUNDS:
            continue
        ratios = _paired(samples)
        best = min(ratios[n] for n in active)
        close = [n for n in active if ratios[n] <= _CLEAR_MARGIN * best]
        if len(close) < 2 or spent > _CLOSE_BUDGET_S or (spent > _TIME_BUDGET_S and r + 1 >= _CLOSE_ROUNDS):
            break
        active = [n for n in active if n in close or n == "native"]
    return samples
