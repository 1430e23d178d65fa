"""Look at the built site in a real browser (headless Chromium) at a given window width: what does not fit, and how
far the pictures are scaled.

    mkdocs build -d site && python docs/site_layout.py site                    # report every page at 1280 px
    python docs/site_layout.py site --screenshots shots/ --pages index cli/check

For every page it reports each ``pre`` or table whose content is wider than its box (a scroll bar hides part of
it), each ``pre`` line drawn with box-drawing characters that is longer than the box holds (a command-line table
that would wrap and break apart), and each picture's shown and natural width. tests/test_docs_layout.py runs it.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

WIDTH = 1280
# The content column at 1280 px, measured here: 748 px without a scroll bar, 733 with one (Material's two
# sidebars take 242 px each). explain's pictures, 800 px wide, are shown at this width; the legend sizes of
# src/convgrad/explain/canvas.py rely on the smaller.
CONTENT_PX = 733
# Characters of a code block's line that fit that column, measured here with the font of docs/css/extra.css
# (101); command-line tables (box-drawing characters) must not be wider, or they wrap and fall apart.
FIT_CHARS = 100
FIT_CHARS_WITHOUT_TOC = 130  # a page whose front matter hides the table of contents (136 measured)
FIT_CHARS_FULL_WIDTH = 165  # one that hides both sidebars (171 measured; docs/cli/check.md, 9 backends' columns)
BOX = re.compile(r"[─━═│┃┏┓┗┛┡┩└┘┌┐├┤┬┴┼╇╋┳┻]")

_SCRIPT = """<script>
window.addEventListener("load", () => {
  const main = document.querySelector(".md-content__inner");
  const out = {content: main.clientWidth, wide: [], lines: [], imgs: []};
  const probe = document.createElement("pre");
  probe.innerHTML = "<code>" + "0".repeat(100) + "</code>";
  probe.style.visibility = "hidden";
  main.appendChild(probe);
  const code = probe.querySelector("code");
  const style = getComputedStyle(code);
  const room = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  code.style.whiteSpace = "pre";
  code.style.display = "inline-block";
  code.style.padding = "0";
  out.char_px = code.getBoundingClientRect().width / 100;
  out.fit_chars = Math.floor(room / out.char_px);
  main.removeChild(probe);
  main.querySelectorAll("pre, table").forEach((el) => {
    const inner = el.tagName === "PRE" ? (el.querySelector("code") || el) : el;
    const box = el.tagName === "PRE" ? inner : el.parentElement;
    const text = el.textContent;
    const past = el.getBoundingClientRect().right > main.getBoundingClientRect().right + 1;
    if (inner.scrollWidth > box.clientWidth + 1 || past)
      out.wide.push({tag: el.tagName, width: inner.scrollWidth, box: box.clientWidth, text: text.slice(0, 100)});
    if (el.tagName === "PRE")
      text.split("\\n").forEach((line) => { if (/[─━═│┃┏┓┗┛┡┩└┘╇]/.test(line)) out.lines.push(line.length); });
  });
  main.querySelectorAll("img").forEach((im) =>
    out.imgs.push({src: im.getAttribute("src"), shown: im.clientWidth, natural: im.naturalWidth}));
  const pre = document.createElement("pre");
  pre.id = "site-layout";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>"""


def chromium() -> str | None:
    """The headless browser's command, if one is installed."""
    return next((c for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)


def _run(args: list[str], timeout: int = 120) -> str:
    browser = chromium()
    if browser is None:
        raise RuntimeError("no chromium: apt-get install chromium")
    done = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", *args],
                          capture_output=True, text=True, timeout=timeout)
    return done.stdout


def measure_html(html: Path, width: int = WIDTH) -> dict[str, Any]:
    """The measures of one built page (a copy with the measuring script is loaded; the page is not changed)."""
    copy = html.with_name(f".layout-{html.name}")
    copy.write_text(html.read_text(encoding="utf-8").replace("</body>", _SCRIPT + "</body>"), encoding="utf-8")
    try:
        dom = _run([f"--window-size={width},1000", "--virtual-time-budget=5000", "--dump-dom", copy.as_uri()])
    finally:
        copy.unlink()
    found = re.search(r'<pre id="site-layout">(.*?)</pre>', dom, re.S)
    if not found:
        raise RuntimeError(f"{html}: the measuring script did not run")
    text = found.group(1).replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", '"').replace("&amp;", "&")
    return json.loads(text)


def problems(measures: dict[str, Any]) -> list[str]:
    """What does not fit on one page: blocks wider than their box, table lines longer than a line of the box."""
    out = [f"{w['tag'].lower()} {w['width']} px in a box of {w['box']} px: {w['text'][:60]!r}"
           for w in measures["wide"]]
    out += [f"a table line of {n} characters; {measures['fit_chars']} fit" for n in measures["lines"]
            if n > measures["fit_chars"]]
    return out


def page_path(site: Path, page: str) -> Path:
    """'index' -> site/index.html, 'cli/check' -> site/cli/check/index.html."""
    return site / "index.html" if page in ("", "index") else site / page / "index.html"


def screenshot(site: Path, page: str, out: Path, width: int = WIDTH, height: int = 2400) -> Path:
    """A PNG of the page's first ``height`` px at ``width``."""
    _run([f"--window-size={width},{height}", f"--screenshot={out}", "--virtual-time-budget=5000",
          page_path(site, page).as_uri()])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site (mkdocs build -d SITE)")
    parser.add_argument("--pages", nargs="+", help="pages such as index cli/check (default: every page)")
    parser.add_argument("--width", type=int, default=WIDTH)
    parser.add_argument("--screenshots", type=Path, help="also save a screenshot of each page here")
    args = parser.parse_args(argv)
    pages = args.pages or sorted(str(p.parent.relative_to(args.site)).replace(".", "index")
                                 for p in args.site.rglob("index.html") if not p.name.startswith("."))
    bad = 0
    for page in pages:
        m = measure_html(page_path(args.site, page), args.width)
        found = problems(m)
        bad += len(found)
        scale = ", ".join(f"{i['shown']}/{i['natural']}" for i in m["imgs"][:3])
        print(f"{page}: content {m['content']} px, {m['fit_chars']} characters a line"
              f"{f', pictures shown {scale}' if scale else ''}")
        for problem in found:
            print(f"  {problem}")
        if args.screenshots:
            args.screenshots.mkdir(parents=True, exist_ok=True)
            screenshot(args.site, page, args.screenshots / f"{page.replace('/', '-')}.png", args.width)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
