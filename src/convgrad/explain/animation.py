"""Recipe.animate: a step-through of every cell each computation produces, written with matplotlib's writers.

The frames come from explain/raster.py (explain's frames, drawn by explain/render.py), one figure per
file. GIF and WebP go through Pillow; MP4 through matplotlib's FFMpegWriter, which needs
ffmpeg and says so when it is missing.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib import animation

from convgrad.errors import ConvgradValueError
from convgrad.explain import render
from convgrad.explain.frames import SceneOf
from convgrad.explain.raster import check_path, frames, paletted

__all__ = ["SUFFIXES", "animate"]

SUFFIXES = (".gif", ".webp", ".mp4", ".html")  # .html: Recipe.animate hands it to html.to_html


def animate(scene: SceneOf, path: Path, gradients: tuple[str, ...], max_frames: int, fps: float) -> Path:
    """Write the animation of Recipe.animate to ``path``: GIF or WebP with Pillow, MP4 with ffmpeg."""
    suffix = path.suffix.lower()
    if suffix not in SUFFIXES:
        raise ConvgradValueError(f"Recipe.animate: path={str(path)!r} must end in one of {SUFFIXES}")
    if not fps > 0:
        raise ConvgradValueError(f"Recipe.animate: fps={fps!r} must be positive")
    check_path(path, "Recipe.animate")
    if suffix == ".mp4":
        if not animation.writers.is_available("ffmpeg"):
            raise ConvgradValueError(
                f"Recipe.animate: {path} needs ffmpeg, which is not installed; write a .gif or .webp "
                f"(Pillow) or an .html page instead")
        writer = animation.FFMpegWriter(fps=fps)
        drawn = frames(scene, gradients, max_frames)
        fig, _, _ = next(drawn)
        with writer.saving(fig, str(path), dpi=render.DPI):
            writer.grab_frame()
            for _ in drawn:
                writer.grab_frame()
        return path
    drawn = frames(scene, gradients, max_frames)
    images = [image for _, image, _ in (paletted(drawn) if suffix == ".gif" else drawn)]
    images[0].save(path, save_all=True, append_images=images[1:], duration=round(1000 / fps), loop=0)
    return path
