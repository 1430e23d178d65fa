"""mkdocs hook: generate the conv-arithmetic gallery (docs/make_gallery.py) into the site at build time.

The page and its GIFs are written to a cache directory keyed by the sources that draw them, then added
to the build as generated files: nothing is written into docs/ and nothing is committed. Set
CONVGRAD_GALLERY=quick for three cases with few frames (a fast preview); a build run from pytest
(PYTEST_CURRENT_TEST set) is quick too, since tests/test_explain_gallery.py checks the script itself.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

DOCS = Path(__file__).resolve().parent
SOURCES = [DOCS / "make_gallery.py", *sorted((DOCS.parent / "src" / "convgrad").glob("explain/*.py")),
           *sorted((DOCS.parent / "src" / "convgrad").glob("backends/fwdconv*.py"))]


def _make_gallery() -> Any:
    spec = importlib.util.spec_from_file_location("make_gallery", DOCS / "make_gallery.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_gallery"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    quick = os.environ.get("CONVGRAD_GALLERY") == "quick" or "PYTEST_CURRENT_TEST" in os.environ
    key = hashlib.sha256(b"quick" if quick else b"full")
    for source in SOURCES:
        key.update(source.read_bytes())
    out = Path(tempfile.gettempdir()) / f"convgrad-gallery-{key.hexdigest()[:16]}"
    if not (out / "gallery.md").is_file():
        gallery = _make_gallery()
        cases = [c for c in gallery.CASES if c.slug in gallery.QUICK] if quick else gallery.CASES
        partial = Path(tempfile.mkdtemp(prefix="convgrad-gallery-"))
        gallery.build(partial, cases, 4 if quick else None)
        if not out.exists():  # another build may have finished first
            partial.replace(out)
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        files.append(File(path.relative_to(out).as_posix(), str(out), config["site_dir"], config["use_directory_urls"]))
    return files
