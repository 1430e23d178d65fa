"""Recipe.plot: the key frames of grad_input and grad_weight, drawn from their plans (matplotlib, Agg).

One block per key frame, stacked: for a plan with phases (polyphase, sub-pixel) one block per phase (the
first cell each phase fills, so every phase's taps and rows are shown), otherwise the cell that reads the
most entries. Every block is drawn by explain/render.py from the scene's own frames, like the animation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from matplotlib.figure import Figure

from convgrad.errors import ConvgradValueError
from convgrad.explain import render
from convgrad.explain.frames import Frame, SceneOf

__all__ = ["MAX_PHASES", "key_frames", "plot"]

MAX_PHASES = 4  # phase blocks per gradient; the caption says when there are more


def key_frames(lay: render.Layout) -> list[Frame]:
    """The frames a still picture shows: the first of every phase, or the one that reads the most entries."""
    frames = [f for f in lay.frames if f.channel == lay.frames[0].channel]
    firsts: dict[tuple[int, ...], Frame] = {}
    for f in frames:
        if f.phase is not None:
            firsts.setdefault(f.phase, f)
    if firsts:
        return list(firsts.values())[:MAX_PHASES]
    return [max(frames, key=lambda f: len(f.claims()))]


def plot(scene: SceneOf, path: str | Path | None = None,
         gradients: tuple[str, ...] = ("grad_input", "grad_weight")) -> Figure:
    """The figure of Recipe.plot; saved to ``path`` when given."""
    if not gradients or any(g not in ("grad_input", "grad_weight") for g in gradients):
        raise ConvgradValueError(f"Recipe.plot: gradients={gradients!r} must be a non-empty selection of "
                                 f"('grad_input', 'grad_weight')")
    blocks = []
    for gradient in gradients:
        lay = render.layout(scene(gradient), 120)
        keys = key_frames(lay)
        phases = {f.phase for f in lay.frames if f.phase is not None}
        if len(phases) > len(keys):
            lay.note = "; ".join(filter(None, [lay.note, f"{len(keys)} of {len(phases)} phases drawn"]))
        blocks += [(lay, f) for f in keys]
    fig = render.figure(sum(lay.height for lay, _ in blocks))
    top = 0.0
    for lay, frame in blocks:  # each block's legend lists its own frame's kernel cells, every result cell done
        block = dataclasses.replace(lay, frames=[frame])
        done = [f for f in lay.frames if f.channel == frame.channel and f is not frame]  # others would overprint it
        render.draw(block, frame, render.values(lay.scene), done, fig=fig, top=top)
        top += lay.height
    if path is not None:
        fig.savefig(Path(path), dpi=render.DPI)
    return fig
