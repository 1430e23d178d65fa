"""The conv-arithmetic gallery: docs/make_gallery.py regenerates every case, and its page links what it wrote."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _gallery() -> Any:
    spec = importlib.util.spec_from_file_location("make_gallery", DOCS / "make_gallery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_gallery"] = module
    spec.loader.exec_module(module)
    return module


def test_the_gallery_covers_every_case_of_the_guide() -> None:
    gallery = _gallery()
    slugs = {c.slug for c in gallery.CASES}
    guide = {f"{p}-{s}" for p in ("no-padding", "arbitrary-padding", "same-padding", "full-padding")
             for s in ("no-strides", "no-strides-transposed")}
    guide |= {f"{p}{t}" for p in ("no-padding-strides", "padding-strides", "padding-strides-odd")
              for t in ("", "-transposed")} | {"dilation"}
    assert len(guide) == 15 and guide <= slugs
    beyond = {"groups-1", "groups-2", "groups-4", "dilation-stride", "output-padding-dilation"}
    assert beyond <= slugs
    for case in gallery.CASES:  # the output size each relationship states is the one convgrad computes
        spec = case.recipe().spec
        assert gallery.relationship(case).endswith(f"= {spec.output_size[0]}")
    same = next(c for c in gallery.CASES if c.slug == "same-padding-no-strides").recipe().spec
    assert same.output_size == same.input_size


@pytest.mark.slow  # the gallery
def test_make_gallery_writes_the_page_and_every_animation_it_links(tmp_path: Path) -> None:
    gallery = _gallery()
    cases = [c for c in gallery.CASES if c.slug in gallery.QUICK]
    written = gallery.build(tmp_path, cases, max_frames=3)
    page = (tmp_path / "gallery.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\((gallery/[\w.-]+\.gif)\)", page)
    assert len(linked) == 3 * len(cases)
    assert {tmp_path / p for p in linked} == set(written[1:])
    for path in written[1:]:
        with Image.open(path) as gif:
            assert gif.size[0] == 800 and 1 <= gif.n_frames <= 3
    for case in cases:
        assert case.title in page and gallery.relationship(case) in page
