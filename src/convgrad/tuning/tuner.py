"""One tuning mechanism for convgrad's measured choices: prune by cost model, screen on a slice, settle on use.

It serves "auto" (which backend computes a gradient, ``convgrad.backends.auto``) and the
per-sample methods (``convgrad.per_sample.methods``). An option is a callable ``run(n)`` that
computes the result for the first ``n`` samples of the batch. One tuning:

1. **prune**: options with a cost-model estimate over ``PRUNE_ESTIMATE`` times the lowest
   estimate are never called (options without an estimate always take part);
2. **screen**: every option runs on the first ``screen_batch(N)`` samples (an eighth of the
   batch): a probe, checked against the reference option's probe and serving as warm-up, then
   one timed call (more while a call runs over ``WARMING`` times faster than the one before: an
   option still warming up, see ``warm_time``). Options over ``SCREEN_DROP`` times the fastest
   screened time are dropped;
3. **settle**: when one option survives, it is the choice. When several do, the fastest
   screened is used for now and the survivors are compared on the calls that follow
   (``Exploration``, settle.py): those calls compute real results, so comparing costs no extra
   calls, only the difference in speed while a slower survivor runs. Each survivor in turn runs
   twice in a row, the second call timed, and a round's times are paired with the anchor's
   (the incumbent if it survived, else the fastest screened), for a few rounds;
4. **pick** (``settle.pick``): the incumbent (native, for "auto") stays unless another option beats
   it by more than ``PREFER_NATIVE`` in the median over rounds of the paired ratios; "split" must
   beat every single option by ``SPLIT_MARGIN``.

The first call thus costs the screening: two calls of every option on an eighth of the batch,
a quarter of one call per option.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from convgrad.tuning.settle import PREFER_NATIVE, SPLIT_MARGIN, WARM_CALLS, WARMING, Exploration

__all__ = ["PREFER_NATIVE", "PRUNE_ESTIMATE", "SCREEN_DROP", "SPLIT_MARGIN", "WARMING", "WARM_CALLS", "Choice",
           "Exploration", "Result", "Run", "Screen", "agrees", "decide", "prune", "screen", "screen_batch", "timed",
           "tune", "warm_time"]

Result = Any  # a gradient, a (grad_input, grad_weight) pair, or whatever the options compute
Run = Callable[[int], Result]  # run(n): the result for the first n samples of the batch

# agreement with the reference on the probe: max |a - ref| <= RTOL * max |ref| (per real dtype), or both all zero up
# to the dtype's smallest normal number. An absolute term (1e-2 in bfloat16, 1e-6 in float32) let anything agree
# with gradients of a smaller scale, which training's are. bfloat16: two results summed in float32 and rounded once
# differ by at most one ulp of the largest entry, 2u = 2^-7 of it; RTOL allows four, for a backend that rounds a term
# once more (fwdconv's per-sample sums: 1.9u seen), where 5e-2 let gemm's fold summed in bfloat16 through (4.8e-2 on
# a 31x31 depthwise layer, issue 40). float16 stays wide: torch's CPU kernel accumulates it in half precision, so
# native itself errs up to ~20u on large kernels (docs/numerics.md)
_AGREE = {torch.float64: 1e-9, torch.float32: 1e-3, torch.float16: 2e-2, torch.bfloat16: 2.0**-5}
# Screening: a slice of SCREEN_FRACTION-th of the batch, but at least SCREEN_MIN samples; an option over SCREEN_DROP
# times the fastest there is dropped. A slice is a coarse guide, so the factor is generous and the survivors are
# settled on the whole batch: per-sample speeds move with the batch (a slice fits in the caches), so the factor
# keeps an option unless it is far behind (benchmarks/results/auto_screen.json, made by benchmarks/auto_screen.py).
SCREEN_FRACTION, SCREEN_MIN, SCREEN_DROP = 8, 4, 2.0
# Pruning by cost model: an option estimated over PRUNE_ESTIMATE times the cheapest is never run.
PRUNE_ESTIMATE = 4.0


@dataclass(frozen=True)
class Choice:
    """The outcome of one tuning.

    Attributes:
        backend: the winning option's name (a backend, "split", or a per-sample method).
        times: seconds per call on the tuned batch for every option that ran: measured on the whole batch where
            it was, else its screened time scaled by the batch over the screening batch.
        rejected: options whose probe disagreed with the reference.
        batch: the batch size tuned (0: unknown).
        parts: where "split" is an option, the backends of grad_input and grad_weight.
        pending: the survivors still to be compared on the calls that follow, the anchor first (empty: settled).
    """

    backend: str
    times: dict[str, float]
    rejected: tuple[str, ...] = ()
    batch: int = 0
    parts: tuple[str, ...] = ()
    pending: tuple[str, ...] = ()


@dataclass
class Screen:
    """What a screening saw: per option its time scaled to the whole batch (s), the rejected, the reference's probe."""

    times: dict[str, float] = field(default_factory=dict)
    rejected: tuple[str, ...] = ()
    probes: dict[str, Result] = field(default_factory=dict)
    batch: int = 0  # the screening batch


def screen_batch(batch: int) -> int:
    """The batch options are screened on: an eighth of ``batch``, rounded up, at least 4 samples (at most all).

    Examples:
        >>> from convgrad.tuning.tuner import screen_batch
        >>> [screen_batch(n) for n in (0, 1, 8, 9, 32, 33, 256)]
        [0, 1, 4, 4, 4, 5, 32]
    """
    return min(batch, max(-(-batch // SCREEN_FRACTION), SCREEN_MIN))


def prune(estimates: Mapping[str, float], keep: tuple[str, ...] = (), margin: float = PRUNE_ESTIMATE) -> set[str]:
    """The options a cost model rules out: estimated over ``margin`` (default PRUNE_ESTIMATE) times the cheapest
    (never those in keep).

    Examples:
        >>> from convgrad.tuning.tuner import prune
        >>> sorted(prune({"ghost": 45.0, "unfold": 10.0, "conv": 30.0}))
        ['ghost']
        >>> sorted(prune({"ghost": 45.0, "unfold": 10.0, "conv": 30.0}, margin=2.5))
        ['conv', 'ghost']
    """
    if not estimates:
        return set()
    low = min(estimates.values())
    return {n for n, e in estimates.items() if n not in keep and e > margin * low}


def screen(options: Mapping[str, Run], batch: int, device: torch.device, reference: str,
           agree: Callable[[Result, Result], bool] | None = None, on: int | None = None,
           behind: float | None = None, extra: Mapping[str, float] | None = None) -> Screen:
    """Probe every option on ``on`` samples (default ``screen_batch(batch)``) against the reference's probe, then
    time each once.

    An option whose probe disagrees (or whose result is not finite while the reference's is) is rejected and not
    timed; a probe is dropped once compared, so the screening holds two results at most. When the reference's
    own probe is not finite, only the reference is kept (nothing can be checked).

    ``behind`` (a choice taken on the screening alone, as the per-sample methods'): the probes rank the options, and
    only those whose probe ran within ``behind`` times the fastest probe are timed again; where one is left, it is
    the choice with no further call (a probe carries first-call costs on top of a warm call's work, so an option
    over ``behind`` times the fastest probe could win only if its own first-call costs were over ``behind`` times
    the fastest's, relative to their work); none is re-timed (``_screen_behind``).
    ``extra``: seconds added to each call of an option (work it shares with others, timed once by the caller).
    """
    agree = agree or agrees
    n = screen_batch(batch) if on is None else on
    scale = batch / n if n else 1.0
    add = extra or {}
    with torch.no_grad():
        ref, first = timed(lambda: options[reference](n), device)  # each probe is also its option's warm-up
        if not _finite(ref):
            return Screen({}, (), {reference: ref}, n)
        if behind is not None:
            return _screen_behind(options, device, reference, agree, n, scale, ref, first, behind, add)
        probe = {reference: first}
        ok = [reference]
        for name in options:  # one probe at a time beside the reference's: a per-sample result can be 100s of MiB
            if name != reference:
                out, probe[name] = timed(lambda r=options[name]: r(n), device)
                if agree(out, ref):
                    ok.append(name)
                del out
        ok.sort(key=list(options).index)
        times = {name: (warm_time(lambda r=options[name]: r(n), device, probe[name]) + add.get(name, 0.0)) * scale
                 for name in ok}
        _retime(options, device, n, scale, times, add)
    return Screen(times, tuple(name for name in options if name not in ok), {reference: ref}, n)


def _screen_behind(options: Mapping[str, Run], device: torch.device, reference: str,
                   agree: Callable[[Result, Result], bool], n: int, scale: float, ref: Result, first: float,
                   behind: float, add: Mapping[str, float]) -> Screen:
    """``screen`` with ``behind``: probe each option in turn (the reference's probe, ``first``, is taken), then time
    again only those whose probe is within ``behind`` of the fastest probe, and none where that leaves one; the
    fastest probe last, and not at all where none of the others then beats it. An option timed again keeps the
    faster of its probe and its warm time: against a call delayed by other load, the two calls count as the re-time
    of ``screen``."""
    probes = {reference: first}
    for name in options:
        if name == reference:
            continue
        out, probes[name] = timed(lambda r=options[name]: r(n), device)
        if not agree(out, ref):
            del probes[name]
        del out
    times = {k: (s + add.get(k, 0.0)) * scale for k, s in probes.items()}
    # the fastest checking call last: where no other option's time then beats it, its own warm call (which can
    # only lower its time) cannot change the choice, and it is not made
    close = sorted((k for k in times if times[k] <= behind * min(times.values())), key=times.__getitem__,
                   reverse=True)
    for name in close if len(close) > 1 else ():
        if name == close[-1] and all(times[k] >= times[name] for k in close[:-1]):
            break
        warm = min(probes[name], warm_time(lambda r=options[name]: r(n), device, probes[name]))
        times[name] = (warm + add.get(name, 0.0)) * scale
    ok = [k for k in options if k in times]
    return Screen({k: times[k] for k in ok}, tuple(k for k in options if k not in times), {reference: ref}, n)


def _retime(options: Mapping[str, Run], device: torch.device, n: int, scale: float, times: dict[str, float],
            add: Mapping[str, float]) -> None:
    """A call delayed by other load must not drop an option: those over SCREEN_DROP times the fastest run once
    more, and keep the faster of their two times (in place)."""
    for name in times:
        if times[name] > SCREEN_DROP * min(times.values()):
            again = (timed(lambda r=options[name]: r(n), device)[1] + add.get(name, 0.0)) * scale
            times[name] = min(times[name], again)


def decide(batch: int, estimates: Mapping[str, float], incumbent: str, rejected: tuple[str, ...] = (),
           keep: tuple[str, ...] = ()) -> Choice:
    """The choice from estimated times on the whole batch (from a screening, or composed from one).

    Options over SCREEN_DROP times the best estimate are dropped, except those in ``keep``. The fastest estimated
    is chosen; when others survive, they are pending, to be compared on the calls that follow, the anchor (the
    incumbent if it survived, else the fastest) first.

    Examples:
        >>> from convgrad.tuning.tuner import decide
        >>> c = decide(32, {"native": 3.0, "fwdconv": 1.0, "gemm": 2.5}, "native", keep=("native",))
        >>> c.backend, c.pending
        ('fwdconv', ('native', 'fwdconv'))
    """
    if not estimates or batch == 0:
        return Choice(incumbent, dict(estimates), rejected, batch)
    best = min(estimates.values())
    alive = sorted((n for n, e in estimates.items() if e <= SCREEN_DROP * best or n in keep),
                   key=estimates.__getitem__)
    anchor = incumbent if incumbent in alive else alive[0]
    pending = (anchor, *(n for n in alive if n != anchor)) if len(alive) > 1 else ()
    return Choice(alive[0], dict(estimates), rejected, batch, (), pending)


def tune(options: Mapping[str, Run], batch: int, device: torch.device, reference: str = "native",
         incumbent: str | None = None, estimates: Mapping[str, float] | None = None,
         agree: Callable[[Result, Result], bool] | None = None, on: int | None = None,
         behind: float | None = None) -> tuple[Choice, Result | None]:
    """Prune, screen (on ``on`` samples, default ``screen_batch(batch)``; ``behind`` as ``screen``) and decide (see
    the module doc).

    ``reference`` is never pruned, checks the others and is never dropped by the screening: when it was not the
    fastest there, it stays among the options compared on the calls that follow, so that a slice that misranks
    the options cannot leave a choice slower than the reference. Returns the choice and, when the screening ran
    on the whole batch and chose the reference, its result (None otherwise: the caller runs the choice).

    Examples:
        >>> import torch
        >>> from convgrad.tuning.tuner import tune
        >>> x = torch.randn(64, 256)
        >>> options = {"native": lambda n: x[:n] @ x[:n].T, "wrong": lambda n: torch.zeros(n, n)}
        >>> choice, _ = tune(options, 64, torch.device("cpu"))
        >>> choice.backend, choice.rejected
        ('native', ('wrong',))
    """
    dropped = prune(estimates or {}, keep=(reference,))
    seen = screen({n: r for n, r in options.items() if n not in dropped}, batch, device, reference, agree, on,
                  behind)
    choice = decide(batch, seen.times, incumbent or reference, seen.rejected, keep=(reference,))
    out = seen.probes.get(choice.backend) if seen.batch == batch else None
    return choice, out


def agrees(out: Result, ref: Result) -> bool:
    """Whether out matches ref (tensors, or tuples of them) within the dtype's tolerance of the reference's scale."""
    if isinstance(ref, (tuple, list)):
        return len(out) == len(ref) and all(agrees(o, r) for o, r in zip(out, ref, strict=True))
    if ref is None or out is None:
        return ref is out
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    real = torch.empty((), dtype=ref.dtype).real.dtype
    rtol = _AGREE.get(real, 1e-3)
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return ref.numel() == 0 or float((out - ref).abs().max()) <= rtol * scale + torch.finfo(real).tiny


def _finite(ref: Result) -> bool:
    if isinstance(ref, (tuple, list)):
        return all(_finite(r) for r in ref)
    return ref is None or bool(torch.isfinite(ref).all())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_time(option: Callable[[], Result], device: torch.device, before: float) -> float:
    """The option's time once warm: timed again while a call runs over WARMING times faster than the one before
    (``before``: the time of the call before the first, its warm-up), at most WARM_CALLS more times.

    Examples:
        >>> import itertools, torch
        >>> from convgrad.tuning import tuner
        >>> seconds = iter([2.8, 0.65, 0.6])  # its probe took 3.8 s: the option is still warming up
        >>> real, tuner.timed = tuner.timed, lambda option, device: (option(), next(seconds))
        >>> round(tuner.warm_time(lambda: None, torch.device("cpu"), 3.8), 2)
        0.6
        >>> tuner.timed = real
    """
    seconds = timed(option, device)[1]
    for _ in range(WARM_CALLS):
        if seconds * WARMING >= before:
            break
        before, seconds = seconds, timed(option, device)[1]
    return seconds


def timed(option: Callable[[], Result], device: torch.device) -> tuple[Result, float]:
    """The option's result and its wall time in seconds (the device synchronized before and after)."""
    _sync(device)
    start = time.perf_counter()
    out = option()
    _sync(device)
    return out, time.perf_counter() - start
