"""The scopes every convgrad convolution reads, at the bottom of the package so that every layer can read them.

``no_weight_gradients`` is public as ``convgrad.no_weight_gradients`` (re-exported by ``convgrad.autograd``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["no_weight_gradients", "weight_gradients_disabled"]

# open no_weight_gradients scopes: written only there, read elsewhere as scopes.weight_gradients_disabled (a module
# attribute, like the global it was, so Dynamo guards it the same way)
weight_gradients_disabled = 0


@contextlib.contextmanager
def no_weight_gradients() -> Iterator[None]:
    """Skip grad_weight of every convgrad convolution inside the scope (R1 / path-length penalties).

    Like NVIDIA's conv2d_gradfix: inside the scope, weights receive no gradient from
    convgrad convolutions, so only grad_input (and grad_bias) is computed. A scope around the forward or around
    the backward is enough; inside ``PerSampleGrads`` the convolutions' weights get no per-sample gradient either.

    Examples:
        >>> import torch, convgrad as cg
        >>> x = torch.randn(1, 2, 5, 5, requires_grad=True)
        >>> w = torch.randn(3, 2, 3, 3, requires_grad=True)
        >>> with cg.no_weight_gradients():
        ...     gx, = torch.autograd.grad(cg.conv2d(x, w).sum(), [x])
        >>> w.grad is None
        True
    """
    global weight_gradients_disabled
    weight_gradients_disabled += 1
    try:
        yield
    finally:
        weight_gradients_disabled -= 1
