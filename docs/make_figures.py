"""Regenerate the figures of docs/derivation.md with convgrad's own Recipe.plot.

    PYTHONPATH=src python docs/make_figures.py            # writes docs/img/*.png
    PYTHONPATH=src python docs/make_figures.py --out DIR  # anywhere else

FIGURES are the geometry pictures; METHODS has one picture per formulation that ``convgrad explain`` can show,
each on a layer for which fwdconv's own rules choose it (zero_insert, the textbook form they never choose, is
forced), so the page's "when it wins" quotes the rule's reason (tests/test_docs.py checks both).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import convgrad

# file name -> (input_size, weight_size, keyword arguments of convgrad.explain)
FIGURES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "stride2-leftover.png": ((1, 1, 6, 6), (1, 1, 3, 3), dict(stride=2)),
    "asym-crop.png": ((1, 1, 8, 8), (1, 1, 2, 2), dict(stride=3, padding=((0, 0), (2, 0)))),
    "same-stride2.png": ((1, 1, 7, 7), (1, 1, 4, 4), dict(stride=2, padding="same")),
    "dilated-1d.png": ((1, 1, 9), (1, 1, 3), dict(stride=2, dilation=2, padding=1)),
    "transposed.png": ((1, 1, 3, 3), (1, 1, 3, 3), dict(stride=2, padding=1, output_padding=1, transposed=True)),
    "conv3d.png": ((1, 1, 5, 6, 4), (1, 1, 3, 2, 2), dict(stride=(2, 3, 1))),
}


@dataclass(frozen=True)
class Method:
    """One formulation's picture: the layer it is drawn on and the gradient it computes."""

    gradient: str  # "grad_input" or "grad_weight"
    input_size: tuple[int, ...]
    weight_size: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    forced: bool = False  # shown with method=..., because the rules never choose it

    @property
    def file(self) -> str:
        return f"method-{self.name}.png"

    @property
    def name(self) -> str:
        return next(name for name, m in METHODS.items() if m is self)

    def recipe(self) -> convgrad.Recipe:
        return convgrad.explain(self.input_size, self.weight_size, **self.kwargs,
                                method=self.name if self.forced else None)

    def plan(self) -> Any:
        recipe = self.recipe()
        return recipe.input_plan if self.gradient == "grad_input" else recipe.weight_plan


METHODS: dict[str, Method] = {
    "zero_insert": Method("grad_input", (1, 1, 5, 5), (1, 1, 3, 3), dict(stride=2), forced=True),
    "polyphase": Method("grad_input", (1, 2, 6, 6), (2, 1, 3, 3), dict(stride=2, groups=2)),
    "subpixel": Method("grad_input", (1, 1, 5, 5), (1, 1, 3, 3), dict(stride=2)),
    "direct": Method("grad_input", (1, 1, 5, 5), (1, 1, 3, 3), dict(padding=1)),
    "kernel": Method("grad_weight", (3, 4, 5, 5), (2, 4, 3, 3), dict(stride=2)),
    "per_sample": Method("grad_weight", (1, 1, 5, 5), (1, 1, 3, 3), dict(stride=2)),
    "taps": Method("grad_weight", (1, 1, 6, 6), (1, 1, 2, 2), dict(stride=2)),
    "blocks": Method("grad_weight", (3, 4, 7, 7), (2, 4, 3, 3), dict(dilation=2)),
    "phases": Method("grad_weight", (1, 1, 4, 6, 6), (1, 1, 3, 3, 3), dict(stride=(1, 2, 2))),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "img")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for name, (input_size, weight_size, kw) in FIGURES.items():
        convgrad.explain(input_size, weight_size, **kw).plot(out / name)
        print(f"wrote {out / name}")
    for method in METHODS.values():
        method.recipe().plot(out / method.file, gradients=(method.gradient,))
        print(f"wrote {out / method.file}")


if __name__ == "__main__":
    main()
