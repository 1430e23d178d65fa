"""PerSampleGrads across processes: which wrappers it accepts, and the one all-reduce of the clipped sums.

DistributedDataParallel all-reduces gradient buckets during the backward, as each becomes ready,
before the model-wide per-sample norm exists; a communication hook sees the same unclipped
buckets. So, as in Opacus's DistributedDPOptimizer, the backward runs under ``no_sync()`` and the
ranks exchange their clipped sums once, after clipping. Wrappers whose hooks or parameters the
per-sample rules cannot follow (DataParallel's replicas, FSDP's shards) are refused.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from convgrad.errors import ConvgradTypeError, ConvgradValueError

__all__ = ["all_reduce_sum", "as_ddp", "check_no_outer_sync", "refuse_wrappers"]


def _ddp_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def as_ddp(model: nn.Module) -> nn.Module | None:
    """The model if it is a DistributedDataParallel, else None."""
    ddp = _ddp_class()
    return model if ddp is not None and isinstance(model, ddp) else None


def refuse_wrappers(fn: str, model: nn.Module) -> None:
    """Raise TypeError for a DataParallel, an FSDP module, a DDP nested inside the model or built with static_graph."""
    ddp = _ddp_class()
    loaded = sys.modules.get("torch.distributed.fsdp")  # not imported: no module can be FSDP (importing costs ~1 s)
    fsdp = tuple(getattr(loaded, k) for k in ("FullyShardedDataParallel", "FSDPModule") if hasattr(loaded, k))
    for name, m in model.named_modules():
        what = f"module {name!r}" if name else "the model itself"
        if isinstance(m, nn.DataParallel):
            raise ConvgradTypeError(f"{fn}: {what} is a torch.nn.DataParallel, whose replicas the hooks cannot "
                                    f"follow; use DistributedDataParallel (PerSampleGrads(ddp_model))")
        if ddp is not None and isinstance(m, ddp) and m is not model:
            raise ConvgradTypeError(f"{fn}: {what} is a DistributedDataParallel inside the model; pass the "
                                    f"DistributedDataParallel module itself: PerSampleGrads(ddp_model)")
        if ddp is not None and m is model and isinstance(m, ddp) and getattr(m, "static_graph", False):
            raise ConvgradTypeError(
                f"{fn}: the DistributedDataParallel was built with static_graph=True, whose reducer "
                f"cannot run a backward under no_sync() (an internal assert in torch), and PerSampleGrads "
                f"needs no_sync() to clip before the all-reduce; build it with static_graph=False")
        if isinstance(m, fsdp):
            raise ConvgradTypeError(f"{fn}: {what} ({type(m).__name__}) shards its parameters, which the "
                                    f"per-sample rules cannot see; FSDP is not supported (DistributedDataParallel is)")


def check_no_outer_sync() -> None:
    """Raise ValueError in a forward inside a DDP module that synchronises: its buckets would all-reduce the
    gradients before any clipping (the model given to PerSampleGrads was the DDP's inner module)."""
    active = getattr(_ddp_class(), "_active_ddp_module", None)  # set by DDP for the duration of its forward
    if active is not None and active.require_backward_grad_sync:
        raise ConvgradValueError("PerSampleGrads: the forward runs inside a DistributedDataParallel module that "
                                 "all-reduces gradients during the backward, before they can be clipped per sample; "
                                 "pass the DistributedDataParallel module itself: PerSampleGrads(ddp_model)")


def all_reduce_sum(tensors: list[torch.Tensor], group: object) -> None:
    """Sum the tensors over the process group, in place in the list: one all-reduce per (dtype, device)."""
    import torch.distributed as dist

    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, t in enumerate(tensors):
        kinds.setdefault((t.dtype, t.device), []).append(i)
    for idx in kinds.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])  # (Σ numel,)
        dist.all_reduce(flat, group=group)  # type: ignore[arg-type]
        for i, chunk in zip(idx, flat.split([tensors[i].numel() for i in idx]), strict=True):
            tensors[i] = chunk.view_as(tensors[i])
