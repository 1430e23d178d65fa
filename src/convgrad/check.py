"""Old import path of ``convgrad.cli.check``: the command moved into ``convgrad.cli``; this is the same module."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("convgrad.cli.check")
