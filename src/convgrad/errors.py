"""The errors a user can cause, as types: catch them by class, never by their text.

Every error convgrad raises for a bad argument, a refused dtype or device, or a formulation that cannot serve a
layer is a ``ConvgradError``. Each also subclasses the built-in the library raised before (``ValueError`` or
``TypeError``), so an existing ``except ValueError`` keeps working. Anything else that escapes the library (a
``RuntimeError`` from a kernel, an ``AssertionError``) is a bug: the command line prints its traceback.

A refusal carries its fields (``MethodRefused.method``, ``.reason``) as einops's ``EinopsError`` carries its
pattern: a caller that rewords it reads the fields instead of splitting the message.

Examples:
    >>> from convgrad.errors import ConvgradError, MethodRefused
    >>> err = MethodRefused("plan_weight_grad", "blocks", "needs stride 1 in every dim", "conv2d 3x3 /2")
    >>> str(err)
    "plan_weight_grad: method='blocks' needs stride 1 in every dim; conv2d 3x3 /2"
    >>> isinstance(err, ValueError) and isinstance(err, ConvgradError), err.reason
    (True, 'needs stride 1 in every dim')
"""

from __future__ import annotations

__all__ = ["ConvgradError", "ConvgradTypeError", "ConvgradValueError", "MethodRefused"]


class ConvgradError(Exception):
    """Base of every error a user can cause (bad arguments, unsupported dtypes or devices, refused methods)."""


class ConvgradValueError(ConvgradError, ValueError):
    """A value out of range or inconsistent with the others; the message names the function, parameter and values."""


class ConvgradTypeError(ConvgradError, TypeError):
    """An argument of the wrong type or dtype; the message names the function, parameter and type."""


class MethodRefused(ConvgradValueError):
    """A formulation (``method``) that cannot serve this layer, and why.

    Args:
        fn: the function that refused (``plan_weight_grad``).
        method: the formulation asked for (``"blocks"``).
        reason: why, starting with a verb (``"needs stride 1 in every dim"``).
        layer: the layer in words (``ConvSpec.describe()``); "" leaves it out of the message.
        param: the parameter that named the method (``"input_method"`` in ``explain``).
    """

    def __init__(self, fn: str, method: str, reason: str, layer: str = "", param: str = "method") -> None:
        self.fn, self.method, self.reason, self.layer, self.param = fn, method, reason, layer, param
        super().__init__(f"{fn}: {param}={method!r} {reason}{f'; {layer}' if layer else ''}")

    def __reduce__(self) -> tuple[type[MethodRefused], tuple[str, str, str, str, str]]:
        return type(self), (self.fn, self.method, self.reason, self.layer, self.param)  # pickles (DDP, workers)
