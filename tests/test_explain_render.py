"""What users see of explain: readable frames (measured from the figures), legends that list only what is
drawn, the pictures that once contradicted the text, animations, the HTML page, and the command's flags."""

from __future__ import annotations

import base64
import functools
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from matplotlib.colors import to_hex, to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from PIL import Image

import convgrad
from convgrad import cli
from convgrad.backends.fwdconv import steps
from convgrad.explain import animation, canvas, legend, render
from convgrad.explain.symbols import used_symbols

CONFIGS = {  # name -> (input_size, weight_size, kwargs of convgrad.explain)
    "1d-dilated": ((1, 1, 9), (1, 1, 3), dict(stride=2, dilation=2, padding=1)),
    "2d-zero-insert": ((1, 1, 5, 5), (1, 1, 3, 3), dict(stride=2, method="zero_insert")),
    "2d-transposed": ((1, 1, 3, 3), (1, 1, 3, 3), dict(stride=2, padding=1, transposed=True, output_padding=1)),
    "2d-groups": ((2, 4, 6, 6), (4, 2, 3, 3), dict(groups=2, stride=2, padding=((1, 0), (0, 1)))),
    "3d": ((1, 1, 4, 5, 5), (1, 1, 3, 3, 3), dict(stride=(1, 2, 2), padding=1)),
    "3d-transposed": ((1, 2, 2, 3, 3), (2, 1, 2, 3, 3), dict(stride=2, transposed=True, groups=2)),
    "224": ((1, 3, 224, 224), (8, 3, 7, 7), dict(stride=2, padding=3)),
}


def _recipe(name: str) -> convgrad.Recipe:
    input_size, weight_size, kw = CONFIGS[name]
    return convgrad.explain(input_size, weight_size, **kw)


@functools.cache
def _frame_figures_of(name: str) -> list[tuple[render.Layout, Figure]]:
    """The three middle frames of a configuration, drawn once per session: the tests below only read them."""
    return _frame_figures(_recipe(name))


def _frame_figures(recipe: convgrad.Recipe) -> list[tuple[render.Layout, Figure]]:
    out = []
    for gradient in ("forward", "grad_input", "grad_weight"):
        lay = render.layout(recipe.scene(gradient), 40)
        out.append((lay, render.draw(lay, lay.frames[len(lay.frames) // 2], render.values(lay.scene),
                                     lay.frames[:len(lay.frames) // 2])))
    return out


def _px(ax: Any, patch: Rectangle) -> tuple[float, float]:
    """A rectangle's width and height on the canvas, in pixels."""
    x, y, w, h = patch.get_x(), patch.get_y(), patch.get_width(), patch.get_height()
    (x0, y0), (x1, y1) = ax.transData.transform([(x, y), (x + w, y + h)])
    return abs(x1 - x0), abs(y1 - y0)


def _cells(fig: Figure) -> list[tuple[Rectangle, float]]:
    """Every filled square drawn (grid cells and channel boxes) with its side in pixels."""
    out = []
    for ax in fig.axes:
        for p in ax.patches:
            if isinstance(p, Rectangle) and p.get_fill() and p.get_width() == p.get_height() and p.get_width() > 0:
                out.append((p, _px(ax, p)[0]))
    return out


# "3d" is the costliest drawing and the only one no other test shares (3d-transposed draws 3d in the fast tier)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in ("224", "3d") else n
                                  for n in CONFIGS], ids=str)
def test_frames_are_800_px_wide_with_text_of_9_px_and_cells_of_20_px(name: str) -> None:
    for _, fig in _frame_figures_of(name):
        assert round(fig.get_size_inches()[0] * fig.dpi) == 800
        texts = [t for t in fig.findobj(Text) if t.get_text() and t.get_visible()]
        assert texts and min(t.get_fontsize() * fig.dpi / 72 for t in texts) >= 9
        sides = [side for _, side in _cells(fig)]
        assert len(sides) > 4 and min(sides) >= 20 - 1e-9


@pytest.mark.parametrize("name", ["2d-groups", "2d-transposed", "1d-dilated"], ids=str)
def test_colours_come_from_the_palette_and_stay_apart_for_colour_blind_eyes(name: str) -> None:
    for lay, fig in _frame_figures_of(name):
        fills = {to_hex(p.get_facecolor(), keep_alpha=False) for ax in fig.axes for p in ax.patches
                 if isinstance(p, Rectangle) and p.get_fill()}
        assert all(_okabe_ito_tint_or_grey(c) for c in fills), [c for c in fills if not _okabe_ito_tint_or_grey(c)]
        legend = [(fill, hatch) for row in render.legend_rows(lay) for fill, hatch, _ in row if fill != "none"]
        plain = [f for f, hatch in legend if not hatch]  # hatched entries differ by their hatching too
        for n, a in enumerate(plain):
            for b in plain[n + 1:]:
                assert min(_cvd_distance(a, b, kind) for kind in _CVD) >= 0.04, (a, b)


OKABE_ITO = ["#E69F00", "#56B4E9", "#009E73", "#F0E442", "#0072B2", "#D55E00", "#CC79A7", "#000000"]


def _okabe_ito_tint_or_grey(colour: str) -> bool:
    """Whether a colour is one of Okabe and Ito's eight mixed with white (amount a in (0, 1]), or a grey."""
    rgb = torch.tensor(to_rgb(colour), dtype=torch.float64)
    if float(rgb.max() - rgb.min()) < 1e-9:
        return True
    for base in OKABE_ITO:
        b = torch.tensor(to_rgb(base), dtype=torch.float64)
        away = 1 - b  # tint = 1 - a * (1 - base)
        a = float(((1 - rgb) * away).sum() / (away * away).sum())
        if 0 < a <= 1 and float((1 - a * away - rgb).abs().max()) <= 1.5 / 255:
            return True
    return False


# Machado, Oliveira and Fernandes (2009), severity 1: what protanopes, deuteranopes and tritanopes see, in linear RGB.
_CVD = {
    "protanopia": [[0.152286, 1.052583, -0.204868], [0.114503, 0.786281, 0.099216], [-0.003882, -0.048116, 1.051998]],
    "deuteranopia": [[0.367322, 0.860646, -0.227968], [0.280085, 0.672501, 0.047413], [-0.011820, 0.042940, 0.968881]],
    "tritanopia": [[1.255528, -0.076749, -0.178779], [-0.078411, 0.930809, 0.147602], [0.004733, 0.691367, 0.303900]],
}


def _cvd_distance(a: str, b: str, kind: str) -> float:
    """Distance of two colours as a colour-blind eye sees them (linear RGB, 0..1 per channel)."""
    m = torch.tensor(_CVD[kind], dtype=torch.float64)

    def seen(c: str) -> torch.Tensor:
        rgb = torch.tensor(to_rgb(c), dtype=torch.float64)
        linear = torch.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
        return (m @ linear).clamp(0, 1)

    return float((seen(a) - seen(b)).norm())


@pytest.mark.parametrize("name", ["2d-zero-insert", "2d-groups", "3d-transposed"], ids=str)
def test_the_legend_lists_what_is_drawn_and_only_that(name: str) -> None:
    for lay, fig in _frame_figures_of(name):
        legend = {f.upper() for row in render.legend_rows(lay) for f, _, _ in row if f != "none"}
        drawn = {to_hex(p.get_facecolor(), keep_alpha=False).upper() for p, side in _cells(fig) if side > 20}
        bars = {to_hex(p.get_facecolor(), keep_alpha=False).upper() for ax in fig.axes for p in ax.patches
                if isinstance(p, Rectangle) and p.get_fill() and p.get_height() < p.get_width()}
        assert legend <= drawn | bars | {render.FILLS["done"].upper()}, legend - drawn - bars
        groups = {c.upper() for c in render.GROUP_COLOURS}
        assert drawn - {"#FFFFFF"} - groups <= legend, drawn - legend  # white: cells not produced yet


@pytest.mark.parametrize("name", ["2d-zero-insert", "2d-groups", "1d-dilated"], ids=str)
def test_every_symbol_a_frame_uses_is_defined_once_in_its_caption(name: str) -> None:
    recipe = _recipe(name)
    for lay, fig in _frame_figures_of(name):
        caption = " ".join(render.caption(lay))
        words = " ".join(t.get_text() for t in fig.findobj(Text) if t.get_text() not in render.caption(lay))
        for symbol, definition in used_symbols(words):
            assert caption.count(f"{symbol}: {definition}") == 1, symbol
    text = str(recipe)
    body, symbols = text.split("\nsymbols:\n")
    defined = [line.split()[0] for line in symbols.splitlines()]
    assert defined == [s for s, _ in used_symbols(body) for s in [s.split()[0]]]  # exactly those the text uses
    assert ("phase" in body) == ("phase" in defined)


def _block_fills(ax: Any) -> list[str]:
    return [to_hex(p.get_facecolor(), keep_alpha=False).upper() for p in ax.patches
            if isinstance(p, Rectangle) and p.get_fill() and p.get_width() == p.get_height()]


def test_strided_plot_draws_the_phases_and_zero_insert_the_zeros() -> None:
    recipe = convgrad.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2)
    assert recipe.input_plan.method in ("polyphase", "subpixel") and "phase" in str(recipe)
    fig = recipe.plot()
    blocks = fig.axes[:-1]  # one block per phase of grad_input, then grad_weight
    assert len(blocks) == 4
    bars = [{to_hex(p.get_facecolor(), keep_alpha=False).upper() for p in ax.patches
             if isinstance(p, Rectangle) and p.get_fill() and p.get_height() < p.get_width()} for ax in blocks]
    assert all({c.upper() for c in render.PHASES[:4]} <= b for b in bars)
    phases = [t.get_text() for ax in blocks for t in ax.texts if t.get_text().startswith("phase rho = ")]
    assert len(set(phases)) == 4
    zero = render.FILLS["zero"].upper()
    assert zero not in {c for ax in fig.axes for c in _block_fills(ax)}

    textbook = convgrad.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2, method="zero_insert")
    assert "zero-insert" in str(textbook)
    fig = textbook.plot()
    assert len(fig.axes) == 2
    assert _block_fills(fig.axes[0]).count(zero) == 5  # grad_output 2x2 zero-inserted by 2: 3x3 with 5 zeros


def test_each_block_of_a_plot_lists_only_the_kernel_cells_it_draws() -> None:
    # phase (0, 0) of a 3x3 kernel at stride 2 uses all four of its slots: its block drew no zero tap but the
    # scene-wide legend listed one
    fig = convgrad.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).plot()
    blocks = fig.axes[:4]
    label = canvas.LABELS["zero_tap"]
    for ax in blocks:
        hatched = any(isinstance(p, Rectangle) and p.get_hatch() == canvas.HATCHES["zero_tap"]
                      and p.get_width() > 20 for p in ax.patches)
        listed = any(t.get_text() == label for t in ax.texts)
        assert listed == hatched
    assert [any(t.get_text() == label for t in ax.texts) for ax in blocks] == [False, True, True, True]


def test_transposed_plot_pads_as_the_text_says() -> None:
    recipe = convgrad.explain((1, 1, 3, 3), (1, 1, 3, 3), stride=2, padding=1, output_padding=1, transposed=True)
    pad = next(st for st in recipe.steps("grad_input") if st.kind == "Pad")
    assert pad.step.pads == ((1, 0), (1, 0)) and f"pad (lo, hi) = {pad.step.pads}" in str(recipe)
    fig = recipe.plot()
    fills = _block_fills(fig.axes[0])
    entries, padding = fills.count(render.FILLS["row"].upper()), fills.count(render.FILLS["pad"].upper())
    assert (entries, padding) == (36, 13)  # 6x6 grad_output padded (1, 0) per dim: 7x7, as pad.shape says
    assert pad.shape[2:] == (7, 7)


def test_printed_numbers_are_the_sums_of_the_drawn_products() -> None:
    for name in ("2d-groups", "2d-transposed", "1d-dilated"):
        recipe = _recipe(name)
        for gradient in ("forward", "grad_input", "grad_weight"):
            sc = recipe.scene(gradient)
            t = render.values(sc)
            kernel_lead = () if sc.kernel == "weight" else (0,)
            for frame in sc.frames():
                total = sum(float(t[sc.data][(0, *d)] * t[sc.kernel][(*kernel_lead, *k)]) for d, k in frame.claims())
                index = (*(() if gradient == "grad_weight" else (0,)), *frame.channel, *frame.cell)
                assert total == float(t[sc.result][index]), (name, gradient, frame.cell)


@pytest.mark.slow  # a 224x224 layer drawn and animated
def test_a_big_layer_is_bounded_and_says_so(tmp_path: Path) -> None:
    recipe = _recipe("224")
    for gradient in ("forward", "grad_input", "grad_weight"):
        lay = render.layout(recipe.scene(gradient), 40)
        assert len(lay.frames) <= 40 and "the top-left corner of the result" in lay.note
        assert any(line.startswith("shown: ") or "shown: " in line for line in render.caption(lay))
    lay = render.layout(recipe.scene("grad_weight"), 40)  # every cell reads all of the input: clip it too
    assert "of 24" in lay.note and "rows per dim of input and grad_output" in lay.note
    with Image.open(recipe.animate(tmp_path / "big.gif", max_frames=6)) as gif:
        assert 3 <= gif.n_frames <= 6
    assert (tmp_path / "big.gif").stat().st_size < 2**20


# 2d-transposed is animated in the fast tier by test_cli_animates_and_writes_html_with_a_chosen_method
@pytest.mark.parametrize("name", ["1d-dilated", *(pytest.param(n, marks=pytest.mark.slow)
                                  for n in ("2d-transposed", "2d-groups", "3d", "3d-transposed"))], ids=str)
def test_animate_writes_a_bounded_gif(name: str, tmp_path: Path) -> None:
    path = _recipe(name).animate(tmp_path / "a.gif", max_frames=9)
    with Image.open(path) as gif:
        assert gif.n_frames <= 9 and gif.size[0] == 800


def test_animate_writes_webp_and_explains_mp4_without_ffmpeg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe = _recipe("1d-dilated")
    with Image.open(recipe.animate(tmp_path / "a.webp", gradients=("forward",), max_frames=3)) as webp:
        assert webp.n_frames == 3
    monkeypatch.setattr(animation.animation.writers, "is_available", lambda name: False)
    with pytest.raises(ValueError, match="needs ffmpeg, which is not installed"):
        recipe.animate(tmp_path / "a.mp4")
    with pytest.raises(ValueError, match=r"must end in one of"):
        recipe.animate(tmp_path / "a.avi")
    with pytest.raises(ValueError, match="gradients="):
        recipe.animate(tmp_path / "a.gif", gradients=("grad_bias",))
    with pytest.raises(ValueError, match="does not exist"):
        recipe.animate(tmp_path / "missing" / "a.gif")


@pytest.mark.parametrize("name", ["1d-dilated", "2d-zero-insert",
                                  pytest.param("3d-transposed", marks=pytest.mark.slow)], ids=str)
def test_html_is_self_contained(name: str, tmp_path: Path) -> None:
    recipe = _recipe(name)
    page = recipe.to_html(tmp_path / "a.html", max_frames=6).read_text()
    assert "http" not in page.lower() and "src=\"//" not in page
    assert '<input id="slider" type="range"' in page
    assert "recipe matches torch autograd" in page and recipe.spec.describe() in page
    frames = json.loads(re.search(r"const frames = (\[.*?\]);", page).group(1))  # type: ignore[union-attr]
    assert 3 <= len(frames) <= 6
    for data in frames:
        png = base64.b64decode(data.replace("-", "h").replace("_", "H"))
        assert png[:8] == b"\x89PNG\r\n\x1a\n"
        with Image.open(io.BytesIO(png)) as image:  # paletted like the GIF's frames: a third of RGB's bytes
            assert image.mode == "P" and image.size[0] == 800


def test_cli_animates_and_writes_html_with_a_chosen_method(tmp_path: Path, capsys: Any) -> None:
    gif, page = tmp_path / "t.gif", tmp_path / "t.html"
    assert cli.main(["explain", "--input", "1,1,3,3", "--weight", "1,1,3,3", "--transposed", "--stride", "2",
                     "--method", "polyphase", "--animate", str(gif), "--html", str(page), "--max-frames", "6",
                     "--text"]) == 0
    out = capsys.readouterr().out
    assert "polyphase" in out and "symbols:" in out
    assert gif.exists() and "http" not in page.read_text().lower()


@pytest.mark.parametrize(("argv", "message"), [
    (["--method", "nope"], "method='nope' must be None or one of"),
    (["--method", "subpixel", "--dilation", "2"], "input_method='subpixel' cannot serve"),
    (["--method", "blocks", "--stride", "2"], "weight_method='blocks' cannot serve"),
    (["--method", "taps", "--weight-method", "kernel"], "disagree"),
    (["--max-frames", "2", "--animate", "x.gif"], "--max-frames=2 must be at least 3: one frame for each of"),
])
def test_cli_method_errors_are_one_line(argv: list[str], message: str, capsys: Any) -> None:
    assert cli.main(["explain", "--input", "1,1,7,7", "--weight", "1,1,3,3", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


def test_1d_captions_write_numbers_not_one_tuples() -> None:
    # a 1d frame read "the conv pads (2,) on both sides" and "result channels 0 of 2 shown (...) shown"
    recipe = convgrad.explain((1, 2, 6), (2, 2, 3), padding=2, dilation=2)
    for gradient in ("forward", "grad_input", "grad_weight"):
        lay = render.layout(recipe.scene(gradient), 40)
        assert ",)" not in legend.data_steps(lay.scene)  # spec.describe() in the caption keeps torch's (2,)
        assert "shown" not in lay.note
    steps = legend.data_steps(recipe.scene("grad_input"))
    assert "pads 2 on both sides" in steps and "taps 2 apart" in steps, steps


def test_cells_no_tap_reaches_print_0_not_minus_0() -> None:
    # stride 3 on 8 rows: grad_input's last two rows and columns are sums of no products, -0.0 in torch
    recipe = convgrad.explain((1, 1, 8, 8), (1, 1, 3, 3), stride=3, method="zero_insert")
    fig = recipe.plot()
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert "-0" not in texts and "-0.0" not in texts
    assert [legend.number(v) for v in (-0.0, -0.04, 2.0, -2.5, 1234.0)] == ["0", "0", "2", "-2.5", "1k"]


def test_the_subtitle_reads_each_steps_label_not_its_describe_wording(monkeypatch: pytest.MonkeyPatch) -> None:
    # explain/layout.py used to strip describe() with a regex: rewording a sentence changed the picture
    recipe = convgrad.explain((1, 2, 7, 7), (2, 2, 3, 3), stride=2, padding=((1, 0), (0, 2)), method="zero_insert")
    before = legend.data_steps(recipe.scene("grad_input"))
    assert "zero-insert by stride (2, 2)" in before and "pad (lo, hi) =" in before, before
    for kind in (steps.ZeroInsert, steps.Pad):
        monkeypatch.setattr(kind, "describe", lambda self: "reworded (stride-1 zeros, negative = crop)")
    assert legend.data_steps(recipe.scene("grad_input")) == before
    assert "reworded" in str(recipe)  # the text view does read describe()


@pytest.mark.parametrize(("write", "fn", "suffix"), [
    (lambda r, p: r.plot(p), "Recipe.plot", ".png"),
    (lambda r, p: r.plot(p, gradients=("grad_weight",)), "Recipe.plot", ".svg"),
    (lambda r, p: r.to_html(p, max_frames=3), "Recipe.to_html", ".html"),
    (lambda r, p: r.animate(p, max_frames=3), "Recipe.animate", ".gif"),
], ids=["plot", "plot-one-gradient", "to_html", "animate"])
def test_every_picture_into_a_missing_folder_says_so_the_same_way(write: Any, fn: str, suffix: str,
                                                                 tmp_path: Path) -> None:
    """Before: ``Recipe.plot('/missing/x.png')`` raised PIL's raw FileNotFoundError after drawing, where to_html and
    animate said which folder is missing."""
    path = tmp_path / "missing" / f"x{suffix}"
    with pytest.raises(ValueError) as info:
        write(_recipe("1d-dilated"), path)
    assert str(info.value) == f"{fn}: path={str(path)!r}: the directory {str(path.parent)!r} does not exist"
