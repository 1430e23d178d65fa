"""Tuned choices in memory and on disk: ``Store`` (one kind of choice), the cache file, its location.

Every measured choice of convgrad (``auto``'s backends, the per-sample methods) lives in a
``Store``: a dict from a key to a ``Choice``, backed by the cache file under the key's text, and
watched for drift (a choice whose calls run much slower than tuned is forgotten and tuned again).

Persistence is off by default. ``CONVGRAD_AUTOTUNE_CACHE=1`` keeps the winners in
``<user cache dir>/convgrad/autotune.json`` (``$XDG_CACHE_HOME`` or ``~/.cache``; ``%LOCALAPPDATA%``
on Windows), ``CONVGRAD_AUTOTUNE_CACHE=/some/file.json`` in that file. Entries name the device
model and thread count, and the file is ignored under a different torch version.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import platform
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from convgrad.tuning.modes import bump
from convgrad.tuning.tuner import Choice, Exploration, Result, timed

__all__ = ["ANCHOR", "DRIFT", "DRIFT_CALLS", "DRIFT_MIN_S", "FORMAT", "MAX_RETUNES", "Store", "cache_path", "clear",
           "device_name", "entry", "forget", "reset_all", "save"]

FORMAT = 2  # of the cache file; a file of another format is ignored (format 1 stored "split" without its parts)
# The watch: calls this many times slower per sample than tuned, this many in a row, re-tune; choices tuned faster
# than DRIFT_MIN_S are not watched (cold caches alone slow down tiny calls, and little is lost)
DRIFT, DRIFT_CALLS, MAX_RETUNES, DRIFT_MIN_S = 2.0, 3, 2, 1e-3
# The option a drifting choice is compared with before it is tuned again (see Store.watched)
ANCHOR = "native"
_STORES: list[Store] = []

_stored: dict[str, dict[str, Any]] = {}  # the cache file's entries, by key text
_loaded_from: Path | None = None


def cache_path() -> Path | None:
    """The persistence file named by ``CONVGRAD_AUTOTUNE_CACHE``, or None when persistence is off."""
    value = os.environ.get("CONVGRAD_AUTOTUNE_CACHE", "").strip()
    if value.lower() in ("", "0", "false", "off", "no"):
        return None
    if value.lower() not in ("1", "true", "on", "yes"):
        return Path(value).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.environ.get("LOCALAPPDATA") or Path.home() / ".cache"
    return Path(base) / "convgrad" / "autotune.json"


@functools.cache
def device_name(device: torch.device) -> str:
    """The model of a device: the GPU's name, or the CPU's from /proc/cpuinfo (platform's elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def clear() -> None:
    """Forget the entries read from the file (it is read again on next use)."""
    global _loaded_from
    _stored.clear()
    _loaded_from = None


def entry(key_text: str) -> dict[str, Any] | None:
    """The file's entry for a key, or None (persistence off, no file, another torch version, no such key)."""
    global _loaded_from
    path = cache_path()
    if path is None:
        return None
    if path != _loaded_from:
        _loaded_from = path
        _stored.clear()
        with contextlib.suppress(OSError, ValueError):
            data = json.loads(path.read_text())
            if isinstance(data, dict) and data.get("torch") == torch.__version__ and data.get("format") == FORMAT:
                _stored.update(data.get("choices", {}))
    found = _stored.get(key_text)
    return found if isinstance(found, dict) else None


def forget(key_text: str) -> None:
    """Drop one entry read from the file, so that it is not loaded again in this process (the file keeps it
    until the next save)."""
    _stored.pop(key_text, None)


def save(entries: dict[str, dict[str, Any]]) -> None:
    """Write the file's entries updated with ``entries``; does nothing when persistence is off."""
    path = cache_path()
    if path is None:
        return
    merged = dict(_stored)
    merged.update(entries)
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"torch": torch.__version__, "format": FORMAT, "choices": merged}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file


class Store(dict[Hashable, Choice]):
    """One kind of tuned choice: a dict from key to Choice, backed by the cache file, watched for drift.

    Args:
        text: the key as stored in the cache file (it names the device model, not its index).
        valid: whether a choice read from the file can be used (its option names exist); others are tuned again.
    """

    def __init__(self, text: Callable[[Any], str], valid: Callable[[Choice], bool]) -> None:
        super().__init__()
        self.text, self.valid = text, valid
        self.slow: dict[Hashable, int] = {}  # calls in a row that ran DRIFT times slower than tuned
        self.retunes: dict[Hashable, int] = {}
        self.exploring: dict[Hashable, Exploration] = {}
        self.changes = 0  # bumped by every change of a choice: what a caller memoised from the store is stale
        _STORES.append(self)

    def __setitem__(self, key: Hashable, choice: Choice) -> None:
        self.changes += 1
        bump()
        super().__setitem__(key, choice)

    def __delitem__(self, key: Hashable) -> None:
        self.changes += 1
        bump()
        super().__delitem__(key)

    def pop(self, key: Hashable, *default: Any) -> Any:
        self.changes += 1
        bump()
        return super().pop(key, *default)

    def clear(self) -> None:
        self.changes += 1
        bump()
        super().clear()

    def lookup(self, key: Hashable) -> Choice | None:
        """The choice in memory, else in the cache file (a malformed or unusable entry counts as none)."""
        if key in self:
            return self[key]
        found = entry(self.text(key))
        if found is None:
            return None
        try:  # an entry edited by hand or written by another version: ignored, tuned again
            choice = Choice(str(found["backend"]), {str(n): float(t) for n, t in found.get("times", {}).items()},
                            tuple(map(str, found.get("rejected", ()))), int(found.get("batch", 0)),
                            tuple(map(str, found.get("parts", ()))), tuple(map(str, found.get("pending", ()))))
        except (TypeError, ValueError, AttributeError, KeyError):
            return None
        if not self.valid(choice):
            return None
        self[key] = choice
        return choice

    def remember(self, key: Hashable, choice: Choice) -> None:
        """Keep the choice, and write it to the cache file when persistence is on."""
        self[key] = choice
        if cache_path() is not None:
            save({s.text(k): {"backend": c.backend, "times": c.times, "rejected": list(c.rejected),
                              "batch": c.batch, "parts": list(c.parts), "pending": list(c.pending)}
                  for s in _STORES for k, c in s.items()})

    def reset(self) -> None:
        """Forget every choice and drift count held in memory."""
        self.clear()
        self.slow.clear()
        self.retunes.clear()
        self.exploring.clear()

    def run(self, key: Hashable, choice: Choice, batch: int, device: torch.device,
            make: Callable[[str], Callable[[], Result]]) -> Result:
        """Compute the result with the option the choice says now: a pending option in turn while it is explored
        (the call timed when it is the second of two in a row; settled, the choice is remembered), else the
        chosen one, watched for drift. ``make(name)`` gives the call of an option on the whole batch."""
        if not choice.pending:
            return self.watched(key, choice, batch, device, make(choice.backend), make)
        explore = self.exploring.setdefault(key, Exploration(choice.pending))
        name, is_timed = explore.next()
        if not is_timed:  # the warm-up call, timed too: an option still warming up gets another (WARMING)
            out, seconds = timed(make(name), device)
            explore.skip(seconds / max(batch, 1))
            return out
        out, seconds = timed(make(name), device)
        winner = explore.record(name, seconds / max(batch, 1))
        if winner is not None:
            del self.exploring[key]
            self.remember(key, Choice(winner, {**choice.times, **explore.times(choice.batch)}, choice.rejected,
                                      choice.batch, choice.parts))
        return out

    def watched(self, key: Hashable, choice: Choice, batch: int, device: torch.device,
                run: Callable[[], Result], make: Callable[[str], Callable[[], Result]] | None = None) -> Result:
        """Run the chosen option; on the CPU, time it, and forget the choice (the next call tunes again) once it
        ran DRIFT times slower per sample than tuned, DRIFT_CALLS calls in a row, at most MAX_RETUNES times.

        When the choice is not the anchor ``ANCHOR`` and ``make`` can run the anchor, the anchor is timed once
        then: if the choice is still within DRIFT of its tuned ratio to the anchor, the machine slowed down, not
        the choice (a loaded machine slows fft's many ops more than native's one), so the choice is kept, its
        times scaled to the anchor's now. A re-tuning costs a screening of every option."""
        tuned = choice.times.get(choice.backend, 0.0)
        if (device.type != "cpu" or tuned < DRIFT_MIN_S or not (choice.batch and batch)
                or self.retunes.get(key, 0) >= MAX_RETUNES):
            return run()
        out, seconds = timed(run, device)
        slow = seconds / batch > DRIFT * tuned / choice.batch
        self.slow[key] = self.slow.get(key, 0) + 1 if slow else 0
        if self.slow[key] >= DRIFT_CALLS:
            del self.slow[key]
            anchor = choice.times.get(ANCHOR, 0.0)
            if make is not None and choice.backend != ANCHOR and anchor > 0.0:
                now = timed(make(ANCHOR), device)[1] / batch * choice.batch  # the anchor's time on the tuned batch
                if seconds / batch * choice.batch / now <= DRIFT * tuned / anchor:
                    self[key] = dataclasses.replace(choice, times={n: t * now / anchor
                                                                   for n, t in choice.times.items()})
                    return out
            self.retunes[key] = self.retunes.get(key, 0) + 1
            self.pop(key, None)
            forget(self.text(key))
        return out


def reset_all() -> None:
    """Forget every store's choices held in memory and the entries read from the file (it is read again)."""
    for store in _STORES:
        store.reset()
    clear()
