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
   (``Exploration``): those calls compute real results, so comparing costs no extra calls,
   only the difference in speed while a slower survivor runs. Each survivor in turn runs
   twice in a row, the second call timed, and a round's times are paired with the anchor's
   (the incumbent if it survived, else the fastest screened); after ``_MIN_ROUNDS`` rounds (or
   sooner when ``_ELIMINATE`` leaves one option) a clear call is settled, a close one gets up
   to ``_CLOSE_ROUNDS``;
4. **pick**: the incumbent (native, for "auto") stays unless another option beats it by more
   than ``PREFER_NATIVE`` in the median over rounds of the paired ratios; "split" must beat
   every single option by ``SPLIT_MARGIN``.

The first call thus costs the screening: two calls of every option on an eighth of the batch,
a quarter of one call per option.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PREFER_NATIVE", "PRUNE_ESTIMATE", "SCREEN_DROP", "SPLIT_MARGIN", "WARMING", "WARM_CALLS", "Choice",
           "Exploration", "Result", "Run", "Screen", "agrees", "decide", "prune", "screen", "screen_batch", "timed",
           "tune", "warm_time"]

Result = Any  # a gradient, a (grad_input, grad_weight) pair, or whatever the options compute
Run = Callable[[int], Result]  # run(n): the result for the first n samples of the batch

# agreement with the reference on the probe: max |a - ref| <= RTOL * max |ref| + ATOL (per real dtype)
_AGREE = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-3, 1e-6), torch.float16: (2e-2, 1e-3),
          torch.bfloat16: (5e-2, 1e-2)}
# Rounds of an exploration: at least _MIN_ROUNDS unless _ELIMINATE leaves one option; a clear call (runner-up
# _CLEAR_MARGIN slower than the best) settles there. A close call goes on with the options within _CLEAR_MARGIN of
# the best (and the anchor), up to _CLOSE_ROUNDS rounds: three rounds alone misranked a close call
# (benchmarks/results/auto_margins.md).
_MIN_ROUNDS, _CLOSE_ROUNDS = 3, 7
_CLEAR_MARGIN = 1.1
# Before _MIN_ROUNDS, an option over this factor of the best after round r is dropped (and the exploration settles
# when one option is left): one paired ratio carries 3-5% of noise on a shared 2-core machine, so an option 25%
# behind after one round, or 15% behind after two, is not the winner.
_ELIMINATE = {1: 1.25, 2: 1.15}
# Another option replaces the incumbent (native, or the backend that won both gradients) only when it beats it by
# more than PREFER_NATIVE; "split" must beat every single option by SPLIT_MARGIN. A tuning's timings carry noise, and
# the speeds drift within a process, so a winner by less than that may be slower when measured again; a smaller
# margin lost more than it won, and tunings flattered "split" (two calls that share nothing) by up to 6%
# (benchmarks/results/auto_margins.md, made by `convgrad bench --suite all --threads 2 --repeats 36`).
PREFER_NATIVE, SPLIT_MARGIN = 1.03, 1.05
# Screening: a slice of SCREEN_FRACTION-th of the batch, but at least SCREEN_MIN samples; an option over SCREEN_DROP
# times the fastest there is dropped. A slice is a coarse guide, so the factor is generous and the survivors are
# settled on the whole batch: per-sample speeds move with the batch (a slice fits in the caches), so the factor
# keeps an option unless it is far behind (benchmarks/results/auto_screen.json, made by benchmarks/auto_screen.py).
SCREEN_FRACTION, SCREEN_MIN, SCREEN_DROP = 8, 4, 2.0
# Pruning by cost model: an option estimated over PRUNE_ESTIMATE times the cheapest is never run.
PRUNE_ESTIMATE = 4.0
# Warm-up: an option whose timed call ran over WARMING times faster than its call before may still be warming up
# (fft's calls on a new shape in a fresh process: 3.8 s, 2.8 s, then 0.65 s), so it is timed again, at most WARM_CALLS
# more times, in the screening and in each exploration round. A margin over the noise of one call, not a large one:
# the second call was only 1.4x faster than the first there.
WARMING, WARM_CALLS = 1.1, 2


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


def prune(estimates: Mapping[str, float], keep: tuple[str, ...] = ()) -> set[str]:
    """The options a cost model rules out: estimated over PRUNE_ESTIMATE times the cheapest (never those in keep).

    Examples:
        >>> from convgrad.tuning.tuner import prune
        >>> sorted(prune({"ghost": 45.0, "unfold": 10.0, "conv": 30.0}))
        ['ghost']
    """
    if not estimates:
        return set()
    low = min(estimates.values())
    return {n for n, e in estimates.items() if n not in keep and e > PRUNE_ESTIMATE * low}


def screen(options: Mapping[str, Run], batch: int, device: torch.device, reference: str,
           agree: Callable[[Result, Result], bool] | None = None, on: int | None = None,
           behind: float | None = None, extra: Mapping[str, float] | None = None) -> Screen:
    """Probe every option on ``on`` samples (default ``screen_batch(batch)``) against the reference's probe, then
    time each once.

    An option whose probe disagrees (or whose result is not finite while the reference's is) is rejected and not
    timed; a probe is dropped once compared, so the screening holds two results at most. When the reference's
    own probe is not finite, only the reference is kept (nothing can be checked).

    ``behind`` (a choice taken on the screening alone, as the per-sample methods'): each option is timed right
    after its probe, in the order given, and one whose probe ran over ``behind`` times the fastest time so far is
    not timed: its probe's time stands (a first call carries first-call costs on top of a warm call's work, so its
    warm call could win only if those were over ``behind`` times that work); none is re-timed (``_screen_behind``).
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
    """``screen`` with ``behind``: probe and time each option in turn, leaving untimed one whose probe is far
    behind the fastest so far. An option's time is the faster of its probe and its timed call: against a call
    delayed by other load, the two calls count as the re-time of ``screen`` (an option far behind on both could
    win only if both were delayed)."""
    ref_s = min(first, warm_time(lambda: options[reference](n), device, first))
    times = {reference: (ref_s + add.get(reference, 0.0)) * scale}
    ok = [reference]
    for name in options:
        if name == reference:
            continue
        out, probe = timed(lambda r=options[name]: r(n), device)
        right = agree(out, ref)
        del out
        if not right:
            continue
        ok.append(name)
        seconds = (probe + add.get(name, 0.0)) * scale
        if seconds <= behind * min(times.values()):
            warm = min(probe, warm_time(lambda r=options[name]: r(n), device, probe))
            seconds = (warm + add.get(name, 0.0)) * scale
        times[name] = seconds
    ok.sort(key=list(options).index)
    return Screen({k: times[k] for k in ok}, tuple(k for k in options if k not in ok), {reference: ref}, n)


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
    rtol, atol = _AGREE.get(real, (1e-3, 1e-6))
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    return ref.numel() == 0 or float((out - ref).abs().max()) <= rtol * scale + atol


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


def _winner(ratios: dict[str, float], incumbent: str = "native") -> str:
    """The incumbent (native; for both gradients, the backend that won each of them), unless another option
    beats it by more than PREFER_NATIVE; "split" only if it beats every single option by SPLIT_MARGIN."""
    incumbent = incumbent if incumbent in ratios else min(ratios, key=ratios.__getitem__)
    singles = [n for n in ratios if n != "split"] or [incumbent]
    best = min(singles, key=lambda n: (ratios[n], n != incumbent))
    winner = best if ratios[best] * PREFER_NATIVE <= ratios[incumbent] else incumbent
    if "split" in ratios and ratios["split"] * SPLIT_MARGIN <= ratios[best]:
        winner = "split"
    return winner


def _paired(samples: dict[str, list[float]], anchor: str = "native") -> dict[str, float]:
    """Each option's median over rounds of its time over the anchor's in the same round (the anchor: 1.0).

    Paired within a round, load that comes and goes during the tuning cancels out of each ratio; the
    median, not the best time, is what a layer then runs at (`convgrad bench` reports the same statistic).
    An option dropped from later rounds is paired with the anchor's first rounds only.
    """
    ref = samples[anchor]
    return {n: statistics.median(t / r for t, r in zip(s, ref)) for n, s in samples.items()}


class Exploration:
    """The comparison of a choice's pending options on the calls that follow (see the module doc, step 3).

    Ask ``next()`` which option to run and whether to time it; report a timed call with ``record``, which
    returns the settled winner once there is one.

    Examples:
        >>> from convgrad.tuning.tuner import Exploration
        >>> explore, seconds, settled = Exploration(("native", "gemm")), {"native": 1.0, "gemm": 0.5}, None
        >>> while settled is None:
        ...     name, timed = explore.next()
        ...     settled = explore.record(name, seconds[name]) if timed else explore.skip()
        >>> settled, explore.rounds
        ('gemm', 1)
    """

    def __init__(self, pending: tuple[str, ...]) -> None:
        self.anchor = pending[0]  # the incumbent, if it survived the screening (see decide)
        self.active = list(pending)
        self.samples: dict[str, list[float]] = {n: [] for n in pending}
        self.rounds, self._turn, self._calls = 0, 0, 0
        self._before: float | None = None  # seconds per sample of the call before the timed one, when timed
        self._warmed = 0  # extra warm-up calls of the current option (WARMING)

    def next(self) -> tuple[str, bool]:
        """The option the next call runs, and whether that call is timed (the second of two in a row)."""
        order = self.active[self.rounds % len(self.active):] + self.active[:self.rounds % len(self.active)]
        return order[self._turn], self._calls == 1

    def skip(self, seconds_per_sample: float | None = None) -> None:
        """The untimed call ran (in ``seconds_per_sample``, if it was measured): the next one is timed."""
        self._calls, self._before, self._warmed = 1, seconds_per_sample, 0

    def record(self, name: str, seconds_per_sample: float) -> str | None:
        """Keep a timed call's time; at the end of a round, drop or settle. Returns the winner once settled.

        A call over WARMING times faster than the one before it (its option still warming up on this batch) is
        not kept: the option's next call is timed instead, at most WARM_CALLS times in a row."""
        if (self._before is not None and seconds_per_sample * WARMING < self._before
                and self._warmed < WARM_CALLS):
            self._before, self._warmed = seconds_per_sample, self._warmed + 1
            return None
        self.samples[name].append(seconds_per_sample)
        self._calls, self._turn, self._before = 0, self._turn + 1, None
        if self._turn < len(self.active):
            return None
        self._turn, self.rounds = 0, self.rounds + 1
        ratios = _paired({n: self.samples[n] for n in self.active}, self.anchor)
        best = min(ratios.values())
        margin = _ELIMINATE[self.rounds] if self.rounds < _MIN_ROUNDS else _CLEAR_MARGIN
        close = [n for n in self.active if ratios[n] <= margin * best]
        if len(close) < 2 or self.rounds >= _CLOSE_ROUNDS:
            return _winner(ratios, self.anchor)
        self.active = [n for n in self.active if n in close or n == self.anchor]
        return None

    def times(self, batch: int) -> dict[str, float]:
        """Each option's median time per call on ``batch`` samples (s)."""
        return {n: statistics.median(s) * batch for n, s in self.samples.items() if s}
