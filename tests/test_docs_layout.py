"""The docs at the width a reader has (1280 px): nothing cut off, command-line tables that fit, picture legends
of at least 10 px as the site shows them. The fast tests read the pages and draw the figures; the slow one builds
the site and measures it in headless Chromium (docs/site_layout.py)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from matplotlib.text import Text

import convgrad
from convgrad.explain import render
from convgrad.explain.canvas import DPI, WIDTH_PX
from helpers import load_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


site_layout = load_script("site_layout", DOCS / "site_layout.py")
cli_output = load_script("cli_output", DOCS / "cli_output.py")


# ---- picture legends -------------------------------------------------------------------------------------------

def legend_px_on_site(fig: Any, labels: set[str]) -> list[tuple[str, float]]:
    """(text, height in px as the site shows the figure) of every legend and caption text in the figure."""
    scale = site_layout.CONTENT_PX / (fig.get_size_inches()[0] * fig.dpi)
    return [(t.get_text(), t.get_fontsize() * fig.dpi / 72 * scale) for t in fig.findobj(Text)
            if t.get_text() in labels]


@pytest.mark.parametrize(("input_size", "weight_size", "kw"), [
    ((1, 1, 5, 5), (1, 1, 3, 3), dict(stride=2)),
    # the slow tier draws two more pictures (each takes seconds)
    pytest.param((3, 4, 7, 7), (2, 4, 3, 3), dict(dilation=2), marks=pytest.mark.slow),
    pytest.param((1, 2, 6, 6), (2, 1, 3, 3), dict(stride=2, groups=2), marks=pytest.mark.slow),
])
def test_picture_legends_are_10_px_as_the_site_shows_them(input_size: tuple[int, ...], weight_size: tuple[int, ...],
                                                          kw: dict[str, Any]) -> None:
    """The site shows the 800 px figures 733 px wide at 1280 px (measured, docs/site_layout.py): the legend's
    7.5 pt (10.4 px) became 9.5 px; at 8.5 pt it is 10.8 px."""
    recipe = convgrad.explain(input_size, weight_size, **kw)
    fig = recipe.plot()
    assert round(fig.get_size_inches()[0] * fig.dpi) == WIDTH_PX
    labels = set()
    for gradient in ("grad_input", "grad_weight"):
        lay = render.layout(recipe.scene(gradient), 120)
        labels |= {label for row in render.legend_rows(lay) for _, _, label in row}
        labels |= set(render.caption(lay))
    sizes = legend_px_on_site(fig, labels)
    assert len({text for text, _ in sizes}) == len(labels)  # every legend entry and caption line was found
    assert min(px for _, px in sizes) >= 10, min(sizes, key=lambda s: s[1])
    assert DPI == 100


# ---- command-line tables fit the content column -------------------------------------------------------------------

def fit_chars(page: Path) -> int:
    """How many characters of a code line the page's content column holds at 1280 px."""
    front = page.read_text().split("\n---\n", 1)[0] if page.read_text().startswith("---\n") else ""
    hidden = set(re.findall(r"^\s+- (toc|navigation)\b", front, re.M))
    if hidden == {"toc", "navigation"}:
        return site_layout.FIT_CHARS_FULL_WIDTH
    return site_layout.FIT_CHARS_WITHOUT_TOC if "toc" in hidden else site_layout.FIT_CHARS


def wide_table_lines(page: Path, text: str) -> list[str]:
    """Lines drawn with box-drawing characters longer than the page's column holds: they would wrap and fall apart."""
    return [line for line in text.splitlines() if site_layout.BOX.search(line) and len(line) > fit_chars(page)]


def test_command_line_tables_fit_at_1280_px() -> None:
    """Before: the check tables were 150 and 170 columns, the explain help 100, in a column of about 95."""
    wide = {f"{b.page.name}: {b.command}": lines for page in cli_output.pages() for b in cli_output.blocks(page)
            if (lines := wide_table_lines(page, b.body))}
    assert wide == {}


def test_a_known_wide_table_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# page\n")
    assert wide_table_lines(page, "┃ " + "x" * 97 + " ┃") and not wide_table_lines(page, "┃ " + "x" * 96 + " ┃")
    assert not wide_table_lines(page, "a prose line of 200 characters wraps " + "y" * 170)  # wrapping is fine there
    page.write_text("---\nhide:\n  - toc\n---\n\n# page\n")
    assert not wide_table_lines(page, "┃ " + "x" * 120 + " ┃") and wide_table_lines(page, "┃ " + "x" * 130 + " ┃")
    page.write_text("---\nhide:\n  - navigation\n  - toc\n---\n\n# page\n")
    assert not wide_table_lines(page, "┃ " + "x" * 150 + " ┃") and wide_table_lines(page, "┃ " + "x" * 170 + " ┃")


# ---- the built site in a real browser ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[docs]' -c constraints.txt)")
    if site_layout.chromium() is None:
        pytest.skip("no headless Chromium (apt-get install chromium)")
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d",
                           str(out)], capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "CONVGRAD_GALLERY": "quick"})
    assert done.returncode == 0, done.stdout + done.stderr
    return out


PAGES = ["index", "how-do-i", "per_sample", "backends", "cli", "cli/demo", "cli/check", "cli/bench", "cli/explain",
         "derivation", "numerics", "design", "api"]


@pytest.mark.slow
def test_nothing_is_cut_off_at_1280_px(built_site: Path) -> None:
    """Every pre and table fits its box or wraps, and every command-line table fits a line, at 1280 px; the pictures
    are shown no narrower than the legend sizes assume."""
    found = {}
    for page in PAGES:
        measures = site_layout.measure_html(site_layout.page_path(built_site, page))
        if problems := site_layout.problems(measures):
            found[page] = problems
        if page == "derivation":
            assert measures["imgs"] and all(i["shown"] >= site_layout.CONTENT_PX for i in measures["imgs"])
        assert measures["fit_chars"] >= (site_layout.FIT_CHARS_FULL_WIDTH if page == "cli/check"
                                         else site_layout.FIT_CHARS), page
    assert found == {}


@pytest.mark.slow
def test_the_browser_check_catches_a_known_wide_block(built_site: Path, tmp_path: Path) -> None:
    page = tmp_path / "wide" / "index.html"
    shutil.copytree(built_site / "numerics", page.parent)
    html = page.read_text().replace('href="../', f'href="{built_site.as_uri()}/').replace(
        'src="../', f'src="{built_site.as_uri()}/')
    wide = ("<pre><code>┏" + "━" * 150 + "┓</code></pre>"
            "<table><tr><td>" + "unbreakable" * 30 + "</td></tr></table>")
    page.write_text(html.replace("<h1", wide + "<h1", 1))
    problems = site_layout.problems(site_layout.measure_html(page))
    assert any("a table line of 152 characters" in p for p in problems), problems
    assert any(p.startswith("table ") for p in problems), problems


@pytest.mark.parametrize(("input_size", "weight_size", "kw"), [
    ((1, 2, 6, 6), (2, 1, 3, 3), dict(stride=2, groups=2)),  # polyphase, two channels
    pytest.param((1, 2, 4, 6, 6), (2, 1, 3, 3, 3), dict(stride=(1, 2, 2), groups=2),  # phases, 3d
                 marks=pytest.mark.slow),
])
def test_a_picture_of_several_channels_writes_one_number_per_cell(input_size: tuple[int, ...],
                                                                  weight_size: tuple[int, ...],
                                                                  kw: dict[str, Any]) -> None:
    """Before: Recipe.plot drew the results of every channel into the one channel's grid, numbers over numbers."""
    fig = convgrad.explain(input_size, weight_size, **kw).plot()
    for ax in fig.axes:
        numbers = [t.get_position() for t in ax.texts if re.fullmatch(r"-?\d+", t.get_text())]
        assert numbers and len(numbers) == len(set(numbers)), "two numbers drawn in one place"
