"""The screening's ``behind`` rule (convgrad.tuning.tuner.screen): the checking calls rank the options; one far behind
the fastest checking call is not timed again, and where one option is left close to it, nothing is. Fake clock: each
option's call takes the seconds scripted for it."""

from __future__ import annotations

import pytest
import torch

from convgrad.tuning import tuner

CPU = torch.device("cpu")


def _clocked(monkeypatch: pytest.MonkeyPatch, seconds: dict[str, list[float]]) -> tuple[dict[str, tuner.Run],
                                                                                          list[str]]:
    """Options that log their name; tuner.timed returns the next scripted time of the option that ran (the last
    time repeats)."""
    calls: list[str] = []

    def fake(option: object, device: torch.device) -> tuple[object, float]:
        out = option()  # type: ignore[operator]
        name = calls[-1]
        script = seconds[name]
        return out, script[min(calls.count(name), len(script)) - 1]

    monkeypatch.setattr(tuner, "timed", fake)
    options = {n: (lambda m, n=n: calls.append(n) or torch.ones(m)) for n in seconds}
    return options, calls


def test_an_option_whose_checking_call_is_far_behind_is_not_timed(monkeypatch: pytest.MonkeyPatch) -> None:
    """behind=4: "far" (its checking call 4.2x the reference's) runs once and keeps its probe's time; "near" (3.9x)
    is timed, once: with ``behind`` nothing is re-timed; the reference, fastest, is not timed again since "near"
    stays behind it. Without ``behind`` "far" runs 3 times (probe, timed call, re-time over SCREEN_DROP x the
    fastest), and so does "near"."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0], "far": [4.2, 1.0], "near": [3.9]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=4.0)
    assert [calls.count(n) for n in options] == [1, 1, 2], calls
    assert seen.times == pytest.approx({"ref": 1.0, "far": 4.2, "near": 3.9})
    calls.clear()
    tuner.screen(options, 8, CPU, "ref", on=8)
    assert [calls.count(n) for n in options] == [2, 3, 3], calls


def test_a_timed_call_slower_than_its_checking_call_counts_as_delayed(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``behind``, an option's time is the faster of its two calls: "delayed" (probe 1.2, timed call 3.0, a
    call slowed by other load) is timed at 1.2, as the re-time of a plain screening would have found it."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0], "delayed": [1.2, 3.0]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=4.0)
    assert calls.count("delayed") == 2 and seen.times == pytest.approx({"ref": 1.0, "delayed": 1.2})


def test_behind_compares_with_the_fastest_checking_call_and_keeps_a_faster_option(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fastest checking call, not the reference's: "fast" (0.2) and "warming" (0.5, within 4x) are timed again,
    the reference (1.0 = 5x fast) and "slow" (1.0) are not, though "slow" is only 1x the reference; an option still
    warming up on its checking call (3x its warm time) is timed and wins."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0], "fast": [0.2], "slow": [1.0], "warming": [0.5, 0.15]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=4.0)
    assert calls.count("ref") == calls.count("slow") == 1 and calls.count("warming") >= 2, calls
    assert min(seen.times, key=seen.times.__getitem__) == "warming"
    assert tuner.decide(8, seen.times, "ref").backend == "warming"


def test_where_the_checking_calls_leave_one_option_close_to_the_fastest_none_is_timed_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """behind=2: "fast" (0.4) is the only option within 2x the fastest checking call (the reference 1.0 is 2.5x,
    "mid" 0.9 is 2.25x): the checking calls decided, so each option runs once and keeps its checking call's time."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0, 0.1], "mid": [0.9, 0.1], "fast": [0.4, 0.3]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=2.0)
    assert calls == ["ref", "mid", "fast"], calls
    assert seen.times == pytest.approx({"ref": 1.0, "mid": 0.9, "fast": 0.4})
    calls.clear()  # within 2x: "mid" at 0.7 is timed again, with "fast"; the reference (2.5x) is not
    options, calls = _clocked(monkeypatch, {"ref": [1.0, 0.1], "mid": [0.7, 0.35], "fast": [0.4, 0.4]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=2.0)
    assert calls.count("ref") == 1 and calls.count("mid") >= 2 and calls.count("fast") == 2, calls
    assert min(seen.times, key=seen.times.__getitem__) == "mid"


def test_extra_seconds_count_in_the_times_and_in_the_cut(monkeypatch: pytest.MonkeyPatch) -> None:
    """``extra``: work an option shares with others, timed once by the caller, is added to each of its calls:
    "shared" (0.5 s of its own + 3.6 s shared = 4.1x the reference) is left untimed."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0], "shared": [0.5]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=4.0, extra={"shared": 3.6})
    assert calls.count("shared") == 1 and seen.times == pytest.approx({"ref": 1.0, "shared": 4.1})


def test_a_rejected_option_is_not_timed_with_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    options, calls = _clocked(monkeypatch, {"ref": [1.0], "wrong": [0.1]})
    options["wrong"] = lambda m: calls.append("wrong") or torch.zeros(m)
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=4.0)
    assert seen.rejected == ("wrong",) and calls.count("wrong") == 1 and "wrong" not in seen.times


def test_the_fastest_checking_call_is_timed_again_only_where_another_option_then_beats_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"lead" has the fastest checking call (0.8) and is timed last: where the others' warm calls stay above 0.8
    ("ref" 0.95), its own warm call could only lower its time, so it is not made; where one beats it ("ref" 0.7),
    it is, and wins at 0.5."""
    options, calls = _clocked(monkeypatch, {"ref": [1.0, 0.95], "lead": [0.8, 0.5]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=2.0)
    assert calls == ["ref", "lead", "ref"], calls
    assert seen.times == pytest.approx({"ref": 0.95, "lead": 0.8})
    options, calls = _clocked(monkeypatch, {"ref": [1.0, 0.7], "lead": [0.8, 0.5]})
    seen = tuner.screen(options, 8, CPU, "ref", on=8, behind=2.0)
    assert calls.count("lead") >= 2 and min(seen.times, key=seen.times.__getitem__) == "lead", calls
    assert seen.times["lead"] == pytest.approx(0.5)
