"""Generate the conv-arithmetic gallery (docs/gallery.md and its GIFs) with convgrad's own Recipe.animate.

Every case of Dumoulin and Visin's "A guide to convolution arithmetic for deep learning" (2016), with its
output-size relationship, then what that guide leaves out: the backward of every case, groups from 1 to
depthwise, output_padding, dilation together with stride. Each animation is drawn from the plan convgrad
runs, and every frame of such plans is checked against autograd by tests/test_explain_frames.py.

    PYTHONPATH=src python docs/make_gallery.py --out DIR             # every case
    PYTHONPATH=src python docs/make_gallery.py --out DIR --quick     # three cases, few frames

mkdocs runs it at build time through docs/gallery_hook.py; nothing it writes is committed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import convgrad

PAPER = "Dumoulin & Visin, A guide to convolution arithmetic for deep learning (2016)"


@dataclass(frozen=True)
class Case:
    """One picture of the gallery: a configuration, what it shows, and its output-size relationship."""

    slug: str
    section: str
    title: str
    input_size: tuple[int, ...]
    weight_size: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    backward: bool = True  # also animate grad_input and grad_weight

    def recipe(self) -> convgrad.Recipe:
        return convgrad.explain(self.input_size, self.weight_size, **self.kwargs)


def _c(slug: str, section: str, title: str, i: int, k: int, note: str = "", c: tuple[int, int] = (1, 1),
       **kw: Any) -> Case:
    return Case(slug, section, title, (1, c[0], i, i), (c[1], c[0] // kw.get("groups", 1), k, k), kw, note)


def _t(slug: str, title: str, i: int, k: int, note: str = "", **kw: Any) -> Case:
    return Case(slug, "Transposed convolutions", title, (1, 1, i, i), (1, 1, k, k), {"transposed": True, **kw}, note)


ARITHMETIC = "Convolutions (the guide's cases)"
CASES = [
    _c("no-padding-no-strides", ARITHMETIC, "No padding, no strides", 4, 3),
    _c("arbitrary-padding-no-strides", ARITHMETIC, "Arbitrary padding, no strides", 5, 4, padding=2),
    _c("same-padding-no-strides", ARITHMETIC, "Half ('same') padding, no strides", 5, 3, padding="same"),
    _c("full-padding-no-strides", ARITHMETIC, "Full padding, no strides", 5, 3, padding=2),
    _c("no-padding-strides", ARITHMETIC, "No padding, strides", 5, 3, stride=2),
    _c("padding-strides", ARITHMETIC, "Padding, strides", 5, 3, stride=2, padding=1),
    _c("padding-strides-odd", ARITHMETIC, "Padding, strides (odd)", 6, 3,
       "6 + 2 - 3 = 5 is odd: the last padded row lies past the last window (the leftover r = 1). Here it is "
       "padding, so every input row still gets a gradient; the next case is one where it is not.",
       stride=2, padding=1),
    _t("no-padding-no-strides-transposed", "No padding, no strides, transposed", 2, 3),
    _t("arbitrary-padding-no-strides-transposed", "Arbitrary padding, no strides, transposed", 6, 4, padding=2),
    _t("same-padding-no-strides-transposed", "Half padding, no strides, transposed", 5, 3, padding=1),
    _t("full-padding-no-strides-transposed", "Full padding, no strides, transposed", 7, 3, padding=2),
    _t("no-padding-strides-transposed", "No padding, strides, transposed", 2, 3, stride=2),
    _t("padding-strides-transposed", "Padding, strides, transposed", 3, 3, stride=2, padding=1),
    _t("padding-strides-odd-transposed", "Padding, strides, transposed (odd): output_padding", 3, 3,
       "output_padding=1 picks the 6x6 of the two outputs whose forward conv gives 3x3: the extra row gets no tap.",
       stride=2, padding=1, output_padding=1),
    _c("dilation", "Dilated convolutions", "No padding, no strides, dilation", 7, 3, dilation=2),
    Case("leftover-row", "Beyond the guide", "Stride leaving an input row unread", (1, 1, 8, 8), (1, 1, 3, 3),
         {"stride": 3, "padding": ((2, 0), (2, 0))},
         "8 + 2 - 3 = 7 leaves 7 mod 3 = 1 row past the last window, and it is a real row: the forward never reads "
         "it, so its grad_input is zero (marked in grad_input's frames)."),
    _c("dilation-stride", "Beyond the guide", "Dilation together with stride", 9, 3,
       "gcd(s, d) = 2: half the phases of grad_input receive no tap at all.", stride=2, dilation=2, padding=1),
    _t("output-padding-dilation", "Output padding with dilation > stride", 2, 2,
       "output_padding may reach max(s, d) - 1 = 2 here: the last two rows get no tap (so does row 1, and row 4: "
       "with gcd(2, 3) = 1 every phase has taps, but the taps are too few to reach every row).",
       stride=2, dilation=3, output_padding=2),
    _c("groups-1", "Beyond the guide", "Groups from 1 to depthwise: groups=1", 5, 3, c=(4, 4), padding=1),
    _c("groups-2", "Beyond the guide", "Groups from 1 to depthwise: groups=2", 5, 3, c=(4, 4), padding=1, groups=2),
    _c("groups-4", "Beyond the guide", "Groups from 1 to depthwise: groups=4 (depthwise)", 5, 3, c=(4, 4), padding=1,
       groups=4),
    _c("asymmetric-same-stride", "Beyond the guide", "'same' with stride 2 and an even kernel: asymmetric", 7, 4,
       "t = 4 is split (1, 2): the extra row goes after, as TensorFlow and JAX do.", stride=2, padding="same"),
]
QUICK = ("no-padding-no-strides", "padding-strides-odd-transposed", "groups-2")


def relationship(case: Case) -> str:
    """The output-size relationship of the case, with its numbers."""
    spec = case.recipe().spec
    i, k, s, d = spec.input_size[0], spec.kernel_size[0], spec.stride[0], spec.dilation[0]
    (lo, hi), o = spec.padding[0], spec.output_size[0]
    if spec.transposed:
        op = spec.output_padding[0]
        return (f"o = (i - 1)s - (p_lo + p_hi) + d(k - 1) + output_padding + 1 = ({i} - 1)·{s} - ({lo} + {hi}) + "
                f"{d}·({k} - 1) + {op} + 1 = {o}")
    return (f"o = floor((i + p_lo + p_hi - d(k - 1) - 1) / s) + 1 = floor(({i} + {lo} + {hi} - {d}·({k} - 1) - 1) / "
            f"{s}) + 1 = {o}")


def page(cases: list[Case]) -> str:
    lines = ["# Convolution arithmetic, forward and backward", "",
             f"Every case of {PAPER}, regenerated by convgrad from the plans its backends run, then the backward of "
             "each case and what the guide leaves out: groups, output_padding, dilation together with stride. Each "
             "frame shows the grid the contraction reads (padding grey, inserted zeros yellow, cropped cells "
             "hatched), the kernel's footprint lettered with its taps, flipped where the plan flips it, and the "
             "cell being produced. Sizes are per spatial dim, i = input, k = kernel, s = stride, d = dilation, "
             "p = padding, o = output.", "",
             "The same pictures for any configuration: `convgrad explain ... --animate out.gif` or `--html out.html`.",
             ""]
    section = None
    for case in cases:
        if case.section != section:
            section = case.section
            lines += [f"## {section}", ""]
        spec = case.recipe().spec
        lines += [f"### {case.title}", "", f"`{spec.describe()}`", "", f"`{relationship(case)}`", ""]
        if case.note:
            lines += [case.note, ""]
        lines += [f"![{case.title}: the forward pass](gallery/{case.slug}.gif)", ""]
        if case.backward:
            lines += ["Its backward: grad_input, then grad_weight.", "",
                      f"![{case.title}: grad_input](gallery/{case.slug}-grad_input.gif)", "",
                      f"![{case.title}: grad_weight](gallery/{case.slug}-grad_weight.gif)", ""]
    return "\n".join(lines)


FRAMES = {"forward": 64, "grad_input": 25, "grad_weight": 16}  # the most frames per animation


def build(out: Path, cases: list[Case], max_frames: int | None = None, progress: Any = None) -> list[Path]:
    """Write gallery.md and gallery/*.gif under ``out`` (``max_frames`` per GIF, default FRAMES); returns the
    paths written."""
    (out / "gallery").mkdir(parents=True, exist_ok=True)
    written = []
    for case in cases:
        recipe = case.recipe()
        jobs = [("forward", f"{case.slug}.gif")]
        if case.backward:
            jobs += [(g, f"{case.slug}-{g}.gif") for g in ("grad_input", "grad_weight")]
        for gradient, name in jobs:
            frames = max_frames or FRAMES[gradient]
            written.append(recipe.animate(out / "gallery" / name, gradients=(gradient,), max_frames=frames))
            if progress is not None:
                progress(written[-1])
    (out / "gallery.md").write_text(page(cases), encoding="utf-8")
    return [out / "gallery.md", *written]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}, 4 frames each")
    args = parser.parse_args(argv)
    cases = [c for c in CASES if c.slug in QUICK] if args.quick else CASES
    build(args.out, cases, 4 if args.quick else None, progress=print)


if __name__ == "__main__":
    main()
