"""convgrad: the backward pass of convolution, explicit, correct and fast.

Torch-dependent names load lazily (PEP 562), so ``convgrad.spec`` and ``convgrad.numpy``
import without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY: dict[str, str] = {
    **dict.fromkeys(
        ["conv_backward", "conv_input_grad", "conv_weight_grad", "conv_transpose_input_grad",
         "conv_transpose_weight_grad", "conv_bias_grad", "conv1d_input", "conv2d_input", "conv3d_input",
         "conv1d_weight", "conv2d_weight", "conv3d_weight"],
        "convgrad.functional",
    ),
    **dict.fromkeys(
        ["ConvFunction", "conv", "conv_transpose", "conv1d", "conv2d", "conv3d", "conv_transpose1d",
         "conv_transpose2d", "conv_transpose3d", "no_weight_gradients"],
        "convgrad.autograd",
    ),
    **dict.fromkeys(["patch", "unpatch", "report"], "convgrad.nn"),
    **dict.fromkeys(["per_sample_weight_grad", "per_sample_bias_grad", "per_sample_grad_norms", "PerSampleGrads"],
                    "convgrad.per_sample"),
    **dict.fromkeys(["explain", "native_backend", "Recipe", "NativeChoice"], "convgrad.explain"),
    "ConvSpec": "convgrad.spec",
}
_SUBMODULES = {"nn", "backends", "spec", "functional", "autograd", "numpy", "per_sample", "explain"}

__all__ = sorted([*_LAZY, "backends", "nn", "__version__"])


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"convgrad.{name}")
    else:
        raise AttributeError(f"module 'convgrad' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
