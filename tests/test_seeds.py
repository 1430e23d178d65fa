"""The three seed questions (../shared/seeds) as named regression tests, run through convgrad."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import convgrad as cg
from convgrad.backends.fwdconv import Flip, SwapGroupChannels, ZeroInsert, execute, plan_input_grad


def _torch_grads(x: torch.Tensor, w: torch.Tensor, grad: torch.Tensor, **kw: int) -> tuple[torch.Tensor, ...]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.conv2d(x, w, **kw).backward(grad)
    return x.grad, w.grad


@pytest.mark.parametrize("name,size,kw", [("simple", 4, {}), ("padded", 4, {"padding": 1}),
                                          ("strided", 5, {"stride": 2})])
def test_seed_backward_with_forward_functions(name: str, size: int, kw: dict) -> None:
    """convolutionbwd.py: simple, padded and strided, all gradients from forward convs only."""
    torch.manual_seed(0)
    x, w = torch.randn(1, 1, size, size), torch.randn(1, 1, 3, 3)
    out = {"simple": 2, "padded": 4, "strided": 2}[name]
    grad = torch.ones(1, 1, out, out)
    gx, gw = _torch_grads(x, w, grad, **kw)
    gi, gwt, _ = cg.conv_backward(grad, x, w, None, backend="fwdconv", **kw)
    torch.testing.assert_close(gi, gx)
    torch.testing.assert_close(gwt, gw)


def test_seed_strided_plan_is_the_seeds_recipe() -> None:
    """The strided seed: zero-insert 2x2 -> 3x3, pad by 2 (d(k-1) - p) on each side, flipped kernel.

    The rules pick sub-pixel for this spec, so the seed's formulation is forced; its result is checked too."""
    spec = cg.ConvSpec.from_shapes((1, 1, 5, 5), (1, 1, 3, 3), stride=2)
    plan = plan_input_grad(spec, "zero_insert")
    assert plan.method == "zero_insert"
    assert [type(s) for s in plan.data_steps] == [ZeroInsert] and plan.data_steps[0].shape == (1, 1, 3, 3)
    assert plan.conv.padding == (2, 2) and plan.conv.stride == (1, 1)  # the pad of 2 lies in the conv: (3+4-3)+1 = 5
    assert [type(s) for s in plan.kernel_steps] == [Flip, SwapGroupChannels] and plan.post_steps == ()
    torch.manual_seed(0)
    w, grad = torch.randn(1, 1, 3, 3), torch.randn(1, 1, 2, 2)
    gx, _ = _torch_grads(torch.randn(1, 1, 5, 5), w, grad, stride=2)
    torch.testing.assert_close(execute(plan, grad, w), gx)


class GradBatchConv2dFunction(torch.autograd.Function):
    """The second seed's Function, written with convgrad's torch.nn.grad-compatible helpers."""

    @staticmethod
    def forward(ctx, input, weight, bias, stride, padding, dilation, groups):  # type: ignore[no-untyped-def]
        ctx.save_for_backward(input, weight)
        ctx.conf = (stride, padding, dilation, groups)
        ctx.has_bias = bias is not None
        return F.conv2d(input, weight, bias, stride, padding, dilation, groups)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[no-untyped-def]
        input, weight = ctx.saved_tensors
        gi = cg.conv2d_input(input.shape, weight, grad_output, *ctx.conf) if ctx.needs_input_grad[0] else None
        gw = cg.conv2d_weight(input, weight.shape, grad_output, *ctx.conf) if ctx.needs_input_grad[1] else None
        gb = cg.conv_bias_grad(grad_output) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gi, gw, gb, None, None, None, None


@pytest.mark.parametrize("groups,stride,dilation", [(2, 1, 1), (2, 2, 1), (4, 2, 2)])
def test_seed_manual_backward_with_groups_passes_gradcheck(groups: int, stride: int, dilation: int) -> None:
    """The seed failed gradcheck once groups > 1; through convgrad it passes, for strides and dilation too."""
    torch.manual_seed(0)
    x = torch.randn(1, groups * 2, 7, 7, dtype=torch.double, requires_grad=True)
    w = torch.randn(groups * 1, 2, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(groups, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(GradBatchConv2dFunction.apply, (x, w, b, stride, 1, dilation, groups),
                                    eps=1e-6, atol=1e-4)


def test_seed_native_backward_called_directly() -> None:
    """The first seed: call the native convolution backward yourself (backend='native')."""
    torch.manual_seed(0)
    x, w = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3)
    grad = torch.randn(2, 6, 4, 4)
    gi, gw, gb = cg.conv_backward(grad, x, w, [6], stride=2, groups=2, backend="native")
    ref = torch.ops.aten.convolution_backward(grad, x, w, [6], [2, 2], [0, 0], [1, 1], False, [0, 0], 2,
                                              [True, True, True])
    for a, b in zip((gi, gw, gb), ref):
        torch.testing.assert_close(a, b)
