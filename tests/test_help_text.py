"""help() on the public objects shows plain text: no mkdocs cross-reference syntax, no paths into this repository."""

from __future__ import annotations

import importlib
import importlib.util
import pydoc
import re
import types
from typing import Any

import pytest

# what help() shows users; the docs site renders the same docstrings, so its links must not leak into them
MODULES = ["convgrad", "convgrad.nn", "convgrad.numpy", "convgrad.backends", "convgrad.explain", "convgrad.spec",
           "convgrad.functional", "convgrad.autograd", "convgrad.per_sample",
           *(["convgrad.opacus"] if importlib.util.find_spec("opacus") else [])]
LEAKS = re.compile(r"\]\[convgrad[\w.]*\]|\bdocs/[\w/-]+\.md")  # pydoc's own FILE line names the path: not a leak


def leaks(obj: Any) -> list[str]:
    """The cross-references and repository paths in what help(obj) prints."""
    return LEAKS.findall(pydoc.render_doc(obj, renderer=pydoc.plaintext))


def public_objects() -> list[tuple[str, Any]]:
    out = []
    for name in MODULES:
        module = importlib.import_module(name)
        out.append((name, module))
        out += [(f"{name}.{attr}", getattr(module, attr)) for attr in getattr(module, "__all__", ())
                if callable(getattr(module, attr)) and not isinstance(getattr(module, attr), types.ModuleType)]
    return out


@pytest.mark.parametrize("name,obj", public_objects(), ids=lambda v: v if isinstance(v, str) else "")
def test_help_shows_no_link_syntax_or_repository_paths(name: str, obj: Any) -> None:
    assert leaks(obj) == [], f"help({name}) shows {leaks(obj)}"


def test_the_leak_check_finds_a_link_and_a_path() -> None:
    """The check's own mutant: a docstring with both leaks is flagged."""
    def f() -> None:
        """As [`conv`][convgrad.autograd.conv]; source: docs/derivation.md."""

    assert leaks(f) == ["][convgrad.autograd.conv]", "docs/derivation.md"]
