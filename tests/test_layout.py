"""The layout is part of the contract: the library never imports the commands, and the commands' old import
paths (``convgrad.check``, ``convgrad.bench``) still give the same functions."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    """Run code in a fresh interpreter (a clean sys.modules) that imports convgrad from this clone's src/."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"})


@pytest.mark.slow  # fresh interpreters
def test_the_library_never_imports_the_commands() -> None:
    proc = _python("""
        import importlib, pathlib, sys
        import convgrad
        root = pathlib.Path(convgrad.__file__).parent
        skip = {"cli", "check", "bench", "__main__"}  # the commands and their old import paths
        for path in sorted(root.rglob("*.py")):  # every module of the library, imported (pkgutil would import cli/)
            parts = path.relative_to(root).with_suffix("").parts
            if parts[0] not in skip:
                importlib.import_module(".".join(("convgrad", *parts)).removesuffix(".__init__"))
        print(sorted(m for m in sys.modules if m.startswith("convgrad.cli")))
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", proc.stdout


@pytest.mark.slow  # fresh interpreters
def test_old_import_paths_of_check_and_bench_still_work() -> None:
    proc = _python("""
        from convgrad.check import check_config, check_gradients, check_model, check_random, error_bound
        from convgrad.bench.layers import SUITES
        import convgrad.bench.report, convgrad.bench.timing
        import convgrad.check, convgrad.bench, convgrad.cli.check, convgrad.cli.bench
        assert convgrad.check is convgrad.cli.check and convgrad.bench is convgrad.cli.bench
        assert convgrad.bench.layers is convgrad.cli.bench.layers and check_config is convgrad.cli.check.check_config
        assert "default" in SUITES
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
