"""Regenerate the figures of docs/derivation.md with convgrad's own Recipe.plot.

    PYTHONPATH=src python docs/make_figures.py            # writes docs/img/*.png
    PYTHONPATH=src python docs/make_figures.py --out DIR  # anywhere else
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "img")
    out = parser.parse_args(argv).out
    out.mkdir(parents=True, exist_ok=True)
    for name, (input_size, weight_size, kw) in FIGURES.items():
        convgrad.explain(input_size, weight_size, **kw).plot(out / name)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main()
