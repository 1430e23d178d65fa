"""The layering is part of the contract (issue 27): layers import downward only, with no cycles (import-linter's
contracts in pyproject.toml, run by .ci/run), and no module imports another module's underscore names.

The underscore rule is an AST scan of src/convgrad: ``from M import _x`` and ``M._x`` on an imported convgrad
module. ``ALLOWED`` lists the crossings that remain, each with the branch that removes it (issue 27's split); an
entry that no longer occurs fails too, so the list only shrinks.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "convgrad"

# importer -> the private names it takes, and who removes the crossing
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_crossings(root: Path) -> set[tuple[str, str]]:
    """(importer, module.name) for every underscore name a module of the package at ``root`` takes from another."""
    modules = {_module_name(root, p): p for p in root.rglob("*.py")}
    found: set[tuple[str, str]] = set()
    for me, path in modules.items():
        tree = ast.parse(path.read_text())
        here = me.split(".") if path.name == "__init__.py" else me.split(".")[:-1]
        bound: dict[str, str] = {}  # local name -> the convgrad module it is
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here[:len(here) - node.level + 1] if node.level else []
                source = ".".join([*base, *([node.module] if node.module else [])])
                if source.split(".")[0] != root.name:
                    continue
                for alias in node.names:
                    if _private(alias.name) and source != me:
                        found.add((me, f"{source}.{alias.name}"))
                    if f"{source}.{alias.name}" in modules:
                        bound[alias.asname or alias.name] = f"{source}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == root.name:
                        bound[alias.asname or root.name] = alias.name if alias.asname else root.name
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and _private(node.attr) and isinstance(node.value, ast.Name)
                    and bound.get(node.value.id, me) != me):
                found.add((me, f"{bound[node.value.id]}.{node.attr}"))
    return found


def test_no_module_imports_another_modules_underscore_names() -> None:
    found = private_crossings(SRC)
    new = sorted(found - set(ALLOWED))
    assert not new, f"a module takes another's private name; give the name a public home: {new}"
    gone = sorted(set(ALLOWED) - found)
    assert not gone, f"fixed: remove these from ALLOWED in {Path(__file__).name}: {gone}"


def test_the_scan_finds_both_forms_of_crossing(tmp_path: Path) -> None:
    """The scanner itself bites (its mutant): a package whose b.py takes a._x, once by name and once by attribute,
    relative and absolute, while a module using its own _y is fine."""
    pkg = tmp_path / "convgrad"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("_x = 1\n_y = 2\nprint(_y)\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("from ..a import _x\nfrom convgrad import a\nprint(a._y, _x)\n")
    assert private_crossings(pkg) == {("convgrad.sub.b", "convgrad.a._x"), ("convgrad.sub.b", "convgrad.a._y")}


def _lint_imports(root: Path) -> subprocess.CompletedProcess[str]:
    """lint-imports on the tree at ``root`` (its pyproject.toml's contracts, its src/ on the path)."""
    code = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run([sys.executable, "-c", code, "--no-cache"], capture_output=True, text=True, cwd=root,
                          env={"PYTHONPATH": str(root / "src"), "PATH": "/usr/bin:/bin"}, timeout=600)


@pytest.mark.slow  # two fresh import graphs of the package
def test_the_layer_contracts_hold_and_a_back_import_breaks_them(tmp_path: Path) -> None:
    """.ci/run's lint-imports passes on this tree, and fails once a backend imports the layer above it (the
    mutant: ``from convgrad import functional`` in backends/native.py)."""
    pytest.importorskip("importlinter", reason="import-linter is in the dev extras (constraints.txt pins it)")
    shutil.copytree(SRC, tmp_path / "src" / "convgrad", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    kept = _lint_imports(tmp_path)
    assert kept.returncode == 0 and "0 broken" in kept.stdout, kept.stdout + kept.stderr
    native = tmp_path / "src" / "convgrad" / "backends" / "native.py"
    native.write_text(native.read_text() + "\nfrom convgrad import functional  # noqa: E402, F401  (the mutant)\n")
    broken = _lint_imports(tmp_path)
    assert broken.returncode != 0, broken.stdout
    assert "convgrad.backends is not allowed to import convgrad.functional" in broken.stdout, broken.stdout
