"""Every test can fail: an AST pass over tests/*.py (issue 26).

A test function passes this check when its body (nested functions and lambdas included) holds an
``assert``, a ``raise``, a ``pytest.raises`` / ``pytest.warns`` / ``pytest.fail``, or a call to a
function that asserts: anything named ``assert*`` (``torch.testing.assert_close``, numpy's, our
``assert_matches_autograd``), ``gradcheck``/``gradgradcheck`` (they raise on a mismatch), or a
function defined in tests/ that passes this check itself (found transitively). A test must also not
``return`` early from its own body: a case that does not apply is not parametrised, or is skipped with
a reason. The check is syntactic, so it proves presence, not strength; the mutation score
(docs/contributing.md) measures strength.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent

# calls that fail a test by themselves, matched on the last name of the callee
_ASSERTING_CALLS = {"raises", "warns", "fail", "gradcheck", "gradgradcheck", "deprecated_call"}


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _direct(node: ast.AST, asserting: set[str]) -> bool:
    """Whether the subtree asserts by itself, or calls a function known to assert."""
    for sub in ast.walk(node):
        if isinstance(sub, (ast.Assert, ast.Raise)):
            return True
        if isinstance(sub, ast.Call):
            name = _callee(sub)
            if name.startswith("assert") or name in _ASSERTING_CALLS or name in asserting:
                return True
    return False


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _asserting_helpers(trees: list[ast.AST]) -> set[str]:
    """Names of the non-test functions in tests/ that assert, directly or through one another (a fixpoint)."""
    helpers = [f for tree in trees for f in _functions(tree) if not f.name.startswith("test")]
    found: set[str] = set()
    while True:
        more = {f.name for f in helpers if f.name not in found and _direct(f, found)}
        if not more:
            return found
        found |= more


def _early_returns(test: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A ``return`` in the test's own body (not in a function nested in it)."""
    stack: list[ast.AST] = list(test.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            return True
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            stack.extend(ast.iter_child_nodes(node))
    return False


def vacuous_tests(sources: dict[str, str]) -> list[str]:
    """``file::test`` for every test function among the sources that cannot fail (see the module doc)."""
    trees = {name: ast.parse(text, name) for name, text in sources.items()}
    asserting = _asserting_helpers(list(trees.values()))
    bad = []
    for name, tree in trees.items():
        for f in _functions(tree):
            if f.name.startswith("test") and (not _direct(f, asserting) or _early_returns(f)):
                bad.append(f"{name}::{f.name}")
    return bad


def _sources() -> dict[str, str]:
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(TESTS.glob("*.py"))}


def test_every_test_function_can_fail() -> None:
    assert vacuous_tests(_sources()) == []


@pytest.mark.parametrize("source", [
    "def test_x():\n    y = 1 + 1\n",  # asserts nothing
    "def test_x():\n    if True:\n        return\n    assert False\n",  # returns early
    "def helper():\n    return 1\n\ndef test_x():\n    helper()\n",  # its helper asserts nothing
    "class TestX:\n    def test_x(self):\n        print('ok')\n",  # a method
])
def test_the_check_flags_a_vacuous_test(source: str) -> None:
    """The check's own mutants: each source holds one test that cannot fail."""
    assert vacuous_tests({"synthetic.py": source}) == ["synthetic.py::test_x"]


@pytest.mark.parametrize("source", [
    "def test_x():\n    assert 1\n",
    "import pytest\ndef test_x():\n    with pytest.raises(ValueError):\n        int('a')\n",
    "def check(v):\n    assert v\n\ndef outer(v):\n    check(v)\n\ndef test_x():\n    outer(1)\n",  # transitively
    "import torch\ndef test_x():\n    torch.testing.assert_close(1.0, 1.0)\n",
])
def test_the_check_accepts_a_test_that_can_fail(source: str) -> None:
    assert vacuous_tests({"synthetic.py": source}) == []
