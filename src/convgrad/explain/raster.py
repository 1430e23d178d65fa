"""Explain's frames as images: the drawn frames one by one, their shared palette, and the path check.

The encoders of animation.py (GIF, WebP, MP4) and html.py (embedded PNGs) both read the frames from here, so
neither imports the other. The frames are explain's frames (explain/frames.py), drawn by explain/render.py:
one figure, its background drawn once per computation and each frame's parts drawn over it in turn.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

from convgrad.errors import ConvgradValueError
from convgrad.explain import render
from convgrad.explain.frames import GRADIENTS, Scene, SceneOf

__all__ = ["check_path", "frames", "paletted"]


def check_path(path: Path, fn: str) -> None:
    """Fail before drawing anything when the file cannot be written there."""
    if not path.parent.is_dir():
        raise ConvgradValueError(f"{fn}: path={str(path)!r}: the directory {str(path.parent)!r} does not exist")


def _layouts(scene: SceneOf, gradients: tuple[str, ...], max_frames: int, fn: str) -> list[render.Layout]:
    unknown = [g for g in gradients if g not in GRADIENTS]
    if unknown or not gradients:
        raise ConvgradValueError(f"{fn}: gradients={gradients!r} must be a non-empty selection of {GRADIENTS}")
    if max_frames < len(gradients):
        raise ConvgradValueError(
            f"{fn}: max_frames={max_frames} must be at least one frame per gradient ({len(gradients)})")
    scenes = [scene(g) for g in gradients]
    return [render.layout(sc, budget) for sc, budget in zip(scenes, _budgets(scenes, max_frames), strict=True)]


def _budgets(scenes: list[Scene], max_frames: int) -> list[int]:
    """Share the frames out: a computation that needs fewer than an even share leaves the rest to the others."""
    needs = [render.frames_needed(sc) for sc in scenes]
    budgets = [0] * len(scenes)
    left, order = max_frames, sorted(range(len(scenes)), key=lambda n: needs[n])
    for rank, n in enumerate(order):
        budgets[n] = max(1, min(needs[n], left // (len(scenes) - rank)))
        left -= budgets[n]
    return budgets


def frames(scene: SceneOf, gradients: tuple[str, ...], max_frames: int,
           fn: str = "Recipe.animate") -> Iterator[tuple[Figure, Image.Image, str]]:
    """Every frame in turn: (the figure it is drawn on, the frame as an image, a label).

    The background of each computation is drawn once; each frame restores it, adds its produced value (which
    stays) and draws its own parts over it (blitting), so a frame costs only what changes.
    """
    layouts = _layouts(scene, gradients, max_frames, fn)
    fig = render.figure(max(lay.height for lay in layouts))
    canvas = FigureCanvasAgg(fig)
    for lay in layouts:
        fig.clear()
        values = render.values(lay.scene)
        ax = render.background(fig, lay, values)
        canvas.draw()
        for n, frame in enumerate(lay.frames):
            if n == 0:
                background = canvas.copy_from_bbox(fig.bbox)
            canvas.restore_region(background)
            for part in render.result_value(ax, lay, frame, values):
                ax.draw_artist(part)
            background = canvas.copy_from_bbox(fig.bbox)
            parts = render.frame_artists(ax, lay, frame, values)
            for part in parts:
                ax.draw_artist(part)
            image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba()).convert("RGB")
            yield fig, image, f"{lay.scene.gradient} {n + 1}/{len(lay.frames)}: {lay.scene.result} cell {frame.cell}"
            for part in parts:
                part.remove()


def paletted(drawn: Iterator[tuple[Figure, Image.Image, str]]) -> Iterator[tuple[Figure, Image.Image, str]]:
    """The frames with 192 colours: one palette per computation, from its first frame (all its fills are in the
    legend already). Mapping onto a given palette is ~40x faster than choosing one per frame, as PillowWriter
    does, and a paletted frame is about a third of the bytes of an RGB one (GIF, and the PNGs of to_html)."""
    palette, scene = None, None
    for fig, image, label in drawn:
        if label.split()[0] != scene:
            scene, palette = label.split()[0], image.quantize(192, method=Image.Quantize.FASTOCTREE)
        yield fig, image.quantize(palette=palette, dither=Image.Dither.NONE), label
