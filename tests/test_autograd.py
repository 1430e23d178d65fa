"""convgrad's autograd Functions: gradcheck and gradgradcheck with PyTorch OpInfo's flags, Hessian-vector products,
needs_input_grad."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import convgrad as cg
from convgrad.backends import get_backend
from helpers import TOL, grid_backends

BACKENDS = cg.backends()
DIFFERENTIABLE = [b for b in BACKENDS if get_backend(b).differentiable]

# (input shape, weight shape, kwargs) — tiny shapes covering the hard cases in 1d, 2d and 3d
FORWARD = [
    ((2, 4, 6), (6, 2, 3), dict(stride=2, groups=2)),
    ((1, 2, 5, 5), (2, 2, 2, 3), dict(stride=(2, 3), dilation=(2, 1), padding=((1, 0), (0, 2)))),
    ((1, 3, 4, 5), (3, 1, 3, 2), dict(groups=3, padding="same", stride=2)),
    ((1, 2, 3, 3, 3), (2, 1, 2, 2, 2), dict(groups=2, stride=2, padding=1, dilation=(1, 2, 1))),
]
TRANSPOSED = [
    ((1, 4, 3), (4, 3, 3), dict(stride=2, groups=2, output_padding=1)),
    ((1, 2, 2, 2), (2, 1, 3, 2), dict(stride=2, dilation=3, output_padding=(2, 1), padding=((1, 2), (0, 1)))),
    ((1, 2, 2, 2, 2), (2, 1, 2, 2, 2), dict(stride=2, groups=2)),
]


# the strided 3d kernel whose 'phases' weight plan sliced its whole result with t[..., :k] (an alias, which the
# legacy vmap of is_grads_batched cannot batch: "Batching rule not implemented for aten::alias")
PHASES_3D = ((1, 1, 4, 4, 4), (1, 1, 4, 4, 4), dict(stride=(2, 1, 1)))
FORWARD.append(PHASES_3D)

# The flags PyTorch's OpInfo tests (test_ops.py: test_fn_grad, test_forward_mode_AD, test_fn_gradgrad,
# test_fn_fwgrad_bwgrad) set for nn.functional.conv*d, which declare forward AD and fwgrad_bwgrad support.
OPINFO_GRAD = dict(check_batched_grad=True, check_grad_dtypes=True, check_undefined_grad=True, fast_mode=True)
OPINFO_FORWARD_AD = dict(check_forward_ad=True, check_backward_ad=False, check_undefined_grad=True,
                         check_batched_forward_grad=True, check_grad_dtypes=True, fast_mode=True)


def _opinfo_gradchecks(backend: str, f: Callable[..., torch.Tensor], tensors: tuple[torch.Tensor, ...],
                       second_order: str) -> None:
    """gradcheck and forward-AD gradcheck with OpInfo's flags, then the second-order checks: ``"rev"``
    gradgradcheck with batched gradients, ``"extra"`` gradgradcheck on non-contiguous grad_outputs and
    forward-over-reverse (the slow tier).

    backend="numpy" computes outside autograd by design: its first derivatives are checked with every flag that
    needs no transform of its backward, and a batched gradient must be refused with its error (never a wrong
    result)."""
    if not get_backend(backend).differentiable:
        assert torch.autograd.gradcheck(f, tensors, **OPINFO_GRAD | dict(check_batched_grad=False))
        assert torch.autograd.gradcheck(f, tensors, **OPINFO_FORWARD_AD)
        with pytest.raises(ValueError, match=r"backend='numpy' does not support torch\.func transforms"):
            torch.autograd.gradcheck(f, tensors, **OPINFO_GRAD)
        return
    if second_order == "rev":
        assert torch.autograd.gradcheck(f, tensors, **OPINFO_GRAD)
        assert torch.autograd.gradcheck(f, tensors, **OPINFO_FORWARD_AD)
        assert torch.autograd.gradgradcheck(f, tensors, check_batched_grad=True, check_grad_dtypes=True,
                                            fast_mode=True)
        return
    assert torch.autograd.gradgradcheck(f, tensors, gen_non_contig_grad_outputs=True, check_batched_grad=True,
                                        check_grad_dtypes=True, fast_mode=True)
    assert torch.autograd.gradgradcheck(f, tensors, check_fwd_over_rev=True, check_rev_over_rev=False,
                                        check_batched_grad=False, check_undefined_grad=False, check_grad_dtypes=True,
                                        fast_mode=True)


SECOND_ORDER = ["rev", pytest.param("extra", marks=pytest.mark.slow)]


@pytest.mark.parametrize("second_order", SECOND_ORDER)
@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("xs,ws,kw", FORWARD, ids=str)
def test_conv_passes_opinfo_gradchecks(backend: str, xs: tuple, ws: tuple, kw: dict, second_order: str) -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in (xs, ws, (ws[0],)))

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cg.conv(x, w, b, backend=backend, **kw)

    _opinfo_gradchecks(backend, f, (x, w, b), second_order)


@pytest.mark.parametrize("second_order", SECOND_ORDER)
@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("xs,ws,kw", TRANSPOSED, ids=str)
def test_conv_transpose_passes_opinfo_gradchecks(backend: str, xs: tuple, ws: tuple, kw: dict,
                                                 second_order: str) -> None:
    g = torch.Generator().manual_seed(0)
    c_out = ws[1] * kw.get("groups", 1)
    x, w, b = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in (xs, ws, (c_out,)))

    def f(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return cg.conv_transpose(x, w, b, backend=backend, **kw)

    _opinfo_gradchecks(backend, f, (x, w, b), second_order)


def test_batched_grads_through_the_phases_weight_plan() -> None:
    """The issue's reproducer: is_grads_batched through fwdconv's 'phases' plan of a strided 3d kernel."""
    from convgrad.backends.fwdconv import plan_weight_grad
    from convgrad.spec import ConvSpec

    xs, ws, kw = PHASES_3D
    assert plan_weight_grad(ConvSpec.from_shapes(xs, ws, **kw)).method == "phases"
    g = torch.Generator().manual_seed(4)
    x, w = (torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in (xs, ws))
    y = cg.conv3d(x, w, backend="fwdconv", **kw)
    gys = torch.randn(3, *y.shape, generator=g, dtype=torch.float64)
    ours = torch.autograd.grad(y, (x, w), gys, is_grads_batched=True)
    ref = F.conv3d(x, w, **kw)
    for a, r in zip(ours, torch.autograd.grad(ref, (x, w), gys, is_grads_batched=True)):
        torch.testing.assert_close(a, r, **TOL[torch.float64])


@pytest.mark.parametrize("backend", grid_backends(DIFFERENTIABLE))
def test_third_derivative_matches_torch(backend: str) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 6, 6, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64, requires_grad=True)

    def third(conv) -> torch.Tensor:  # d/dw of d/dx of d/dx of sum(conv(x, w)^3)
        y = (conv(x, w) ** 3).sum()
        (gx,) = torch.autograd.grad(y, x, create_graph=True)
        (gxx,) = torch.autograd.grad(gx.pow(2).sum(), x, create_graph=True)
        (gw,) = torch.autograd.grad(gxx.sum(), w)
        return gw

    ours = third(lambda a, b: cg.conv2d(a, b, stride=2, padding=1, backend=backend))
    ref = third(lambda a, b: F.conv2d(a, b, stride=2, padding=1))
    torch.testing.assert_close(ours, ref, **TOL[torch.float64])


@pytest.mark.parametrize("backend", grid_backends(DIFFERENTIABLE))
def test_hvp_through_same_convs_matches_explicit_padding(backend: str) -> None:
    """Hessian-vector product through a stride-1 'same' conv (even kernel) then a stride-2 'same' conv."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 9, 8, generator=g, dtype=torch.float64)
    w1 = torch.randn(4, 3, 4, 2, generator=g, dtype=torch.float64)
    w2 = torch.randn(5, 4, 3, 3, generator=g, dtype=torch.float64)
    v = tuple(torch.randn_like(t) for t in (w1, w2))

    def ours(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(cg.conv2d(x, a, padding="same", backend=backend))
        return cg.conv2d(h, b, stride=2, padding="same", backend=backend).pow(2).sum()

    def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.conv2d(F.pad(x, (0, 1, 1, 2)), a))  # 'same' for k=(4,2): (1,2) rows, (0,1) cols
        # stride 2, k=3 on 9x8: rows total (5-1)*2+3-9=2 -> (1,1); cols (4-1)*2+3-8=1 -> (0,1)
        return F.conv2d(F.pad(h, (0, 1, 1, 1)), b, stride=2).pow(2).sum()

    _, hvp_ours = torch.autograd.functional.hvp(ours, (w1, w2), v)
    _, hvp_ref = torch.autograd.functional.hvp(reference, (w1, w2), v)
    for a, b in zip(hvp_ours, hvp_ref):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


class _Spy:
    """Wraps a backend and records which gradients it was asked for."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
        self.calls: list[tuple[bool, bool]] = []
        backend = get_backend(name)
        original = backend.backward

        def backward(spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
            self.calls.append((need_input, need_weight))
            return original(spec, grad_output, input, weight, need_input, need_weight)

        monkeypatch.setattr(backend, "backward", backward)


@pytest.mark.parametrize("requires", [(True, False), (False, True), (True, True)])
def test_only_needed_gradients_are_computed(monkeypatch: pytest.MonkeyPatch, requires: tuple[bool, bool]) -> None:
    spy = _Spy(monkeypatch, "fwdconv")
    x = torch.randn(2, 3, 6, 6, requires_grad=requires[0])
    w = torch.randn(4, 3, 3, 3, requires_grad=requires[1])
    cg.conv2d(x, w, stride=2, backend="fwdconv").sum().backward()
    assert spy.calls == [requires]
    assert (x.grad is not None, w.grad is not None) == requires


def test_no_weight_gradients_skips_grad_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    spy = _Spy(monkeypatch, "fwdconv")
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    with cg.no_weight_gradients():
        (gx,) = torch.autograd.grad(cg.conv2d(x, w, backend="fwdconv").sum(), [x])
        cg.conv2d(x, w, backend="fwdconv").sum().backward()
    assert spy.calls == [(True, False), (True, False)]
    assert w.grad is None
    torch.testing.assert_close(gx, torch.autograd.grad(F.conv2d(x, w).sum(), [x])[0])
    cg.conv2d(x, w, backend="fwdconv").sum().backward()  # outside the scope: weights get gradients again
    assert w.grad is not None and spy.calls[-1] == (True, True)


@pytest.mark.parametrize("fn,n,transposed", [("conv1d", 1, False), ("conv3d", 3, False), ("conv_transpose2d", 2, True)])
def test_fixed_rank_wrappers_match_torch_functional(fn: str, n: int, transposed: bool) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, *(5,) * n, generator=g, dtype=torch.float64)
    w = torch.randn(4, 2, *(3,) * n, generator=g, dtype=torch.float64)
    b = torch.randn(4, generator=g, dtype=torch.float64)
    kw = dict(stride=2, padding=1, groups=2) | (dict(output_padding=1) if transposed else {})
    torch.testing.assert_close(getattr(cg, fn)(x, w, b, **kw), getattr(F, fn)(x, w, b, **kw))
    with pytest.raises(ValueError, match=rf"{fn}: weight.shape=.* must have {n + 2} dims"):
        getattr(cg, fn)(x, w[..., 0], b, **kw)


def test_unbatched_input_matches_torch() -> None:
    x = torch.randn(3, 7, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    y = cg.conv2d(x, w, stride=2, backend="fwdconv")
    ref = F.conv2d(x, w, stride=2)
    torch.testing.assert_close(y, ref)
    gy = torch.randn_like(y)
    ours = torch.autograd.grad(y, (x, w), gy)
    theirs = torch.autograd.grad(ref, (x, w), gy)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
