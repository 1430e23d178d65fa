"""The weight and bias operands of a captured layer call, and how their per-sample gradients go back to the
trainable parameters they were computed from.

An operand is a parameter itself, or a transform of parameters computed in the forward (a standardised weight,
``w0 + B @ A``, ``gain * w``). A rule gives the per-sample gradients of the operand; the parameters' are then the
vector-Jacobian products of the transform with each sample's gradient, all samples in one vmapped backward of the
transform's graph (``torch.autograd.grad(..., is_grads_batched=True)``).

Contraction, per sample n and parameter θ behind operand w = T(θ):  g_θ[n] = (∂T/∂θ)ᵀ · g_w[n]
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["Operand", "Sources", "pull_back"]

Sources = frozenset[int]  # ids of the trainable parameters a tensor was computed from


class Operand:
    """A weight or bias operand of a captured call: the tensor the layer read and the parameters behind it.

    Attributes:
        tensor: the operand as the forward computed it (a parameter itself, or a transform of parameters).
        sources: the ids of those parameters.
    """

    __slots__ = ("sources", "tensor")

    def __init__(self, tensor: torch.Tensor, sources: Sources) -> None:
        self.tensor, self.sources = tensor, sources

    def parameter(self, params: dict[int, nn.Parameter]) -> nn.Parameter | None:
        """The parameter this operand is, or None where it was computed from parameters."""
        if len(self.sources) != 1:
            return None
        p = params.get(next(iter(self.sources)))
        return p if self.tensor is p else None


def pull_back(operands: dict[str, Operand], grads: dict[str, torch.Tensor], params: dict[int, nn.Parameter],
              excluded: Sources) -> dict[int, torch.Tensor]:
    """The per-sample gradients of the parameters behind the operands.

    Args:
        operands: {operand name: Operand}.
        grads: {operand name: (N, *operand.shape)}, the rule's per-sample gradients of each.
        params: the trainable parameters by id.
        excluded: parameters whose per-sample gradients come from elsewhere (a rerun), left out.

    Returns:
        {parameter id: (N, *param.shape)}: an operand that is a parameter passes its own on; a computed one's go
        back through its transform (zeros for a parameter the transform does not reach).
    """
    out: dict[int, torch.Tensor] = {}
    outputs: list[torch.Tensor] = []
    cotangents: list[torch.Tensor] = []
    wanted: set[int] = set()
    for k, g in grads.items():
        op = operands[k]
        p = op.parameter(params)
        if p is not None:
            out[id(p)] = g if id(p) not in out else out[id(p)] + g
        else:
            outputs.append(op.tensor)
            cotangents.append(g.to(op.tensor.dtype))
            wanted |= op.sources - excluded
    if not outputs or not wanted:
        return out
    sources = [params[i] for i in sorted(wanted)]
    n = cotangents[0].shape[0]
    if n == 0:
        gs: tuple[torch.Tensor | None, ...] = tuple(p.new_zeros(0, *p.shape) for p in sources)
    else:
        gs = torch.autograd.grad(outputs, sources, cotangents, retain_graph=True, allow_unused=True,
                                 is_grads_batched=True)
    for p, got in zip(sources, gs, strict=True):
        g = torch.zeros(n, *p.shape, dtype=p.dtype, device=p.device) if got is None else got
        out[id(p)] = g if id(p) not in out else out[id(p)] + g
    return out
