"""The pieces of one PerSampleGrads backward: the tap on a call's output and the batch guard.

``Tap`` is the identity that PerSampleGrads (``convgrad.per_sample.model``) puts on the output of every captured
layer call and every module it reruns per sample; its backward hands grad_output and the saved inputs to the
context. ``BatchGuard`` keeps every per-sample result of a context to one batch.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from convgrad.errors import ConvgradValueError

__all__ = ["BatchGuard", "Tap"]


class Tap(torch.autograd.Function):
    """Identity on a call's output; its backward runs PerSampleGrads on grad_output (see ``model``'s doc).

    ``apply(callback, saved, output, *inputs)``: ``callback(inputs[:saved], grad_output)`` runs in the backward,
    with those inputs as saved tensors. The other inputs (the operands that trainable parameters reach) make the
    output need a gradient where the layer ran on detached operands; they get none from the tap."""

    @staticmethod
    def forward(ctx: Any, callback: Any, saved: int, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        # saved, not kept on ctx: autograd frees them once this node has run (unless retain_graph), as it frees the
        # layer's own saved input; an attribute would keep every layer's input alive to the end of the backward.
        # Saving also makes an in-place change of an input after the forward an error instead of a wrong gradient
        ctx.callback, ctx.inputs = callback, len(inputs)
        ctx.save_for_backward(*inputs[:saved])
        if output._base is not None:  # a view cannot be marked dirty
            return output.clone()
        ctx.mark_dirty(output)  # an in-place identity: later in-place ops on the output stay legal
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        if torch.is_grad_enabled():
            raise RuntimeError("PerSampleGrads: backward with create_graph=True is not supported; per-sample "
                               "gradients are not differentiable (run it outside the `with` block)")
        ctx.callback(ctx.saved_tensors, grad_output)
        return (None, None, grad_output, *(None,) * ctx.inputs)


class BatchGuard:
    """Refuses per-sample results of two batches in one context (see ``check_call`` and ``check_size``).

    Where a call happened is given as words for the messages (``module 'stem.conv' (StdConv2d), conv2d``).
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Forget the batch: the next backward starts a new one."""
        self._batch: tuple[int, str] | None = None  # the first call's batch size, and where it happened
        self._seen: set[int] = set()  # the calls whose backward has run since clear()
        self._tasks: dict[int, bool] = {}  # autograd graph task id -> still running, for the backwards accepted

    def check_call(self, where: str, call: int) -> None:
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
                f"PerSampleGrads: {where} received "
                f"a second backward through a forward that the first backward did not reach: this "
                f"context already holds per-sample results of one batch, and another batch's samples "
                f"would be merged into them row by row. Use one context per micro-batch "
                f"(clip_and_accumulate adds their clipped sums to .grad), or call "
                f"clip_and_accumulate and then clear() before the next micro-batch's backward")
        self._seen.add(call)

    def check_size(self, where: str, n: int) -> None:
        """Every captured call must see the same samples along dim 0: per-sample results of different batch
        sizes cannot be added (they would broadcast silently)."""
        if self._batch is None:
            self._batch = (n, where)
        elif n != self._batch[0]:
            first = self._batch[1]
            other = "another call of it" if first == where else first
            raise ConvgradValueError(
                f"PerSampleGrads: {where} saw a batch "
                f"of {n} samples along dim 0, but {other} saw {self._batch[0]}; every layer a trainable parameter "
                f"reaches must be called on the whole batch, batch first (not on a part of it, nor with the "
                f"batch folded into another dim)")
