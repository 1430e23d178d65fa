"""The fwdconv backend: every gradient written with forward convolutions only (the seeds' method).

Contractions, per group (x: big side, y: small side, T: kernel taps; docs/derivation.md):
    grad of x   [N, C_y/g, zero-inserted y] * flip(w)^T [C_x/g, C_y/g, T]  -> [N, C_x/g, i]   grad_input.py
    grad of y   [N, C_x/g, x] * w [C_y/g, C_x/g, T]                        -> [N, C_y/g, o]   grad_input.py
    grad of w   [C_x/g, N, x] * y^T [C_y/g, N, o]                          -> [C_x/g, C_y/g, T] grad_weight.py
Faster forms of the same sums are chosen per layer and per gradient by rules from measurements, each next to
its builders: polyphase and sub-pixel grad of x, 1x1 convs as matmuls (grad_input.py); grad of w with the batch
folded into the groups, the taps folded into the batch, or the dilation blocks or stride phases folded into
channels (grad_weight.py).

Work happens in two steps. ``plan_input_grad(spec)`` / ``plan_weight_grad(spec)`` turn a ConvSpec into a
``Plan`` (plan.py): a short list of plain steps (steps.py) and one contraction (contractions.py) that depends
on shapes only. ``execute(plan, data, kernel)`` runs it on tensors. ``convgrad.explain`` renders the very same
Plan objects, each step through its own ``describe``, ``label``, ``code`` and geometry (geometry.py), so what
is explained is what runs. Every step is a differentiable torch op, so gradients of any order come from autograd.

The forward (forward.py), which auto races against native's where ``worth_padding`` admits it: torch's own
convolution on the input padded here, with padding 0 (on the CPU, oneDNN's jit kernels refuse large paddings).
"""

from __future__ import annotations

import torch

from convgrad.backends import Backend, register
from convgrad.backends.fwdconv.contractions import Conv, MatMul, PhaseConvs
from convgrad.backends.fwdconv.forward import padded_forward, worth_padding
from convgrad.backends.fwdconv.grad_input import INPUT_METHODS, plan_forward, plan_input_grad
from convgrad.backends.fwdconv.grad_weight import (
    WEIGHT_METHODS,
    im2col_weight_method,
    plan_per_sample_weight_grad,
    plan_weight_grad,
)
from convgrad.backends.fwdconv.plan import Contraction, Plan, Step, execute
from convgrad.backends.fwdconv.steps import (
    BatchFold,
    Flip,
    Pad,
    SwapBatchChannels,
    SwapGroupChannels,
    ZeroInsert,
    pad_or_fold,
)
from convgrad.backends.planning import planned
from convgrad.spec import ConvSpec

__all__ = ["INPUT_METHODS", "WEIGHT_METHODS", "BatchFold", "Contraction", "Conv", "Flip", "FwdConvBackend", "MatMul",
           "Pad", "PhaseConvs", "Plan", "Step", "SwapBatchChannels", "SwapGroupChannels", "ZeroInsert", "execute",
           "pad_or_fold", "padded_forward", "plan_forward", "plan_input_grad", "plan_per_sample_weight_grad",
           "plan_weight_grad", "worth_padding"]


@register
class FwdConvBackend(Backend):
    """Forward convolutions, pads, flips and reshapes only; never a convolution_backward."""

    name = "fwdconv"
    supports_complex = True
    bench_by_default = True

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        # torch's complex convention: the gradient pairs grad_output with conj(weight) (a no-op for real dtypes)
        return execute(planned(plan_input_grad, spec), grad_output, weight.conj())

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        input = input.conj()  # torch's complex convention, as in input_grad
        x, y = (grad_output, input) if spec.transposed else (input, grad_output)
        return execute(planned(plan_weight_grad, spec, im2col_weight_method(spec, grad_output)), x, y)

    @staticmethod
    def can_serve_forward(spec: ConvSpec, like: torch.Tensor) -> bool:
        """auto's rule for the forward (the gradients are raced everywhere): ``worth_padding``."""
        return worth_padding(spec, like)

    def forward(self, spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The convolution itself (no bias) on the input padded explicitly: ``padded_forward``; auto's candidate.
        An explicit ``backend="fwdconv"`` keeps native's forward (only its gradients are fwdconv's)."""
        return padded_forward(spec, input, weight)
