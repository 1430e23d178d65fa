"""The mode every measured choice shares ("tune" or "fixed"), and what a choice is keyed by besides its layer.

"auto" (``convgrad.backends.auto``) and the per-sample methods (``convgrad.per_sample.tuning``) read the same
mode, bucket batches the same way and refuse to time the same tensors, so that one switch
(``CONVGRAD_AUTOTUNE=fixed``) makes both deterministic. A second switch, the forward mode
(``CONVGRAD_AUTOTUNE_FORWARD=native``), keeps auto's forward torch's own convolution while the gradients are still
tuned.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from convgrad.errors import ConvgradValueError
from convgrad.tensor_ops import plain

if TYPE_CHECKING:  # a spec is only passed through: tuning sits beside spec, not above it
    from convgrad.spec import ConvSpec

__all__ = ["FORWARD_MODES", "MODES", "batch_bucket", "bucketed", "bump", "fixed", "forward_fixed", "generation",
           "get_forward_mode", "get_mode", "set_forward_mode", "set_mode", "threads", "tunable", "tuning_mode"]

MODES = ("tune", "fixed")
FORWARD_MODES = ("tune", "native")
_mode: str | None = None  # None: not read from the environment yet
_forward_mode: str | None = None  # None: not read from CONVGRAD_AUTOTUNE_FORWARD yet
# bumped by every setting of the mode and every change of a measured choice (``bump``): a per-call memo of what
# they decide keys on this one int (read as ``modes.generation``) instead of calling in for the mode and the choices
generation = 0


def bump() -> None:
    """Mark every memo of the mode or of a measured choice stale (``generation`` moves)."""
    global generation
    generation += 1


def set_mode(mode: str) -> str:
    """Switch every measured choice between ``"tune"`` (time candidates on first use) and ``"fixed"`` (no timing:
    native for "auto", the cost model for the per-sample methods).

    Args:
        mode: ``"tune"`` or ``"fixed"``.

    Returns:
        The previous mode.

    Raises:
        ValueError: an unknown mode.

    Examples:
        >>> from convgrad.backends import auto
        >>> previous = auto.set_mode("fixed")
        >>> auto.get_mode()
        'fixed'
        >>> _ = auto.set_mode(previous)
    """
    global _mode
    if mode not in MODES:
        raise ConvgradValueError(f"set_mode: mode={mode!r} must be one of {MODES}")
    previous, _mode = get_mode(), mode
    bump()
    return previous


def get_mode() -> str:
    """The current mode; on first use read from ``CONVGRAD_AUTOTUNE`` (default ``"tune"``)."""
    global _mode
    if _mode is None:
        env = os.environ.get("CONVGRAD_AUTOTUNE", "tune").strip().lower() or "tune"
        if env not in MODES:
            raise ConvgradValueError(f"convgrad: CONVGRAD_AUTOTUNE={env!r} must be one of {MODES}")
        _mode = env
        bump()
    return _mode


def fixed() -> bool:
    """Whether the mode is "fixed" (every call of every layer asks: one global read once the mode is known)."""
    return _mode == "fixed" or (_mode is None and get_mode() == "fixed")


def set_forward_mode(mode: str) -> str:
    """Choose what "auto" runs for the convolution itself, the gradients staying tuned (``set_mode``).

    ``"tune"`` (default) races the backends that have a forward of their own against torch's: fft's (the
    convolution theorem) on large kernels, fwdconv's on an input padded beforehand. fft's error is normwise: a
    large input value's rounding error spreads over every output, so a causal conv's early outputs move with a
    later spike (docs/numerics.md, "The forward of auto"). ``"native"`` always runs torch's own convolution, whose
    every output is the sum of its own window's products (a causal conv's output never sees a later input), while
    the backward still runs through the fastest backend. ``CONVGRAD_AUTOTUNE_FORWARD`` sets it at the first use;
    in the "fixed" mode the forward is native anyway.

    Args:
        mode: ``"tune"`` or ``"native"``.

    Returns:
        The previous forward mode.

    Raises:
        ValueError: an unknown mode.

    Source: docs/backends.md, "Keep the forward exact".

    Examples:
        >>> from convgrad.backends import auto
        >>> previous = auto.set_forward_mode("native")
        >>> auto.get_forward_mode()
        'native'
        >>> _ = auto.set_forward_mode(previous)
    """
    global _forward_mode
    if mode not in FORWARD_MODES:
        raise ConvgradValueError(f"set_forward_mode: mode={mode!r} must be one of {FORWARD_MODES}")
    previous, _forward_mode = get_forward_mode(), mode
    bump()  # a memo of auto's choices (the native shortcut's) reads the forward's
    return previous


def get_forward_mode() -> str:
    """The current forward mode (``set_forward_mode``); on first use read from ``CONVGRAD_AUTOTUNE_FORWARD``
    (default ``"tune"``)."""
    global _forward_mode
    if _forward_mode is None:
        env = os.environ.get("CONVGRAD_AUTOTUNE_FORWARD", "tune").strip().lower() or "tune"
        if env not in FORWARD_MODES:
            raise ConvgradValueError(f"convgrad: CONVGRAD_AUTOTUNE_FORWARD={env!r} must be one of {FORWARD_MODES}")
        _forward_mode = env
        bump()
    return _forward_mode


def forward_fixed() -> bool:
    """Whether auto's forward is torch's own convolution whatever tuning says: the forward mode "native", or the
    mode "fixed"."""
    return (_forward_mode == "native" or (_forward_mode is None and get_forward_mode() == "native")) or fixed()


@contextlib.contextmanager
def tuning_mode(mode: str) -> Iterator[None]:
    """Run a block in the given mode, then restore the previous one."""
    previous = set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def batch_bucket(batch: int) -> int:
    """The batch size a choice is tuned for: the next power of two (0 stays 0).

    Batches that share a bucket share one tuning. DP-SGD with Poisson sampling (Opacus, our
    examples/dp_sgd_digits.py) draws a new batch size at every step; keyed by the exact size, every
    step would tune again. Within a factor of two the ranking of the candidates hardly moves.

    Args:
        batch: N, the batch size of the configuration (int, >= 0).

    Returns:
        The smallest power of two >= ``batch``; 0 for an empty batch.

    Examples:
        >>> from convgrad.backends import auto
        >>> [auto.batch_bucket(n) for n in (0, 1, 3, 4, 300)]
        [0, 1, 4, 4, 512]
    """
    return 1 << (batch - 1).bit_length() if batch > 0 else 0


@functools.lru_cache(maxsize=1024)
def bucketed(spec: ConvSpec) -> ConvSpec:
    """The spec with its batch bucketed (cached: every call of every layer looks its choice up)."""
    return spec.with_batch(batch_bucket(spec.batch))


def threads(like: torch.Tensor) -> int:
    """The CPU threads a choice on tensors like ``like`` was timed with (0 off the CPU): a key of every choice.

    ``is_cpu``, not ``device.type``: torch builds that string through a C++ stream on every call, several times the
    cost of this whole lookup once its cache effects are counted (every call of every auto layer asks)."""
    return torch.get_num_threads() if like.is_cpu else 0


def tunable(*tensors: torch.Tensor) -> bool:
    """Real tensors only: no tuning while compiling, on meta/fake tensors, subclasses, or under vmap or forward AD."""
    if torch.compiler.is_compiling():
        return False
    return all(plain(t) and not t.is_meta for t in tensors)
