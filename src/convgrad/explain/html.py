"""Recipe.to_html: one self-contained page with the frames, a slider to scrub them, the recipe and its script.

No server and no network: the frames are PNGs embedded in the page (paletted, as the GIF's frames are),
the player is a few lines of local script, and nothing points outside the file (matplotlib's own
to_jshtml loads its icons from a CDN).
The PNGs are base64 with 'h' and 'H' swapped for '-' and '_' (the page swaps them back), so that no
run of letters in the data can spell an address.
"""

from __future__ import annotations

import base64
import html
import io
import json
from pathlib import Path

from convgrad.errors import ConvgradValueError
from convgrad.explain.frames import SceneOf
from convgrad.explain.raster import check_path, frames, paletted

__all__ = ["to_html"]

_SWAP = str.maketrans("hH", "-_")

PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title>
<style>
body {{ font-family: sans-serif; max-width: 860px; margin: 1em auto; color: #222; }}
#frame {{ width: 800px; border: 1px solid #ccc; }}
.controls {{ display: flex; align-items: center; gap: 0.5em; margin: 0.4em 0; }}
#slider {{ flex: 1; }}
pre {{ background: #f6f6f6; padding: 0.8em; overflow-x: auto; font-size: 12px; }}
</style></head>
<body>
<h1>{title}</h1>
<img id="frame" alt="frame">
<div class="controls">
<button id="prev" title="previous frame">&#9664;</button>
<button id="play" title="play or pause">play</button>
<button id="next" title="next frame">&#9654;</button>
<input id="slider" type="range" min="0" max="{last}" value="0">
</div>
<div id="label"></div>
<h2>The recipe</h2>
<pre>{text}</pre>
<h2>The same gradients in PyTorch, checked against autograd</h2>
<pre>{code}</pre>
<script>
const frames = {frames};
const labels = {labels};
const img = document.getElementById("frame"), slider = document.getElementById("slider");
const label = document.getElementById("label"), play = document.getElementById("play");
let timer = null;
function show(i) {{
  i = (i + frames.length) % frames.length;
  slider.value = i;
  img.src = "data:image/png;base64," + frames[i].replace(/-/g, "h").replace(/_/g, "H");
  label.textContent = labels[i];
}}
slider.addEventListener("input", () => show(Number(slider.value)));
document.getElementById("prev").addEventListener("click", () => show(Number(slider.value) - 1));
document.getElementById("next").addEventListener("click", () => show(Number(slider.value) + 1));
play.addEventListener("click", () => {{
  if (timer) {{ clearInterval(timer); timer = null; play.textContent = "play"; return; }}
  timer = setInterval(() => show(Number(slider.value) + 1), 700); play.textContent = "pause";
}});
show(0);
</script>
</body></html>
"""


def to_html(scene: SceneOf, path: Path, gradients: tuple[str, ...], max_frames: int, title: str, text: str,
            code: str) -> Path:
    """Write the page of Recipe.to_html to ``path``: the frames of these scenes, the recipe's text and script."""
    if path.suffix.lower() not in (".html", ".htm"):
        raise ConvgradValueError(f"Recipe.to_html: path={str(path)!r} must end in .html")
    check_path(path, "Recipe.to_html")
    pngs, labels = [], []
    for _, image, label in paletted(frames(scene, gradients, max_frames, "Recipe.to_html")):
        buffer = io.BytesIO()
        image.save(buffer, format="png", optimize=True)
        pngs.append(base64.b64encode(buffer.getvalue()).decode("ascii").translate(_SWAP))
        labels.append(label)
    page = PAGE.format(title=html.escape(title), last=len(pngs) - 1, text=html.escape(text), code=html.escape(code),
                       frames=json.dumps(pngs), labels=json.dumps(labels))
    path.write_text(page, encoding="utf-8")
    return path
