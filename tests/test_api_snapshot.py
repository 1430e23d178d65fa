"""The public API is a contract: every documented module's ``__all__`` and each name's signature are compared with
``tests/api_snapshot.json``, taken before the restructuring of issue 27.

Regenerate only for a deliberate API change (and say so in the CHANGELOG): ``python tests/test_api_snapshot.py``.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

SNAPSHOT = Path(__file__).with_name("api_snapshot.json")
MODULES = (
    "convgrad", "convgrad.nn", "convgrad.numpy", "convgrad.opacus", "convgrad.explain", "convgrad.backends",
    "convgrad.spec", "convgrad.functional", "convgrad.autograd", "convgrad.per_sample",
)


def _signature(obj: Any) -> str:
    try:
        return str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "<no signature>"


def describe(obj: Any) -> Any:
    """One public object as JSON: its kind and signature; for a class also its own public methods and properties."""
    if inspect.isclass(obj):
        members = {}
        for name, member in sorted(vars(obj).items()):
            if name.startswith("_") and name != "__init__":
                continue
            if isinstance(member, property):
                members[name] = "property"
            elif isinstance(member, (staticmethod, classmethod)):
                members[name] = _signature(member.__func__)
            elif inspect.isfunction(member):
                members[name] = _signature(member)
        return {"kind": "class", "signature": _signature(obj), "members": members}
    if callable(obj):
        return {"kind": "callable", "signature": _signature(obj)}
    if inspect.ismodule(obj):
        return {"kind": "module", "name": obj.__name__}
    return {"kind": type(obj).__name__}


def snapshot() -> dict[str, Any]:
    """Every module's ``__all__`` (sorted) with each name described."""
    for modname in MODULES:  # every module imported first: importing convgrad.explain rebinds convgrad.explain
        importlib.import_module(modname)
    out: dict[str, Any] = {}
    for modname in MODULES:
        module = importlib.import_module(modname)
        out[modname] = {name: describe(getattr(module, name)) for name in sorted(module.__all__)}
    return out


@pytest.fixture(scope="module")
def current() -> dict[str, Any]:
    """The snapshot of a fresh interpreter: which object ``convgrad.explain`` names depends on import order (the
    function, or the callable package once imported), so this process's earlier tests must not decide it."""
    out = subprocess.run([sys.executable, __file__, "--print"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


@pytest.mark.parametrize("modname", MODULES)
def test_public_api_matches_the_snapshot(modname: str, current: dict[str, Any]) -> None:
    expected = json.loads(SNAPSHOT.read_text())[modname]
    actual = current[modname]
    assert sorted(actual) == sorted(expected), f"{modname}.__all__ changed"
    for name in expected:
        assert actual[name] == expected[name], f"{modname}.{name} changed its signature"


if __name__ == "__main__":
    if sys.argv[1:] == ["--print"]:
        sys.stdout.write(json.dumps(snapshot()))
    else:
        SNAPSHOT.write_text(json.dumps(snapshot(), indent=1, sort_keys=True) + "\n")
        sys.stdout.write(f"wrote {SNAPSHOT}\n")
