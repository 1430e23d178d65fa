"""ExpandedWeights (issue 25, item 5): torch.nn.utils._per_sample_grad.call_for_per_sample_grads and Opacus's
grad_sample_mode="ew" over convgrad modules and patched models. They failed with "Expanded Weights encountered but
cannot handle function is_floating_point" (the tensor check called a method the ExpandedWeight refuses)."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from torch.nn.utils._per_sample_grad import call_for_per_sample_grads

import convgrad as cg
from helpers import TOL

F64 = torch.float64
KW = dict(stride=2, padding=1, groups=2)


def _pair(kind: str, backend: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(a plain torch model, the same model patched) with one conv of this kind."""
    torch.manual_seed(0)
    conv: Any = getattr(torch.nn, kind)
    ref = torch.nn.Sequential(conv(4, 6, 3, **KW), torch.nn.Tanh()).to(F64)
    ours = torch.nn.Sequential(conv(4, 6, 3, **KW), torch.nn.Tanh()).to(F64)
    ours.load_state_dict(ref.state_dict())
    return ref, cg.patch(ours, backend=backend)


def _loop(ref: torch.nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """The per-sample gradients of every parameter by a loop over the samples (sum of squares loss)."""
    rows = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(ref(x[i:i + 1]).square().sum(), list(ref.parameters()))
        rows.append(grads)
    return [torch.stack(g) for g in zip(*rows)]


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("backend", ["fwdconv", "native"])
@pytest.mark.parametrize("kind", ["Conv2d", "ConvTranspose2d"])
def test_call_for_per_sample_grads_over_a_patched_model(kind: str, backend: str, reduction: str) -> None:
    """grad_sample of every parameter equals the per-sample loop (for Conv2d, torch's own ExpandedWeights rule
    gives the same); .grad stays None as with torch; grad_input equals torch's."""
    ref, ours = _pair(kind, backend)
    x = torch.randn(5, 4, 7, 7, dtype=F64, requires_grad=True)
    scale = x.shape[0] if reduction == "mean" else 1  # "mean": the loss is divided by the batch
    out = call_for_per_sample_grads(ours, loss_reduction=reduction)(x)
    (gx,) = torch.autograd.grad(out.square().sum() / scale, [x])
    want = _loop(ref, x.detach())
    for p, w in zip(ours.parameters(), want):
        torch.testing.assert_close(p.grad_sample, w, **TOL[F64])
        assert p.grad is None
    xr = x.detach().requires_grad_()
    torch.testing.assert_close(gx, torch.autograd.grad(ref(xr).square().sum() / scale, [xr])[0], **TOL[F64])
    if kind == "Conv2d":  # torch's own rule on the plain model agrees
        call_for_per_sample_grads(ref, loss_reduction=reduction)(x.detach()).square().sum().div(scale).backward()
        for p, q in zip(ours.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad_sample, q.grad_sample, **TOL[F64])


def test_call_for_per_sample_grads_over_a_drop_in_3d_module() -> None:
    torch.manual_seed(1)
    ref = torch.nn.Conv3d(2, 4, (2, 3, 3), stride=(2, 1, 2), dilation=(1, 2, 1)).to(F64)
    ours = cg.nn.Conv3d(2, 4, (2, 3, 3), stride=(2, 1, 2), dilation=(1, 2, 1), backend="fwdconv").to(F64)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 2, 5, 7, 6, dtype=F64)
    call_for_per_sample_grads(ours)(x).square().sum().backward()
    for p, w in zip(ours.parameters(), _loop(ref, x)):
        torch.testing.assert_close(p.grad_sample, w, **TOL[F64])


def test_expanded_weights_need_a_batched_input() -> None:
    ours = cg.nn.Conv2d(2, 3, 3)
    with pytest.raises(ValueError, match=r"Conv2d: ExpandedWeights needs a batched input"):
        call_for_per_sample_grads(ours, batch_size=1)(torch.randn(2, 6, 6))


@pytest.mark.skipif(importlib.util.find_spec("opacus") is None, reason="needs the opacus extra")
def test_opacus_ew_mode_over_a_patched_model() -> None:
    """Opacus's grad_sample_mode="ew" wrapper: the patched model gives the plain model's grad_sample."""
    from opacus.grad_sample import GradSampleModuleExpandedWeights

    ref, ours = _pair("Conv2d", "fwdconv")
    x = torch.randn(4, 4, 7, 7, dtype=F64)

    got = []
    for model in (ref, ours):
        gsm = GradSampleModuleExpandedWeights(model, batch_first=True, loss_reduction="sum")
        gsm(x).square().sum().backward()
        got.append([p.grad_sample for p in model.parameters()])
    for a, b in zip(*got):
        torch.testing.assert_close(b, a, **TOL[F64])
