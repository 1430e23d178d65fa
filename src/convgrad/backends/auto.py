"""The "auto" backend: the fastest correct choice for each configuration.

Until the autotuner lands it delegates to "native", which is always correct and
is PyTorch's own choice of kernel.
"""

from __future__ import annotations

import torch

from convgrad.backends import Backend, get_backend, register
from convgrad.spec import ConvSpec


@register
class AutoBackend(Backend):
    """Delegates each gradient to the chosen concrete backend."""

    name = "auto"
    supports_complex = True

    def choose(self, spec: ConvSpec, gradient: str, grad_output: torch.Tensor) -> Backend:
        """The backend that computes `gradient` ('grad_input' or 'grad_weight') for this spec."""
        return get_backend("native")

    def backward(self, spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
        gi = self.choose(spec, "grad_input", grad_output).input_grad(spec, weight, grad_output) if need_input else None
        gw = self.choose(spec, "grad_weight", grad_output).weight_grad(spec, input, grad_output) if need_weight else None
        return gi, gw

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self.choose(spec, "grad_input", grad_output).input_grad(spec, weight, grad_output)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self.choose(spec, "grad_weight", grad_output).weight_grad(spec, input, grad_output)
