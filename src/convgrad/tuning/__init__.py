"""The one home of convgrad's measured choices: the tuner, the store of its choices, the mode they share.

* ``tuner``: one tuning (prune by cost model, screen on a slice, settle on the calls that follow) of any set of
  options, each a callable ``run(n)`` on the first ``n`` samples; ``settle``: its last steps, the comparison on
  the calls that follow (``Exploration``) and the pick;
* ``store``: the choices in memory and in the cache file (``CONVGRAD_AUTOTUNE_CACHE``), watched for drift;
* ``modes``: "tune" or "fixed" (``CONVGRAD_AUTOTUNE``), auto's forward "tune" or "native"
  (``CONVGRAD_AUTOTUNE_FORWARD``), batch buckets, which tensors can be timed.

Its users, "auto" (``convgrad.backends.auto``, which backend computes a gradient) and the per-sample methods
(``convgrad.per_sample.tuning``), bring their options and keys and use the public names below; this package
knows nothing of backends or methods (it sits below both).
"""

from __future__ import annotations

from convgrad.tuning.modes import (
    FORWARD_MODES,
    MODES,
    batch_bucket,
    bucketed,
    fixed,
    forward_fixed,
    get_forward_mode,
    get_mode,
    set_forward_mode,
    set_mode,
    threads,
    tunable,
    tuning_mode,
)
from convgrad.tuning.store import Store, cache_path, device_name, reset_all
from convgrad.tuning.tuner import (
    PREFER_NATIVE,
    SCREEN_DROP,
    SPLIT_MARGIN,
    Choice,
    Result,
    Run,
    decide,
    screen,
    screen_batch,
    tune,
)

__all__ = [
    "FORWARD_MODES",
    "MODES",
    "PREFER_NATIVE",
    "SCREEN_DROP",
    "SPLIT_MARGIN",
    "Choice",
    "Result",
    "Run",
    "Store",
    "batch_bucket",
    "bucketed",
    "cache_path",
    "clear",
    "decide",
    "device_name",
    "fixed",
    "forward_fixed",
    "get_forward_mode",
    "get_mode",
    "screen",
    "screen_batch",
    "set_forward_mode",
    "set_mode",
    "threads",
    "tunable",
    "tune",
    "tuning_mode",
]


def clear() -> None:
    """Forget every measured choice held in memory, auto's and the per-sample methods' (the cache file is left
    alone; its entries are read again on next use)."""
    reset_all()
