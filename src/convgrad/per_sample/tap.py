"""The pieces of one PerSampleGrads backward: the tap on a module's output, what a module leaves, and the batch guard.

``Tap`` is the identity that PerSampleGrads (``convgrad.per_sample.model``) puts on the output of every supported
module call; its backward hands grad_output and the saved input to the context. ``Record`` is what one module
leaves in a norms_only backward. ``BatchGuard`` keeps every per-sample result of a context to one batch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from convgrad.errors import ConvgradValueError
from convgrad.per_sample.rules import Grads, Layer

__all__ = ["BatchGuard", "Record", "Tap"]


class Tap(torch.autograd.Function):
    """Identity on a module's output; its backward runs PerSampleGrads on grad_output (see ``model``'s doc)."""

    @staticmethod
    def forward(ctx: Any, callback: Any, input: torch.Tensor, output: torch.Tensor,
                *params: torch.Tensor) -> torch.Tensor:
        # saved, not kept on ctx: autograd frees it once this node has run (unless retain_graph), as it frees the
        # module's own saved input; an attribute would keep every layer's input alive to the end of the backward.
        # Saving also makes an in-place change of the input after the forward an error instead of a wrong gradient
        ctx.callback = callback
        ctx.save_for_backward(input)
        if output._base is not None:  # a view cannot be marked dirty
            return output.clone()
        ctx.mark_dirty(output)  # an in-place identity: later in-place ops on the output stay legal
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("PerSampleGrads: backward with create_graph=True is not supported; per-sample "
                               "gradients are not differentiable (run it outside the `with` block)")
        (input,) = ctx.saved_tensors
        return (None, None, grad_output, *ctx.callback(input, grad_output))


@dataclass
class Record:
    """What one module left in this backward: a squared norm and either the gradients or the means to them."""

    sq: torch.Tensor | None = None  # (N,), norms_only
    grads: Grads | None = None  # materialised per-sample gradients, norms_only
    layer: Layer | None = None  # kept instead of gradients when that is smaller
    calls: int = 0


class BatchGuard:
    """Refuses per-sample results of two batches in one context (see ``check_call`` and ``check_size``).

    Args:
        names: the qualified name of every module, for the messages.
    """

    def __init__(self, names: dict[nn.Module, str]) -> None:
        self._names = names
        self.clear()

    def clear(self) -> None:
        """Forget the batch: the next backward starts a new one."""
        self._batch: tuple[int, nn.Module] | None = None  # the first module's batch size, and that module
        self._seen: set[int] = set()  # the calls whose backward has run since clear()
        self._tasks: dict[int, bool] = {}  # autograd graph task id -> still running, for the backwards accepted

    def _who(self, module: nn.Module) -> str:
        return f"module {self._names[module]!r} ({type(module).__name__})"

    def check_call(self, module: nn.Module, call: int) -> None:
        """Refuse a backward that would merge a second batch into this context's per-sample results.

        The rows of .grad_sample and of the norms are samples; two calls add into the same rows only when they
        are the same samples: calls back-propagated in one backward (a module called twice in a forward, two
        forwards in one loss), or a call seen again (a second backward through a retained graph). A later
        backward through calls not seen yet is another batch. Autograd numbers its graph tasks in order, so a
        task is part of an accepted backward if it is one, runs inside one that is still running (a reentrant
        checkpoint's recomputation), or started before one (the backward that a checkpoint's task ran inside)."""
        task = torch._C._current_graph_task_id()  # the running backward, as torch.utils.checkpoint reads it
        if task in self._tasks:
            pass
        elif not self._tasks or call in self._seen or any(self._tasks.values()) or task < max(self._tasks):
            self._tasks[task] = True
            torch.autograd.Variable._execution_engine.queue_callback(  # type: ignore[attr-defined]
                functools.partial(self._tasks.__setitem__, task, False))  # when this backward ends
        else:
            raise ConvgradValueError(
                f"PerSampleGrads: {self._who(module)} received "
                f"a second backward through a forward that the first backward did not reach: this "
                f"context already holds per-sample results of one batch, and another batch's samples "
                f"would be merged into them row by row. Use one context per micro-batch "
                f"(clip_and_accumulate adds their clipped sums to .grad), or call "
                f"clip_and_accumulate and then clear() before the next micro-batch's backward")
        self._seen.add(call)

    def check_size(self, module: nn.Module, n: int) -> None:
        """Every supported module must see the same samples along dim 0: per-sample results of different batch
        sizes cannot be added (they would broadcast silently)."""
        if self._batch is None:
            self._batch = (n, module)
        elif n != self._batch[0]:
            first = self._batch[1]
            other = "another call of it" if first is module else self._who(first)
            raise ConvgradValueError(
                f"PerSampleGrads: {self._who(module)} saw a batch "
                f"of {n} samples along dim 0, but {other} saw {self._batch[0]}; every supported module "
                f"must be called on the whole batch, batch first (not on a part of it, nor with the "
                f"batch folded into another dim)")
