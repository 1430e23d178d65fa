"""pytest at the repository root: the doctests of convgrad.opacus need Opacus, an optional extra."""

import importlib.util

collect_ignore = [] if importlib.util.find_spec("opacus") else ["src/convgrad/opacus.py"]
collect_ignore.append("tests/stubs")  # the torchvision stand-in of tests/test_timm.py: no tests, nothing to import
