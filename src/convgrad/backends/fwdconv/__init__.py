"""The fwdconv backend: every gradient written with forward convolutions only (the seeds' method).

A package (issue 27): ``grad_input`` builds the plans of grad_input and the forward, ``grad_weight`` those of
grad_weight, from the steps of ``plan``, ``steps`` and ``contractions``; ``geometry`` tells explain's pictures
where each step moves the rows. ``from convgrad.backends import fwdconv`` gives the names below.
"""

from __future__ import annotations

from convgrad.backends.fwdconv.grad_input import (
    INPUT_METHODS,
    WEIGHT_METHODS,
    FwdConvBackend,
    plan_forward,
    plan_input_grad,
    plan_weight_grad,
)
from convgrad.backends.fwdconv.plan import (
    Conv,
    Flip,
    Pad,
    Plan,
    Step,
    SwapBatchChannels,
    SwapGroupChannels,
    ZeroInsert,
    execute,
)
from convgrad.backends.fwdconv.steps import Contraction

__all__ = ["INPUT_METHODS", "WEIGHT_METHODS", "Contraction", "Conv", "Flip", "FwdConvBackend", "Pad", "Plan", "Step",
           "SwapBatchChannels", "SwapGroupChannels", "ZeroInsert", "execute", "plan_forward", "plan_input_grad",
           "plan_weight_grad"]
