"""Fill the command-line pages with the real output of the commands they show.

A page asks for a command's output with a marker, and this script writes the block under it:

    <!-- cli-output: convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2 -->
    ```text
    $ convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2
    ...what the command printed, stdout and stderr in the order they came...
    ```
    <!-- /cli-output -->

Flags go before the colon: ``volatile`` for output with timings or machine-dependent numbers
(shown as an example, said so above it; the check below compares it with every number masked), ``exit=N`` for a command that is meant to
exit with status N (default 0; any other exit status is an error), ``columns=N`` for a table too wide
for the default 100 columns (its cells would wrap and be cut to "…"; the page scrolls it sideways).

    python docs/cli_output.py           # regenerate every block in docs/**/*.md
    python docs/cli_output.py --check   # exit 1 and show a diff if a block is out of date

The commands run through ``convgrad.cli.main`` in one child process (so torch is imported once; the
test runs them in its own process), each in a fresh empty working directory, with 100 columns (or the
block's ``columns=N``), no
colour, auto-tuning on as a user has it, one thread (the outputs shown
do not depend on it, and on a loaded machine tiny convolutions run far faster on one) and no tuned
choices carried over from the command before.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
MARKER = re.compile(r"^<!-- cli-output(?P<flags>[^:]*): (?P<command>.+?) -->\n(?P<body>.*?)^<!-- /cli-output -->$",
                    re.M | re.S)
ENV = {"COLUMNS": "100", "LINES": "40", "NO_COLOR": "1", "TERM": "dumb"}
# a number: 12, -3, 1.5, 7.85e-07, 0:00:01, 44.17%
_NUMBER = re.compile(r"[-+]?\d+(?:[.:]\d+)*(?:e[-+]?\d+)?%?")
# table rules and the padding around cells change width with the numbers in them
_RULES = re.compile(r"[\s─━═]+")


@dataclass(frozen=True)
class Block:
    """One marker of one page: the command, its flags and the text now between the markers."""

    page: Path
    command: str
    volatile: bool
    exit_status: int
    body: str
    span: tuple[int, int]
    columns: int = int(ENV["COLUMNS"])

    @property
    def argv(self) -> list[str]:
        words = shlex.split(self.command)
        if not words or words[0] != "convgrad":
            raise ValueError(f"{self.page.name}: the command {self.command!r} must start with 'convgrad'")
        return words[1:]


def pages() -> list[Path]:
    """Every Markdown page of the site."""
    return sorted(DOCS.rglob("*.md"))


def blocks(page: Path) -> list[Block]:
    """The cli-output markers of one page, in order."""
    found = []
    for m in MARKER.finditer(page.read_text()):
        flags = m["flags"].split()
        unknown = [f for f in flags if f != "volatile" and not re.fullmatch(r"(?:exit|columns)=\d+", f)]
        if unknown:
            raise ValueError(f"{page.name}: unknown cli-output flags {unknown} for {m['command']!r}")
        status = next((int(f.removeprefix("exit=")) for f in flags if f.startswith("exit=")), 0)
        columns = next((int(f.removeprefix("columns=")) for f in flags if f.startswith("columns=")),
                       int(ENV["COLUMNS"]))
        found.append(Block(page, m["command"], "volatile" in flags, status, m["body"], m.span("body"), columns))
    return found


EXAMPLE = "*An example run: timings and random values differ from run to run.*"


def render(block: Block, output: str) -> str:
    """The Markdown between the markers: a text block with the command line and its output (said to be an example
    when volatile)."""
    lines = [line.rstrip() for line in output.rstrip("\n").splitlines()]
    return (f"{EXAMPLE}\n\n" if block.volatile else "") + "```text\n$ " + block.command + "\n" + "\n".join(lines) \
        + "\n```\n"


def masked(text: str) -> str:
    """What must stay the same in a volatile block: the words and symbols, not the numbers or widths."""
    return _RULES.sub(" ", _NUMBER.sub("#", text)).strip()


# ---- running the commands ----------------------------------------------------------------------------------------

@contextlib.contextmanager
def _chdir(path: str) -> Iterator[None]:
    """contextlib.chdir, which Python 3.10 lacks."""
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def run_here(commands: list[tuple[list[str], int]]) -> list[tuple[int, str]]:
    """Run each (argv, columns) through convgrad.cli.main in this process; (exit status, output) for each.

    The environment of ENV is set while they run (COLUMNS: each command's own), auto-tuning on and no tuning
    cache file; all is restored after.
    """
    import torch

    from convgrad import cli
    from convgrad.backends import auto

    results, saved = [], dict(os.environ)
    os.environ.update(ENV)
    for var in ("CONVGRAD_AUTOTUNE_CACHE", "FORCE_COLOR"):
        os.environ.pop(var, None)
    threads, mode = torch.get_num_threads(), auto.get_mode()
    try:
        auto.set_mode("tune")  # what a user gets
        for argv, columns in commands:
            os.environ["COLUMNS"] = str(columns)
            torch.set_num_threads(1)
            auto.clear()
            out = io.StringIO()
            with tempfile.TemporaryDirectory() as tmp, _chdir(tmp), \
                    contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                try:
                    status = cli.main(argv)
                except SystemExit as exit_:  # argparse: --help, or a bad argument
                    status = exit_.code if isinstance(exit_.code, int) else 1
                except Exception:  # shown in the output, and the exit status makes the script fail
                    traceback.print_exc(file=out)
                    status = 1
            results.append((int(status or 0), out.getvalue()))
    finally:
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)
        auto.set_mode(mode)
        auto.clear()
    return results


def run(commands: list[tuple[list[str], int]]) -> list[tuple[int, str]]:
    """run_here in a child process, which imports convgrad from this clone's src/."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, __file__, "--child"], input=json.dumps(commands), env=env,
                           capture_output=True, text=True, cwd=ROOT)
    if child.returncode != 0:
        raise RuntimeError(f"cli_output.py --child failed:\n{child.stdout}{child.stderr}")
    return [(status, text) for status, text in json.loads(child.stdout.splitlines()[-1])]  # C libraries may print too


def regenerate(check_only: bool = False, in_process: bool = False) -> list[str]:
    """Run every marked command (in a child process, or in this one); rewrite the pages (or, with check_only,
    only compare). Returns the problems."""
    todo = [b for page in pages() for b in blocks(page)]
    results = (run_here if in_process else run)([(b.argv, b.columns) for b in todo])
    problems: list[str] = []
    new_text = {page: page.read_text() for page in {b.page for b in todo}}
    for block, (status, output) in reversed(list(zip(todo, results))):  # from the end: spans stay valid
        where = f"{os.path.relpath(block.page, DOCS)}: {block.command}"
        if status != block.exit_status:
            problems.append(f"{where}: exit status {status}, expected {block.exit_status}\n{output}")
            continue
        fresh = render(block, output)
        same = masked(fresh) == masked(block.body) if block.volatile else fresh == block.body
        if check_only and not same:
            diff = difflib.unified_diff(block.body.splitlines(), fresh.splitlines(), "page", "now", lineterm="")
            problems.append(f"{where}: out of date\n" + "\n".join(diff))
        text = new_text[block.page]
        new_text[block.page] = text[:block.span[0]] + fresh + text[block.span[1]:]
    if not check_only:
        for page, text in new_text.items():
            if text != page.read_text():
                page.write_text(text)
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if a block is out of date")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_here(json.load(sys.stdin))))
        return 0
    problems = regenerate(check_only=args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    if args.check and problems:
        print("\nrun `python docs/cli_output.py` to update the pages", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
