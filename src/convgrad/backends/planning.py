"""Cached plans under torch.compile: the one way a backend calls its ``functools.lru_cache``-d planner.

A planner is pure (a frozen ``ConvSpec`` in, a frozen plan out), so a backend caches it; while torch.compile
traces, the call goes to the uncached function instead: Dynamo traces through the cache anyway, and warns about it
("Silent incorrectness is only a potential risk"), pointing into convgrad.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

if TYPE_CHECKING:
    from convgrad.spec import ConvSpec

__all__ = ["planned"]

P = TypeVar("P")


def planned(planner: Callable[..., P], spec: ConvSpec, *args: str | None) -> P:
    """``planner(spec, *args)`` through its lru_cache; while torch.compile traces, the uncached function.

    Args:
        planner: a function wrapped by ``functools.lru_cache`` (it has ``__wrapped__``).
        spec: the convolution.
        args: the planner's further arguments (a method or gradient name, or None).

    Returns:
        The planner's plan: the cached object outside torch.compile, a fresh one while it traces.

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((1, 2, 9), (2, 2, 5))
        >>> planned(plan, spec, "output") is plan(spec, "output")
        True
    """
    if torch.compiler.is_compiling():
        return planner.__wrapped__(spec, *args)  # type: ignore[attr-defined, no-any-return]
    return planner(spec, *args)
