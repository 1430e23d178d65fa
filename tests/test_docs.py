"""The documentation builds without warnings, and its examples run."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def test_mkdocs_strict_build(tmp_path: Path) -> None:
    for module in ("mkdocs", "mkdocstrings", "mkdocstrings_handlers.python"):
        if importlib.util.find_spec(module.split(".")[0]) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]' -c constraints.txt)")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(tmp_path / "site")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "convgrad.explain.native_backend" in api and "conv_backward" in api


def test_seed_answers_run(capsys: Any) -> None:
    blocks = _python_blocks(DOCS / "seeds.md")
    assert len(blocks) >= 6
    namespace: dict[str, Any] = {"__name__": "__main__"}
    for n, block in enumerate(blocks):
        exec(compile(block, f"docs/seeds.md[block {n}]", "exec"), namespace)  # each block asserts its claims
    assert "recipe matches torch autograd" in capsys.readouterr().out


def test_derivation_figures_come_from_make_figures() -> None:
    spec = importlib.util.spec_from_file_location("make_figures", DOCS / "make_figures.py")
    assert spec is not None and spec.loader is not None
    make_figures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_figures)
    used = set(re.findall(r"\(img/([\w.-]+\.png)\)", (DOCS / "derivation.md").read_text()))
    assert used == set(make_figures.FIGURES)
    assert all((DOCS / "img" / name).is_file() for name in used)
