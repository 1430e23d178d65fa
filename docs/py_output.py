"""Show under each Python block of the docs what it prints, as the command-line pages show their commands' output.

A page asks for a block's output with a marker right after the block, and this script writes what the block
printed between the markers (the blocks of a page run in order in one namespace, as a reader pastes them):

    ```python
    print(cg.backends())
    ```
    <!-- py-output -->
    ```text
    ['auto', 'channels_last', ...]
    ```
    <!-- /py-output -->

Flag ``volatile`` (``<!-- py-output volatile -->``) is for output with timings or random numbers: the block is
shown as an example, said so above it, and the check compares only its shape (``masked``).

    python docs/py_output.py           # regenerate every block in docs/**/*.md
    python docs/py_output.py --check   # exit 1 and show a diff if a block is out of date

tests/test_docs.py runs every page's blocks once, and checks both that they run and that their output is current.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
if str(DOCS) not in sys.path:
    sys.path.insert(0, str(DOCS))
from cli_output import EXAMPLE  # noqa: E402  (the one wording of "this is an example")
# a fenced block (``` or ~~~, three or more) at any indent (inside tabs or admonitions too), closed by the same fence
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)"
                   r"^(?P=indent)(?P=fence)[ \t]*$\n?", re.S | re.M)
PYTHON = {"python", "py", "python3"}
MARKER = re.compile(r"\n?(?P<indent>[ \t]*)<!-- py-output(?P<flags>[^>]*?) -->\n(?P<body>.*?)^(?P=indent)"
                    r"<!-- /py-output -->$", re.S | re.M)
_NUMBER = re.compile(r"[-+]?\d+(?:[.:]\d+)*(?:e[-+]?\d+)?%?")


@dataclass(frozen=True)
class Block:
    """One Python block of a page, and the output marker after it (if any)."""

    page: Path
    code: str
    prints: bool
    volatile: bool = False
    body: str | None = None  # the text between the markers; None: no marker
    span: tuple[int, int] = (0, 0)  # of the body
    indent: str = ""


def blocks(page: Path) -> list[Block]:
    """The Python blocks of a page, in order, each with its output marker."""
    text, found = page.read_text(), []
    for m in FENCE.finditer(text):
        if m["lang"] not in PYTHON:
            continue
        code = textwrap.dedent(m["body"])
        marker = MARKER.match(text, m.end())
        prints = "print(" in code
        if marker is None:
            found.append(Block(page, code, prints))
            continue
        flags = marker["flags"].split()
        if set(flags) - {"volatile"}:
            raise ValueError(f"{page.name}: unknown py-output flags {flags}")
        found.append(Block(page, code, prints, "volatile" in flags, marker["body"], marker.span("body"),
                           marker["indent"]))
    return found


def render(block: Block, output: str) -> str:
    """The Markdown between the markers: the output as a text block (an example, said so, when volatile)."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()] or ["(nothing printed)"]
    parts = ([EXAMPLE, ""] if block.volatile else []) + ["```text", *lines, "```"]
    return "".join(f"{block.indent}{line}\n" if line else "\n" for line in parts)


def masked(text: str) -> list[str]:
    """What must stay the same in a volatile block: its lines, each starting with the same word (numbers masked);
    the rest of a line may change with the machine (a time, which backend auto settled on, a random value)."""
    return [(_NUMBER.sub("#", line).split() or [""])[0] for line in text.strip("\n").splitlines()]


@contextlib.contextmanager
def page_state() -> Iterator[None]:
    """Run a page as a reader would (auto-tuning on, no cache file), on one thread (tiny convolutions are far faster
    so on a loaded machine), and leave no trace:
    threads, environment, auto's mode and choices, and the working directory are restored."""
    import torch

    from convgrad.backends import auto

    threads, env, cwd, mode = torch.get_num_threads(), dict(os.environ), os.getcwd(), auto.get_mode()
    torch.set_num_threads(1)
    for var in ("CONVGRAD_AUTOTUNE", "CONVGRAD_AUTOTUNE_CACHE"):
        os.environ.pop(var, None)
    auto.set_mode("tune")  # what a reader gets (the test suite runs in fixed mode)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        auto.set_mode(mode)
        auto.clear()


def _torchvision_stand_in() -> None:
    """timm (a block of the per-sample page) imports a few names of torchvision at import time; where torchvision
    is not installed (CI: the registry has no CPU wheel of it for this torch), the tests' stand-in gives them."""
    try:
        import torchvision  # noqa: F401
    except ImportError:
        stubs = str(ROOT / "tests" / "stubs")
        if stubs not in sys.path:
            sys.path.append(stubs)


def run_page(page: Path, workdir: Path | None = None) -> list[str]:
    """Run the page's Python blocks in order in one namespace (in ``workdir``, default a fresh temporary folder);
    what each printed."""
    _torchvision_stand_in()
    namespace: dict[str, Any] = {"__name__": "__main__"}
    outputs = []
    with page_state(), tempfile.TemporaryDirectory() as tmp:
        os.chdir(workdir or tmp)  # whatever a block writes lands here
        for n, block in enumerate(blocks(page)):
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(block.code, f"{page.name} [python block {n}]", "exec"), namespace)
            outputs.append(out.getvalue())
    return outputs


def problems(page: Path, outputs: list[str]) -> list[str]:
    """A printing block without its output marker, and a marker whose output is out of date."""
    found = []
    for n, (block, output) in enumerate(zip(blocks(page), outputs, strict=True)):
        where = f"{page.name if not page.is_relative_to(DOCS) else page.relative_to(DOCS)} [python block {n}]"
        if block.body is None:
            if block.prints:
                found.append(f"{where}: prints, but has no <!-- py-output --> marker after it")
            continue
        fresh = render(block, output)
        if (masked(fresh) != masked(block.body)) if block.volatile else fresh != block.body:
            diff = difflib.unified_diff(block.body.splitlines(), fresh.splitlines(), "page", "now", lineterm="")
            found.append(f"{where}: out of date\n" + "\n".join(diff))
    return found


def write(page: Path, outputs: list[str]) -> bool:
    """Write each block's output between its markers; True if the page changed."""
    text = before = page.read_text()
    for block, output in reversed(list(zip(blocks(page), outputs, strict=True))):  # from the end: spans stay valid
        if block.body is not None:
            text = text[:block.span[0]] + render(block, output) + text[block.span[1]:]
    if text != before:
        page.write_text(text)
    return text != before


def pages() -> list[Path]:
    """Every page with a Python block."""
    return [p for p in sorted(DOCS.rglob("*.md")) if blocks(p)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a block is out of date")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: every page with a Python block)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    found = []
    for page in [p.resolve() for p in args.pages] or pages():
        outputs = run_page(page)
        if args.check:
            found += problems(page, outputs)
        elif write(page, outputs):
            print(f"updated {page.relative_to(DOCS)}")
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    raise SystemExit(main())
