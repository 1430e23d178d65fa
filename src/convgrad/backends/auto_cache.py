"""Persistence of "auto"'s tuned choices: the cache file, its location and its keys.

Off by default. ``CONVGRAD_AUTOTUNE_CACHE=1`` keeps the winners in
``<user cache dir>/convgrad/autotune.json`` (``$XDG_CACHE_HOME`` or ``~/.cache``; ``%LOCALAPPDATA%``
on Windows), ``CONVGRAD_AUTOTUNE_CACHE=/some/file.json`` in that file. Entries name the device
model and thread count, and the file is ignored under a different torch version.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

__all__ = ["cache_path", "clear", "device_name", "entry", "forget", "save"]

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
            if isinstance(data, dict) and data.get("torch") == torch.__version__:
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
        tmp.write_text(json.dumps({"torch": torch.__version__, "choices": merged}, indent=1))
        os.replace(tmp, path)  # atomic: a concurrent reader sees the old or the new file
