"""How each gradient of a convolution is built from forward operations, and which native kernel runs.

``Recipe`` is data: the fwdconv plans of one layer. Every view is a module that reads it, and each step
of a plan brings its own parts (describe, label, code, geometry), so no view knows a step kind by name:

- ``recipe``: ``explain(...)``, ``Recipe`` and its text (``str(recipe)``), with ``symbols``;
- ``code``: ``Recipe.to_python()``, a standalone PyTorch script;
- ``frames``: every cell a plan produces and the products it sums, read from each step's geometry;
- ``canvas``, ``placement``, ``legend`` and ``render``: the sizes and colours, which frames and where, their numbers,
  legend and caption, drawn with matplotlib;
- ``picture``: ``Recipe.plot()``; ``raster``: the frames as images, which ``animation`` (``Recipe.animate()``)
  and ``html`` (``Recipe.to_html()``) encode;
- ``kernel_choice``: ``native_backend(...)``, which kernel ``aten.convolution_backward`` dispatches to.

The views are functions of the recipe's data (its spec, its plans, the scene of each computation) and never
import ``recipe``; Recipe's methods call them (imported when called), so the imports go one way: no cycle.

``convgrad.explain`` is this package, and calling it calls ``explain`` (see ``_CallableModule``).
"""

from __future__ import annotations

import sys
import types
from typing import Any

from convgrad.explain.kernel_choice import NativeChoice, native_backend
from convgrad.explain.recipe import Leftover, Recipe, RecipeStep, explain

__all__ = ["Leftover", "NativeChoice", "Recipe", "RecipeStep", "explain", "native_backend"]


class _CallableModule(types.ModuleType):
    """Importing this package binds it to ``convgrad.explain``, shadowing the lazily exported function of the
    same name; calling the package calls the function, so ``convgrad.explain(...)`` works in any import order."""

    def __call__(self, *args: Any, **kwargs: Any) -> Recipe:
        return explain(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
