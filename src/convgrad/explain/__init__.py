"""How each gradient of a convolution is built from forward operations, and which native kernel runs.

One view per module, all read from the same fwdconv plans, so what is explained is what runs:

- ``recipe``: ``explain(...)`` and ``Recipe`` (the text view, ``str(recipe)``), with ``symbols``;
- ``code``: ``Recipe.to_python()``, a standalone PyTorch script;
- ``frames``: every cell a plan produces and the products it sums, read from each step's geometry;
- ``layout`` and ``render``: which frames, where, drawn with matplotlib;
- ``picture``: ``Recipe.plot()``; ``animation``: ``Recipe.animate()``; ``html``: ``Recipe.to_html()``;
- ``native``: ``native_backend(...)``, which kernel ``aten.convolution_backward`` dispatches to.

``convgrad.explain`` is this package, and calling it calls ``explain`` (see ``_CallableModule``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from convgrad.explain.native import NativeChoice, native_backend
from convgrad.explain.recipe import Leftover, Recipe, RecipeStep, explain

__all__ = ["Leftover", "NativeChoice", "Recipe", "RecipeStep", "explain", "native_backend"]


class _CallableModule(types.ModuleType):
    """Importing this package binds it to ``convgrad.explain``, shadowing the lazily exported function of the
    same name; calling the package calls the function, so ``convgrad.explain(...)`` works in any import order."""

    def __call__(self, *args: Any, **kwargs: Any) -> Recipe:
        return explain(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
