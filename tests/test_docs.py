"""The documentation: every Python block on every page runs, the site builds strictly, and the built HTML
shows what a reader should see (examples as code, links instead of roles, a page per command, no private or
internal names); the command-line pages show what the commands print today."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
# a fenced block (``` or ~~~, three or more) at any indent (inside tabs or admonitions too), closed by the same fence
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)"
                    r"^(?P=indent)(?P=fence)[ \t]*$", re.S | re.M)
_PYTHON = {"python", "py", "python3"}


cli_output = load_script("cli_output", DOCS / "cli_output.py")
py_output = load_script("py_output", DOCS / "py_output.py")
first_call_cost = load_script("first_call_cost", DOCS / "first_call_cost.py")


def python_blocks(page: Path) -> list[str]:
    """The ```python blocks of a page, dedented, in order."""
    return [textwrap.dedent(m["body"]) for m in _FENCE.finditer(page.read_text()) if m["lang"] in _PYTHON]


# ---- every Python block on every page runs ---------------------------------------------------------------------

def test_python_blocks_are_found_on_every_page_that_has_them() -> None:
    """The runner below sees every page (not a chosen list) and the pages that teach with code."""
    with_code = {p.relative_to(DOCS).as_posix() for p in PAGES if python_blocks(p)}
    assert {"index.md", "how-do-i.md", "per_sample.md", "backends.md", "design.md"} <= with_code


@pytest.mark.slow  # docs build / page runs
@pytest.mark.parametrize("page", [p for p in [*PAGES, ROOT / "README.md"] if python_blocks(p)],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_run_and_show_what_they_print(page: Path, tmp_path: Path) -> None:
    """The blocks of one page run in order in one namespace, as a reader pastes them; each asserts its claims. What
    each prints is shown under it, as it prints it now (`python docs/py_output.py` rewrites it)."""
    outputs = py_output.run_page(page, tmp_path)
    if page.name == "how-do-i.md":  # the generated recipe script checked itself against autograd
        assert "recipe matches torch autograd" in "".join(outputs)
    if page.name != "README.md":  # GitHub shows the README: its comments show the output (tested below)
        problems = py_output.problems(page, outputs)
        assert not problems, "\n\n".join(problems) + "\n\nrun `python docs/py_output.py` to update the pages"


def test_py_output_reports_a_missing_or_stale_output(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nprint(1 + 1)\n```\n\n```python\nprint('a')\n```\n<!-- py-output -->\n```text\nb\n```\n"
                    "<!-- /py-output -->\n```python\nprint(3.5, 'ms')\n```\n<!-- py-output volatile -->\n"
                    "<!-- /py-output -->\n")
    outputs = py_output.run_page(page, tmp_path)
    assert outputs == ["2\n", "a\n", "3.5 ms\n"]
    problems = py_output.problems(page, outputs)
    assert len(problems) == 3 and "no <!-- py-output --> marker" in problems[0] and "out of date" in problems[1]
    py_output.write(page, outputs)
    assert py_output.problems(page, outputs) == [py_output.problems(page, outputs)[0]]  # the marker is not made up
    assert py_output.EXAMPLE in page.read_text() and "```text\n3.5 ms\n```" in page.read_text()
    assert not py_output.problems(page, ["2\n", "a\n", "4.25 ms\n"])[1:]  # an example: its numbers may change
    assert py_output.problems(page, ["2\n", "a\n", "4.25 ms\nmore\n"])[1:]  # not its lines


@pytest.mark.parametrize("needle", ['grad_sample_mode="ghost"', "BatchMemoryManager("])
def test_the_opacus_modes_the_dp_page_names_have_code_with_its_output(needle: str) -> None:
    """Ghost clipping and BatchMemoryManager's virtual steps had a sentence each and no code: each has a block that
    runs (test_python_blocks_run_and_show_what_they_print) with what it prints under it, checked against convgrad's
    own clipped sum."""
    found = [b for b in py_output.blocks(DOCS / "per_sample.md") if needle in b.code]
    assert len(found) == 1 and found[0].body and not found[0].volatile, found
    assert "assert_close(p.grad, e" in found[0].code and "print(" in found[0].code


def test_readme_names_the_backends_there_are() -> None:
    """The README's example comment printed an old list ('auto', 'fwdconv', 'native', ...), and its backend list
    left out channels_last, chunked and regroup."""
    import convgrad

    text = (ROOT / "README.md").read_text()
    comment = re.search(r"^print\(cg\.backends\(\)\)\s*# (\[.*\])$", text, flags=re.M)
    assert comment is not None and ast.literal_eval(comment.group(1)) == convgrad.backends()
    listed = text.split("- Backends (`convgrad.backends()`):")[1].split("\n- ")[0]
    assert set(re.findall(r"`(\w+)`", listed)) >= set(convgrad.backends()), listed


def test_every_count_of_the_how_do_i_questions_is_the_pages() -> None:
    """README said "the three questions", docs/index.md too, while the page (four sections) said "Four"."""
    words = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")
    asked = len(re.findall(r"^## How ", (ROOT / "docs" / "how-do-i.md").read_text(), flags=re.M))
    counts = {path.name: re.findall(r"(?i)\b(" + "|".join(words) + r") questions", path.read_text())
              for path in (ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "how-do-i.md")}
    assert asked >= 4 and all(counts.values()), counts
    assert {name: {words.index(w.lower()) + 1 for w in found} for name, found in counts.items()} == {
        name: {asked} for name in counts}


def test_readme_links_only_inside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 5
    for link in links:
        target = (ROOT / link.split("#")[0]).resolve()
        assert "://" not in link and target.is_relative_to(ROOT) and target.exists(), link
    assert "../" not in text, "a path out of the repository"
    assert not re.findall(r"(?i)\bseeds?\b|\bissue \d", text)


def test_derivation_figures_come_from_make_figures() -> None:
    make_figures = load_script("make_figures", DOCS / "make_figures.py")
    used = set(re.findall(r"\(img/([\w.-]+\.png)\)", (DOCS / "derivation.md").read_text()))
    assert used == set(make_figures.FIGURES) | {m.file for m in make_figures.METHODS.values()}
    assert all((DOCS / "img" / name).is_file() for name in used)


def test_every_method_explain_shows_has_a_section_with_its_picture_and_rule() -> None:
    """A student meets "subpixel" or "per_sample" in explain's output; the derivation page explains each, with the
    picture of a layer the rules give it and the rule's own words (a rule that changes makes this fail)."""
    from convgrad.backends.fwdconv import INPUT_METHODS, WEIGHT_METHODS

    make_figures = load_script("make_figures", DOCS / "make_figures.py")
    page = (DOCS / "derivation.md").read_text()
    sections = dict(re.findall(r"^### grad_(?:input|weight): (\w+)\n(.*?)(?=^##)", page, flags=re.M | re.S))
    assert set(sections) == set(make_figures.METHODS) == {*INPUT_METHODS, *WEIGHT_METHODS, "direct"}
    for name, method in make_figures.METHODS.items():
        plan = method.plan()
        assert plan.method == name and plan.gradient == method.gradient, (name, plan.method)
        text = sections[name]
        assert f"(img/{method.file})" in text and "**When it wins:**" in text, name
        wins = text.split("**When it wins:**")[1]
        assert len([line for line in wins.strip().splitlines() if line.strip()]) == 2, (name, wins)
        assert method.forced == (plan.reason == "forced"), name
        if not method.forced:
            assert f"`{plan.reason}`" in wins, (name, plan.reason)


def test_every_method_explain_takes_is_on_the_derivation_page() -> None:
    """explain also takes fft, which the fwdconv sections above do not list: the convolution theorem's section
    names it and what its picture shows instead of frames."""
    from convgrad.explain.methods import METHODS

    page = (DOCS / "derivation.md").read_text()
    sections = set(re.findall(r"^### grad_(?:input|weight): (\w+)$", page, flags=re.M))
    theorem = page.split("## The convolution theorem")[1].split("\n## ")[0]
    assert set(METHODS) - sections == {"fft"}
    assert "`convgrad explain --method fft`" in theorem and "refuse fft" in theorem


@pytest.mark.slow  # draws every method's picture
def test_derivation_pictures_are_current(tmp_path: Path) -> None:
    """The committed method pictures are what make_figures.py draws now (same size; the pixels may differ by
    font rendering, so only the dimensions are compared)."""
    from PIL import Image

    make_figures = load_script("make_figures", DOCS / "make_figures.py")
    for method in make_figures.METHODS.values():
        fresh = tmp_path / method.file
        method.recipe().plot(fresh, gradients=(method.gradient,))
        with Image.open(fresh) as now, Image.open(DOCS / "img" / method.file) as committed:
            assert now.size == committed.size, method.file


# ---- the built site ----------------------------------------------------------------------------------------------

class Page(HTMLParser):
    """The visible text of one HTML page, split into prose and code (inside <pre> or <code>), and its blocks."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.prose: list[str] = []
        self.code: list[str] = []
        self.ordered: list[str] = []  # prose and code, in the order they appear
        self.pre_blocks: list[tuple[str, str]] = []  # (classes of the enclosing div, text)
        self.h1 = ""
        self._code_depth = self._skip = self._h1 = 0
        self._div_classes: list[str] = []
        self._pre: list[str] | None = None
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "style"):
            self._skip += 1
        elif tag in ("pre", "code"):
            self._code_depth += 1
            if tag == "pre":
                self._pre = []
        elif tag == "h1":
            self._h1 += 1
        elif tag == "div":
            self._div_classes.append(dict(attrs).get("class") or "")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style"):
            self._skip -= 1
        elif tag in ("pre", "code"):
            self._code_depth -= 1
            if tag == "pre" and self._pre is not None:
                self.pre_blocks.append((" ".join(self._div_classes[-2:]), "".join(self._pre)))
                self._pre = None
        elif tag == "h1":
            self._h1 -= 1
        elif tag == "div" and self._div_classes:
            self._div_classes.pop()

    def handle_data(self, data: str) -> None:
        if self._skip:
            return
        (self.code if self._code_depth else self.prose).append(data)
        self.ordered.append(data)
        if self._pre is not None:
            self._pre.append(data)
        if self._h1:
            self.h1 += data

    @property
    def text(self) -> str:
        return "".join(self.ordered)


def examples_outside_code(page: Page) -> list[str]:
    """Doctest prompts that a reader would see as running text instead of code."""
    return [t.strip() for t in page.prose if ">>>" in t]


def sphinx_roles(page: Page) -> list[str]:
    return re.findall(r":(?:func|class|meth|mod|attr|obj|exc|data):`?[\w.]*", page.text)


def private_names(page: Page, private: set[str]) -> list[str]:
    """convgrad's own private names (``_fixed_rank``) and private bases anywhere in the visible text."""
    found = [n for n in re.findall(r"(?<![\w.])_[A-Za-z]\w*", page.text) if n in private]
    for bases in re.findall(r"Bases:\s*((?:[\w.]+(?:\s*,\s*)?)+)", page.text):
        found += [b for b in re.split(r"\s*,\s*", bases.strip()) if any(part.startswith("_") for part in b.split("."))]
    return found


def internal_words(page: Page) -> list[str]:
    """What means nothing to a user: issue numbers, the seed questions, the lead. A random seed (``--seed``,
    ``manual_seed``) is a word of code and command output, never of prose."""
    prose, text = " ".join(page.prose), page.text
    found = re.findall(r"(?i)\bissues?\s*#?\s*\d+", text)
    found += re.findall(r"(?i)\bseed (?:question|script|function)s?\b|\bseeds?'s?(?=\s)|\bseeds/", text)
    found += re.findall(r"(?i)\bseeds?\b", prose)
    found += re.findall(r"(?i)\bthe lead\b|\binternal targets?\b", text)
    return found


def _private_names_of_convgrad() -> set[str]:
    """Every name starting with one underscore that convgrad's source defines (classes, functions, constants)."""
    names = set()
    for path in (ROOT / "src" / "convgrad").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Page]:
    """The site, built with --strict (warnings fail the build), as {path: parsed page}."""
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]' -c constraints.txt)")
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"),
                             "-d", str(out)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    return {p.relative_to(out).as_posix(): Page(p.read_text()) for p in out.rglob("*.html")}


@pytest.mark.slow  # docs build / page runs
def test_every_documented_example_is_a_code_block(site: dict[str, Page]) -> None:
    api = site["api/index.html"]
    assert {p: bad for p, page in site.items() if (bad := examples_outside_code(page))} == {}
    with_prompts = [text for _, text in api.pre_blocks if text.lstrip().startswith(">>>")]
    assert len(with_prompts) >= 20, f"only {len(with_prompts)} example blocks with >>> prompts on the API page"
    assert any("conv_backward(" in text and "torch.Size" in text for text in with_prompts)  # prompts and output


@pytest.mark.slow  # docs build / page runs
def test_no_literal_sphinx_roles(site: dict[str, Page]) -> None:
    assert {p: bad for p, page in site.items() if (bad := sphinx_roles(page))} == {}


@pytest.mark.slow  # docs build / page runs
def test_no_private_names_or_bases(site: dict[str, Page]) -> None:
    private = _private_names_of_convgrad()
    assert "_fixed_rank" in private  # autograd.calls: the scan finds convgrad's private names
    assert {p: bad for p, page in site.items() if (bad := private_names(page, private))} == {}


@pytest.mark.slow  # docs build / page runs
def test_no_page_names_an_issue_or_a_seed(site: dict[str, Page]) -> None:
    assert {p: bad for p, page in site.items() if (bad := internal_words(page))} == {}


@pytest.mark.slow  # docs build / page runs
def test_each_cli_command_has_a_page_with_its_output(site: dict[str, Page]) -> None:
    from convgrad.cli import COMMANDS

    for name in COMMANDS:
        page = site.get(f"cli/{name}/index.html")
        assert page is not None, f"no page for `convgrad {name}` (docs/cli/{name}.md)"
        assert f"convgrad {name}" in page.h1
        runs = [text for _, text in page.pre_blocks if text.startswith(f"$ convgrad {name} ")]
        assert runs and any(f"usage: convgrad {name}" in text for text in runs), f"cli/{name}: no real output"


@pytest.mark.slow  # docs build / page runs
def test_every_python_block_of_the_site_is_one_the_tests_run(site: dict[str, Page]) -> None:
    """A block the runner misses (``` py, an indented fence it cannot see) would still show as Python code."""
    for md in PAGES:
        if md.name in ("api.md",):
            continue
        html = md.relative_to(DOCS).with_suffix("").as_posix()
        html = "index.html" if html == "index" else html.removesuffix("/index") + "/index.html"
        shown = [cls for cls, _ in site[html].pre_blocks if re.search(r"\blanguage-(?:python|py|python3)\b", cls)]
        assert len(shown) == len(python_blocks(md)), f"{md.name}: {len(shown)} Python blocks shown, " \
                                                     f"{len(python_blocks(md))} run"


# ---- each check can fail: the same functions on pages that break the rules ------------------------------------------

@pytest.mark.parametrize("html,check", [
    ("<p>&gt;&gt;&gt; import torch</p>", examples_outside_code),  # an Example: admonition with lost prompts
    ("<blockquote><p>&gt;&gt;&gt; cg.conv(x, w)</p></blockquote>", examples_outside_code),
    ("<p>see :func:`conv_backward`</p>", sphinx_roles),
    ("<p>a <code>:meth:`Recipe.plot`</code></p>", sphinx_roles),
    ("<p>Bases: <code>_ConvCore</code></p>", lambda p: private_names(p, set())),
    ("<p>Bases: <code>torch.nn.Conv2d</code>, <code>convgrad.nn._ConvgradMixin</code></p>",
     lambda p: private_names(p, set())),
    ("<p>uses <code>_ConvCore</code></p>", lambda p: private_names(p, {"_ConvCore"})),
    ("<h2>The seed questions</h2>", internal_words),
    ("<p>the seed's Function</p>", internal_words),
    ("<pre><code>targets (issue 4)</code></pre>", internal_words),
    ("<p>pass <code>--seed</code>; any seed works</p>", internal_words),
])
def test_each_html_check_fails_on_a_page_that_breaks_it(html: str, check: Any) -> None:
    assert check(Page(html))


@pytest.mark.parametrize("html,check", [
    ('<div class="highlight"><pre><code>&gt;&gt;&gt; import torch</code></pre></div>', examples_outside_code),
    ('<p><a href="#convgrad.conv_backward">conv_backward</a></p>', sphinx_roles),
    ("<p>Bases: <code>torch.nn.Conv2d</code>, uses <code>_slow_conv2d_backward</code></p>",
     lambda p: private_names(p, {"_ConvCore"})),
    ("<p>pass <code>--seed 0</code></p><pre><code>--seed SEED  seed of the split</code></pre>", internal_words),
])
def test_each_html_check_passes_a_page_that_keeps_it(html: str, check: Any) -> None:
    assert not check(Page(html))


# ---- the command-line pages show today's output --------------------------------------------------------------

def test_every_cli_page_asks_for_real_output() -> None:
    from convgrad.cli import COMMANDS

    for name in COMMANDS:
        commands = [b.command for b in cli_output.blocks(DOCS / "cli" / f"{name}.md")]
        assert f"convgrad {name} --help" in commands
        assert any(c != f"convgrad {name} --help" for c in commands), commands


def test_explain_page_documents_every_option_and_the_textbook_version() -> None:
    """Before: --method, --weight-method, --animate, --html and --max-frames were only in the --help dump."""
    from convgrad.cli import build_parser

    page = (DOCS / "cli" / "explain.md").read_text()
    table = page.split("## Every option")[1].split("\n## ")[0]
    explain = build_parser()._subparsers._group_actions[0].choices["explain"]  # type: ignore[union-attr]
    options = {o for action in explain._actions for o in action.option_strings if o.startswith("--") and o != "--help"}
    assert options and {o for o in options if f"`{o}" not in table} == set()
    commands = [b.command for b in cli_output.blocks(DOCS / "cli" / "explain.md")]
    assert "convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2" == commands[0]  # what runs
    assert f"{commands[0]} --method zero_insert --weight-method kernel" in commands  # the textbook version


def test_cli_output_shows_whole_cells() -> None:
    """Before: with seven backends, check's --model and --random tables at 100 columns cut the gradient and
    module names to "gradie…" and "Conv2d…"; such a block asks for its width (``columns=N``)."""
    cut = {f"{b.page.name}: {b.command}": [line for line in b.body.splitlines() if "…" in line]
           for page in cli_output.pages() for b in cli_output.blocks(page)}
    assert {where: lines for where, lines in cut.items() if lines} == {}
    widths = {b.command: b.columns for b in cli_output.blocks(DOCS / "cli" / "check.md")}
    assert widths["convgrad check --random 20 --seed 0"] > 100 and widths["convgrad check --help"] == 100
    # and fit the page's column at 1280 px (tests/test_docs_layout.py): cli/check.md hides both sidebars
    assert max(widths.values()) <= 165


@pytest.mark.slow  # docs build / page runs
def test_cli_output_is_current() -> None:
    """What the pages show is what the commands print now (`python docs/cli_output.py` rewrites it)."""
    problems = cli_output.regenerate(check_only=True, in_process=True)
    assert not problems, "\n\n".join(problems) + "\n\nrun `python docs/cli_output.py` to update the pages"


def test_volatile_output_is_compared_without_numbers_but_with_words() -> None:
    page = "12.30 ms ± 0.50 ┃ native ┃ 0:00:01\n┏━━━━━━┳━━┓"
    assert cli_output.masked(page) == cli_output.masked("7.1 ms ± 10.25 ┃ native ┃ 0:01:30\n┏━━┳━━━━━━━━┓")
    assert cli_output.masked(page) != cli_output.masked("12.30 ms ± 0.50 ┃ fwdconv ┃ 0:00:01\n┏━━━━━━┳━━┓")
    assert cli_output.masked(page) != cli_output.masked("12.30 ms ± 0.50 ┃ native ┃ 0:00:01 ┃ FAIL\n┏━━━━━━┳━━┓")


def test_a_stale_block_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An edited output block, a volatile one with other words, and a wrong exit status are all caught."""
    page = tmp_path / "page.md"
    page.write_text("<!-- cli-output: convgrad explain --help -->\n```text\n$ convgrad explain --help\nold\n```\n"
                    "<!-- /cli-output -->\n"
                    "<!-- cli-output volatile: convgrad explain --input 1,1,5,5 --weight 1,1,3,3 -->\n```text\n"
                    "$ convgrad explain --input 1,1,5,5 --weight 1,1,3,3\nsomething else 1.0\n```\n"
                    "<!-- /cli-output -->\n"
                    "<!-- cli-output exit=2: convgrad explain --help -->\n<!-- /cli-output -->\n")
    monkeypatch.setattr(cli_output, "pages", lambda: [page])
    outputs = [(0, "usage: new\n"), (0, "other words 2.0\n"), (0, "usage\n")]
    monkeypatch.setattr(cli_output, "run", lambda argvs: outputs)
    problems = cli_output.regenerate(check_only=True)
    assert len(problems) == 3 and "exit status 0, expected 2" in problems[0], problems
    assert "<!-- cli-output exit=2" in page.read_text() and "\nold\n" in page.read_text()  # --check writes nothing


# ---- the first-call figures of the backends page come from docs/first_call_cost.py --------------------------------

def test_first_call_table_is_the_scripts() -> None:
    page = (DOCS / "backends.md").read_text()
    table = page.split("<!-- first-call-cost: python docs/first_call_cost.py --write -->\n")[1]
    table = table.split("<!-- /first-call-cost -->")[0]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].removeprefix("| ") for r in rows[1:]] == list(first_call_cost.MODES)
    assert all(cell.removesuffix(" |").isdigit() for r in rows[1:] for cell in r[1:])
    assert re.search(r"^Measured on .+, \d+ cores, torch .+\.$", table, flags=re.M)


def test_first_call_table_is_written_between_the_markers(tmp_path: Path) -> None:
    page = tmp_path / "backends.md"
    page.write_text("before\n<!-- first-call-cost: python docs/first_call_cost.py --write -->\nold\n"
                    "<!-- /first-call-cost -->\nafter\n")
    first_call_cost.write("| new |\n", page)
    assert page.read_text() == ("before\n<!-- first-call-cost: python docs/first_call_cost.py --write -->\n| new |\n"
                                "<!-- /first-call-cost -->\nafter\n")
    page.write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        first_call_cost.write("| new |\n", page)


# ---- docs/design.md's picture of the package is the package -------------------------------------------------------

def _design_block(name: str) -> str:
    text = (DOCS / "design.md").read_text()
    return text.split(f"<!-- {name}:", 1)[1].split(f"<!-- /{name} -->", 1)[0]


def design_layers(block: str) -> list[set[str]]:
    """The picture's rows, top to bottom, each the set of modules in its first column."""
    rows = [line.split("│")[1] for line in block.splitlines() if line.startswith("│")]
    return [{m.strip() for m in row.split("|")} for row in rows]


def test_design_layer_picture_is_the_contract_lint_imports_enforces() -> None:
    """The layers drawn in docs/design.md are, row for row, the layers contract of pyproject.toml (.ci/run's
    lint-imports); a layer added, moved or dropped in one and not the other fails."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (layers,) = [c["layers"] for c in config["contracts"] if c["type"] == "layers"]
    enforced = [{m.strip().removeprefix("convgrad.") for m in layer.split("|")} for layer in layers]
    assert design_layers(_design_block("layers")) == enforced


def test_design_package_table_lists_every_module_of_the_package() -> None:
    import convgrad

    root = Path(convgrad.__file__).parent
    actual = {p.name + ("/" if p.is_dir() else "") for p in root.iterdir()
              if (p.suffix == ".py" or (p / "__init__.py").exists())}
    listed = set(re.findall(r"`([\w.]+/?)`", "\n".join(line.split("|")[1] for line in
                                                    _design_block("package").splitlines() if line.startswith("| `"))))
    assert listed == actual, (sorted(actual - listed), sorted(listed - actual))


def test_design_call_path_names_only_what_exists() -> None:
    """Every ``convgrad.x.y`` the page's path of a call names resolves: a module renamed or a function moved
    (issue 27 moves fwdconv into a package) fails here until the page follows."""
    names = re.findall(r"`(convgrad(?:\.\w+)+)`", _design_block("path"))
    assert len(names) >= 8
    for name in names:
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):
            try:
                obj: Any = importlib.import_module(".".join(parts[:cut]))
            except ModuleNotFoundError:
                continue
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
            break
        else:
            raise AssertionError(f"{name}: no such module")
