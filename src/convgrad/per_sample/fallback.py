"""Per-sample gradients from a module's own forward, one sample at a time: where no layer rule reaches a parameter.

A parameter that meets the samples in an operation no rule covers (a layer-scale ``x * gamma``, ``x + pos_embed``,
a custom contraction) gets its per-sample gradients from the forward of the innermost module that holds it: the
forward is run again on each sample alone (a batch of one) under ``torch.func.vmap``, and the vector-Jacobian
product of that run with the sample's own grad_output gives the sample's gradient. This is Opacus's functorch
fallback and torch.func's per-sample recipe; it is exact wherever the module treats its samples independently
(``convgrad.per_sample.capture`` refuses what it can see does not: batch statistics, random numbers).

Contraction, per sample n and module m with parameters θ:  g[n] = (∂ m(x[n:n+1]; θ) / ∂θ)ᵀ · gy[n:n+1]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from convgrad.per_sample.operands import Sources

__all__ = ["Frame", "rerun"]


@dataclass
class Frame:
    """One running forward of a module: its call, and what the capture found in it."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: list[tuple[torch.Tensor, int]]  # the tensor arguments' versions when the forward began
    rerun: Sources = frozenset()  # parameters whose per-sample gradients come from rerunning this forward
    ops: set[str] = field(default_factory=set)  # the operations where they met the samples
    random: set[str] = field(default_factory=set)  # random operations in this forward

    def refusal(self, output: Any) -> str | None:
        """Why this forward cannot be rerun per sample to the same result, or None."""
        if self.random:
            return (f"its forward draws random numbers ({', '.join(sorted(self.random))}) and a rerun would draw "
                    f"others; put its dropout in eval mode (or p=0)")
        if not isinstance(output, torch.Tensor):
            return f"it returns {type(output).__name__}, not one tensor"
        if any(t._version != v for t, v in self.versions):
            return "it changes its input in place, which a rerun would not see as it was"
        return None


def rerun(module: nn.Module, params: dict[str, nn.Parameter], args: tuple[Any, ...], kwargs: dict[str, Any],
          samples: dict[int | str, torch.Tensor], grad_output: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """The per-sample gradients of some of a module's parameters by running its forward on each sample alone.

    Args:
        module: the module, called as it was in the forward.
        params: {name in the module (``functional_call``'s keys): parameter} to differentiate.
        args, kwargs: the call's arguments; the ones that carry the samples are replaced by ``samples``.
        samples: {position in args, or keyword: tensor (N, ...)} the arguments that carry the samples, as saved.
        grad_output: ``(N, ...)``, the gradient of the module's output.
        scale: N for a mean loss, 1 for a sum (each sample's own loss).

    Returns:
        {name: (N, *param.shape)}, in the parameters' dtypes.
    """
    n = grad_output.shape[0]
    if n == 0:
        return {k: p.new_zeros(0, *p.shape) for k, p in params.items()}
    primals = {k: p.detach() for k, p in params.items()}
    keys = list(samples)

    def one(rows: tuple[torch.Tensor, ...], gy: torch.Tensor) -> dict[str, torch.Tensor]:
        call_args, call_kwargs = list(args), dict(kwargs)
        for key, row in zip(keys, rows):  # each a batch of one sample
            if isinstance(key, int):
                call_args[key] = row
            else:
                call_kwargs[key] = row

        def forward(p: dict[str, torch.Tensor]) -> torch.Tensor:
            return torch.func.functional_call(module, p, tuple(call_args), call_kwargs)  # type: ignore[no-any-return]

        pull = torch.func.vjp(forward, primals)[1]  # (output, vjp_fn)
        (grads,) = pull(gy)
        return grads  # type: ignore[no-any-return]

    rows = tuple(samples[k].detach().unsqueeze(1) for k in keys)  # (N, 1, ...): each sample a batch of one
    with torch.enable_grad():
        out = torch.func.vmap(one)(rows, grad_output.detach().unsqueeze(1))  # {name: (N, *param.shape)}
    return {k: g.mul_(scale) if scale != 1 else g for k, g in out.items()}
