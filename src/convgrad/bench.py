"""Old import path of ``convgrad.cli.bench``: the command moved into ``convgrad.cli``; these are the same modules,
so ``convgrad.bench.layers`` and ``from convgrad.bench.layers import SUITES`` keep working."""

import importlib
import sys

for _name in ("", ".layers", ".timing", ".report"):
    sys.modules[__name__ + _name] = importlib.import_module("convgrad.cli.bench" + _name)
