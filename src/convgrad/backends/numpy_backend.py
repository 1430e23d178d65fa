"""The numpy backend: torch CPU tensors in, ``convgrad.numpy`` computes, tensors out.

Named ``numpy_backend`` so that ``convgrad.numpy``, the NumPy path it calls, has the one module of that name.

Contraction: that of ``convgrad.numpy`` (im2col and one matmul per group). The
tensors are viewed as arrays without a copy (``Tensor.numpy()``) and the results
are wrapped back with ``torch.from_numpy``. NumPy sees no autograd graph, so this
backend is not differentiable: a second derivative through it, a torch.func transform, or
``conv_backward`` on tensors that require grad raise (functional.py, autograd/). CUDA (any
non-CPU) tensors and dtypes other than float32/float64 raise clear errors at the first call.
"""

from __future__ import annotations

import numpy as np
import torch

from convgrad import numpy as cgn
from convgrad.backends import FusedBackend, Grads, register, traceable_names
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec

DTYPES = (torch.float32, torch.float64)


@register
class NumpyBackend(FusedBackend):
    """NumPy's sliding windows and matmul; first derivatives only."""

    name = "numpy"
    differentiable = False
    supports_complex = False

    def check_operand(self, fn: str, name: str, t: torch.Tensor) -> None:
        """CPU tensors of float32 or float64 only (NumPy has no bfloat16, and this path computes in float)."""
        super().check_operand(fn, name, t)
        if t.device.type != "cpu":
            raise ConvgradValueError(f"{fn}: backend='numpy' needs CPU tensors, but {name}.device={t.device}; "
                                     f"move them with .cpu() or use backend='native'")
        if t.dtype not in DTYPES:
            raise ConvgradTypeError(f"{fn}: backend='numpy' supports float32 and float64, but {name}.dtype={t.dtype}; "
                                    f"use one of {traceable_names()}")

    def _array(self, spec: ConvSpec, name: str, t: torch.Tensor | None) -> np.ndarray | None:
        """A CPU float32/float64 tensor as an array sharing its memory; clear errors for anything else."""
        if t is None:
            return None
        self.check_operand(spec.fn, name, t)  # again: the backend may be called directly (bench)
        return t.detach().resolve_conj().resolve_neg().numpy()

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        gy = self._array(spec, "grad_output", grad_output)
        x = self._array(spec, "input", input if need_weight else None)
        w = self._array(spec, "weight", weight if need_input else None)
        gi, gw = cgn.backward(spec, gy, x, w, need_input, need_weight)  # type: ignore[arg-type]
        return (None if gi is None else torch.from_numpy(gi)), (None if gw is None else torch.from_numpy(gw))
