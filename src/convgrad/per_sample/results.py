"""What one PerSampleGrads context keeps of its backward: the per-sample gradients (or, norms_only, what each call
left for its norm and its clip), ``.grad`` as it was before, and how each parameter was reached; the norms and the
clipped sums are computed from these alone, never from another context's state on the parameters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from convgrad.per_sample.methods import sq_norms
from convgrad.per_sample.rules import Layer

__all__ = ["Record", "Results", "add"]


def add(into: dict[int, torch.Tensor], pid: int, g: torch.Tensor) -> None:
    """``into[pid] += g``, out of place (a first gradient is kept as it is)."""
    into[pid] = g if pid not in into else into[pid] + g


@dataclass
class Record:
    """What one tapped call left in a norms_only backward: a squared norm with the means to clip it (``layer``, for
    operands that are parameters themselves), or materialised per-sample gradients by parameter id."""

    params: frozenset[int]
    layer: Layer | None = None
    operands: dict[str, int] = field(default_factory=dict)  # the layer's operand -> its parameter's id
    grads: dict[int, torch.Tensor] | None = None
    sq: torch.Tensor | None = None

    def materialised(self) -> dict[int, torch.Tensor]:
        if self.grads is None:
            self.grads = {self.operands[k]: g for k, g in self.layer.grads().items()}  # type: ignore[union-attr]
        return self.grads


class Results:
    """One context's results (see the module doc).

    Args:
        params: the context's trainable parameters by id.
        norms_only: records (``Record``) instead of per-sample gradients.
        adds: whether the backward adds the sums of the per-sample gradients to ``.grad`` (not under DDP nor
            norms_only), which decides how ``.grad`` is remembered.
    """

    def __init__(self, params: dict[int, nn.Parameter], norms_only: bool, adds: bool) -> None:
        self.params, self.norms_only, self.adds = params, norms_only, adds
        self.samples: dict[int, torch.Tensor] = {}  # full mode: parameter id -> (N, *shape)
        self.records: list[Record] = []  # norms_only
        self.before: dict[int, torch.Tensor | None] = {}  # parameter id -> .grad before this context's backward
        self.how: dict[int, set[str]] = {}  # parameter id -> how its per-sample gradients were computed

    def remember_grads(self, pids: frozenset[int] | set[int]) -> None:
        """Keep .grad as it was before this context's backward, for the clip to add to."""
        for pid in pids:
            if pid not in self.before:
                p = self.params[pid]
                self.before[pid] = None if p.grad is None else p.grad.clone() if self.adds else p.grad

    def add_sample(self, pid: int, g: torch.Tensor) -> None:
        """Add per-sample gradients (N, *shape) of one parameter; ``.grad_sample`` is the same tensor."""
        add(self.samples, pid, g)
        self.params[pid].grad_sample = self.samples[pid]  # type: ignore[attr-defined]

    def add_grads(self, sums: dict[int, torch.Tensor]) -> None:
        """Add to .grad as autograd would (autograd gets none: the layers ran on detached operands)."""
        for pid, g in sums.items():
            p = self.params[pid]
            g = g.to(p.dtype)
            p.grad = g if p.grad is None else p.grad.add_(g)

    def _parts(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], list[Record]]:
        """(squared norms of the records that alone reach their parameters, the per-sample gradients summed per
        parameter of the others, those alone records); full mode: every parameter's own gradients."""
        if not self.norms_only:
            return [], self.samples, []
        count: dict[int, int] = {}
        for r in self.records:
            for pid in r.params:
                count[pid] = count.get(pid, 0) + 1
        alone = [r for r in self.records if all(count[pid] == 1 for pid in r.params)]
        summed: dict[int, torch.Tensor] = {}
        for r in self.records:
            if not any(r is a for a in alone):
                for pid, g in r.materialised().items():
                    add(summed, pid, g)
        sq = [r.sq if r.sq is not None else sum(sq_norms(g) for g in r.materialised().values()) for r in alone]
        return sq, summed, alone  # type: ignore[return-value]

    def sq_norms(self) -> torch.Tensor | None:
        """(N,) squared per-sample norms over every parameter reached, or None before any backward."""
        sq, summed, _ = self._parts()
        parts = [*sq, *(sq_norms(g) for g in summed.values())]
        if not parts:
            return None
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def clipped(self, factors: torch.Tensor) -> dict[int, torch.Tensor]:
        """{parameter id: Σ_n factors[n]·grad[n]}: one weighted sum of materialised gradients, or one ordinary
        gradient call of a layer on its per-sample-scaled grad_output (``Layer.clipped``)."""
        out: dict[int, torch.Tensor] = {}
        _, summed, alone = self._parts()
        for pid, g in summed.items():
            add(out, pid, torch.tensordot(factors.to(g.dtype), g, dims=1))  # (*param.shape)
        for r in alone:
            if r.grads is None:
                for k, g in r.layer.clipped(factors).items():  # type: ignore[union-attr]
                    add(out, r.operands[k], g)
            else:
                for pid, g in r.grads.items():
                    add(out, pid, torch.tensordot(factors.to(g.dtype), g, dims=1))
        return out
