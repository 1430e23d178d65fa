"""Every argument form torch's convolutions accept, with torch's meaning, at every entry point (issue 25, item 10).

torch reads a one-element tuple or list of stride, padding, dilation or output_padding as that value in every
spatial dim (``F.conv2d(x, w, stride=(2,))`` is ``stride=(2, 2)``); convgrad refused it. Each entry point is
compared with torch's own result for the same arguments, in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import convgrad as cg
import convgrad.numpy as cgn
from helpers import TOL

F64 = torch.float64
ARGS = ("stride", "padding", "dilation", "output_padding")
# the value of each argument, chosen so that every one changes the result; output_padding < max(stride, dilation)
VALUE = {"stride": 2, "padding": 1, "dilation": 2, "output_padding": 1}


def _forms(value: int, n: int) -> list[Any]:
    """The forms torch accepts for one value in every dim: int, one-element tuple and list, n-tuple and n-list."""
    return [value, (value,), [value], (value,) * n, [value] * n]


def _kw(arg: str, form: Any) -> dict[str, Any]:
    """stride 2 as well when output_padding is tested (it must stay below stride)."""
    kw: dict[str, Any] = {arg: form}
    if arg == "output_padding":
        kw["stride"] = 2
    return kw


def _operands(n: int, transposed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    x = torch.randn(2, 4, *(7,) * n, generator=g, dtype=F64)
    w = torch.randn(4, 3, *(3,) * n, generator=g, dtype=F64) if transposed else torch.randn(
        3, 4, *(3,) * n, generator=g, dtype=F64)
    b = torch.randn(3, generator=g, dtype=F64)
    return x, w, b


CASES = [(n, transposed, arg) for n in (2, 3) for transposed in (False, True) for arg in ARGS
         if transposed or arg != "output_padding"]


def _torch_conv(n: int, transposed: bool) -> Any:
    return getattr(F, f"conv_transpose{n}d" if transposed else f"conv{n}d")


@pytest.mark.parametrize(("n", "transposed", "arg"), CASES, ids=lambda v: str(v))
def test_autograd_functions_and_helpers_read_every_form_as_torch(n: int, transposed: bool, arg: str) -> None:
    """cg.conv{n}d / conv_transpose{n}d (forward and the gradients of its backward), cg.conv_backward and the
    torch.nn.grad-style helpers, against torch for each form."""
    x, w, b = _operands(n, transposed)
    ours_fn = getattr(cg, f"conv_transpose{n}d" if transposed else f"conv{n}d")
    for form in _forms(VALUE[arg], n):
        kw = _kw(arg, form)
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        ref = _torch_conv(n, transposed)(xr, wr, br, **kw)
        gy = torch.randn_like(ref)
        ref_grads = torch.autograd.grad(ref, (xr, wr, br), gy)
        xo, wo, bo = (t.clone().requires_grad_() for t in (x, w, b))
        out = ours_fn(xo, wo, bo, **kw, backend="fwdconv")
        torch.testing.assert_close(out, ref, **TOL[F64], msg=f"{arg}={form!r}")
        for a, r in zip(torch.autograd.grad(out, (xo, wo, bo), gy), ref_grads):
            torch.testing.assert_close(a, r, **TOL[F64], msg=f"{arg}={form!r}")
        gi, gw, _ = cg.conv_backward(gy, x, w, [3], transposed=transposed, **kw, backend="fwdconv")
        torch.testing.assert_close(gi, ref_grads[0], **TOL[F64])
        torch.testing.assert_close(gw, ref_grads[1], **TOL[F64])
        if transposed:
            gi = cg.conv_transpose_input_grad(x.shape, w, gy, **kw)
            gw = cg.conv_transpose_weight_grad(x, w.shape, gy, **kw)
        else:
            gi = getattr(cg, f"conv{n}d_input")(x.shape, w, gy, **kw)
            gw = getattr(cg, f"conv{n}d_weight")(x, w.shape, gy, **kw)
            torch.testing.assert_close(getattr(torch.nn.grad, f"conv{n}d_input")(x.shape, w, gy, **kw), gi,
                                       **TOL[F64])
        torch.testing.assert_close(gi, ref_grads[0], **TOL[F64], msg=f"{arg}={form!r}")
        torch.testing.assert_close(gw, ref_grads[1], **TOL[F64], msg=f"{arg}={form!r}")


@pytest.mark.parametrize(("n", "transposed", "arg"), CASES, ids=lambda v: str(v))
def test_nn_modules_read_every_form_as_torch(n: int, transposed: bool, arg: str) -> None:
    """convgrad.nn modules built with each form give torch's module's output and parameter gradients."""
    kind = f"ConvTranspose{n}d" if transposed else f"Conv{n}d"
    x = torch.randn(2, 4, *(7,) * n, dtype=F64, generator=torch.Generator().manual_seed(1))
    for form in _forms(VALUE[arg], n):
        kw = _kw(arg, form)
        ref = getattr(torch.nn, kind)(4, 3, 3, **kw).to(F64)
        ours = getattr(cg.nn, kind)(4, 3, 3, **kw, backend="fwdconv").to(F64)
        ours.load_state_dict(ref.state_dict())
        y_ref, y = ref(x), ours(x)
        torch.testing.assert_close(y, y_ref, **TOL[F64], msg=f"{arg}={form!r}")
        gy = torch.randn_like(y_ref)
        for a, r in zip(torch.autograd.grad(y, list(ours.parameters()), gy),
                        torch.autograd.grad(y_ref, list(ref.parameters()), gy)):
            torch.testing.assert_close(a, r, **TOL[F64], msg=f"{arg}={form!r}")


@pytest.mark.parametrize(("n", "transposed", "arg"), CASES, ids=lambda v: str(v))
def test_numpy_path_reads_every_form_as_torch(n: int, transposed: bool, arg: str) -> None:
    x, w, b = _operands(n, transposed)
    conv = cgn.conv_transpose if transposed else cgn.conv
    for form in _forms(VALUE[arg], n):
        kw = _kw(arg, form)
        ref = _torch_conv(n, transposed)(x, w, b, **kw)
        out = conv(x.numpy(), w.numpy(), b.numpy(), **kw)
        np.testing.assert_allclose(out, ref.numpy(), rtol=TOL[F64]["rtol"], atol=TOL[F64]["atol"])
        gy = torch.randn_like(ref)
        gi, gw, _ = cgn.conv_backward(gy.numpy(), x.numpy(), w.numpy(), None, transposed=transposed, **kw)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref_gi, ref_gw = torch.autograd.grad(_torch_conv(n, transposed)(xr, wr, None, **kw), (xr, wr), gy)
        np.testing.assert_allclose(gi, ref_gi.numpy(), rtol=TOL[F64]["rtol"], atol=TOL[F64]["atol"])
        np.testing.assert_allclose(gw, ref_gw.numpy(), rtol=TOL[F64]["rtol"], atol=TOL[F64]["atol"])


@pytest.mark.parametrize("arg", ["stride", "padding", "dilation"])
def test_forms_torch_refuses_are_refused(arg: str) -> None:
    """Neither a 3-element tuple for a 2d conv nor an empty one means anything to torch; convgrad names them."""
    x, w = torch.randn(1, 2, 7, 7), torch.randn(3, 2, 3, 3)
    for bad in [(1, 1, 1), ()]:
        with pytest.raises(RuntimeError):
            F.conv2d(x, w, **{arg: bad})
        with pytest.raises(ValueError, match=rf"conv2d: {arg}=.* must have 1 or 2 entries"):
            cg.conv2d(x, w, **{arg: bad})
