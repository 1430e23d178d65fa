"""Steps 3 and 4 of a tuning (``tuner``'s module doc): settle the survivors of a screening on the calls that follow,
and pick the winner from their paired times.

``Exploration`` is fed the times of real calls (it runs nothing itself): each survivor in turn runs twice in a row,
the second call timed; a round's times are paired with the anchor's, and after ``_MIN_ROUNDS`` rounds (or sooner
when ``_ELIMINATE`` leaves one option) a clear call is settled, a close one gets up to ``_CLOSE_ROUNDS``. ``pick``
keeps the incumbent unless another option beats it by more than ``PREFER_NATIVE``; "split" must beat every single
option by ``SPLIT_MARGIN``.
"""

from __future__ import annotations

import statistics

__all__ = ["PREFER_NATIVE", "SPLIT_MARGIN", "WARMING", "WARM_CALLS", "Exploration", "pick"]

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
# Warm-up: an option whose timed call ran over WARMING times faster than its call before may still be warming up
# (fft's calls on a new shape in a fresh process: 3.8 s, 2.8 s, then 0.65 s), so it is timed again, at most WARM_CALLS
# more times, in the screening and in each exploration round. A margin over the noise of one call, not a large one:
# the second call was only 1.4x faster than the first there.
WARMING, WARM_CALLS = 1.1, 2


def pick(ratios: dict[str, float], incumbent: str = "native") -> str:
    """The winner from each option's median paired ratio (``ratios``): the incumbent (native; for both gradients,
    the backend that won each of them), unless another option beats it by more than PREFER_NATIVE; "split" only if
    it beats every single option by SPLIT_MARGIN.

    Examples:
        >>> from convgrad.tuning.settle import pick
        >>> pick({"native": 1.0, "fwdconv": 0.98}), pick({"native": 1.0, "fwdconv": 0.96})
        ('native', 'fwdconv')
    """
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
        >>> from convgrad.tuning.settle import Exploration
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
            return pick(ratios, self.anchor)
        self.active = [n for n in self.active if n in close or n == self.anchor]
        return None

    def times(self, batch: int) -> dict[str, float]:
        """Each option's median time per call on ``batch`` samples (s)."""
        return {n: statistics.median(s) * batch for n, s in self.samples.items() if s}
