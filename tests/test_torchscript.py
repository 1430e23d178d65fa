"""TorchScript (issue 25, item 6): torch.jit.trace records convgrad's convolutions; torch.jit.script cannot, and says
what to use instead (torch.compile, torch.export, trace, or unpatch)."""

from __future__ import annotations

import warnings

import pytest
import torch

import convgrad as cg
from helpers import TOL

F64 = torch.float64


def _trace(model: torch.nn.Module, x: torch.Tensor) -> torch.jit.ScriptModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 deprecates torch.jit
        return torch.jit.trace(model, x)


def _models() -> list[tuple[str, torch.nn.Module, torch.nn.Module]]:
    """(name, convgrad model, torch twin): a drop-in module, and a patched model with a transposed conv."""
    torch.manual_seed(0)
    ref1 = torch.nn.Conv2d(2, 2, 3).double()
    ours1 = cg.nn.Conv2d(2, 2, 3, backend="fwdconv").double()
    ours1.load_state_dict(ref1.state_dict())
    ref2 = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                               torch.nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1)).double()
    ours2 = cg.patch(torch.nn.Sequential(*(torch.nn.Conv2d(2, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                                           torch.nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1))).double(),
                     backend="fwdconv")
    ours2.load_state_dict(ref2.state_dict())
    return [("drop-in", ours1, ref1), ("patched", ours2, ref2)]


@pytest.mark.parametrize("case", range(2), ids=["drop-in", "patched"])
def test_trace_records_the_convolution_and_its_backward(case: int) -> None:
    """Tracing failed: under the tracer each size is a tensor ("weight.shape=(tensor(2), ...) must contain only
    ints"). The trace gives torch's output and gradients, through convgrad's backward (no_weight_gradients acts)."""
    _, ours, ref = _models()[case]
    x = torch.randn(2, 2, 7, 7, dtype=F64, requires_grad=True)
    traced = _trace(ours, x)
    y, y_ref = traced(x), ref(x)
    torch.testing.assert_close(y, y_ref, **TOL[F64])
    gy = torch.randn_like(y)
    params = list(ours.parameters())
    got = torch.autograd.grad(y, [x, *params], gy)
    want = torch.autograd.grad(y_ref, [x, *ref.parameters()], gy)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[F64])
    with cg.no_weight_gradients():
        (gw,) = torch.autograd.grad(traced(x).sum(), [params[0]], allow_unused=True)
    assert gw is None


@pytest.mark.parametrize("case", range(2), ids=["drop-in", "patched"])
def test_script_of_a_module_names_what_works(case: int) -> None:
    """torch.jit.script failed with "Unknown type annotation: 'Tensor'"; it cannot hold a Python autograd.Function."""
    _, ours, _ = _models()[case]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(TypeError, match=r"Conv2d: torch\.jit\.script cannot compile .* use torch\.compile or "
                                            r"torch\.export .* convgrad\.unpatch"):
            torch.jit.script(ours)
        cg.unpatch(ours)
        if case == 1:  # unpatched, the model is torch's again and scripts
            x = torch.randn(1, 2, 7, 7, dtype=F64)
            torch.testing.assert_close(torch.jit.script(ours)(x), ours(x))


def test_script_of_a_function_names_what_works() -> None:
    def user(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cg.conv2d(x, w)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for f in (cg.conv2d, cg.conv_transpose3d, user):
            with pytest.raises(RuntimeError, match=r"script cannot compile .* torch\.compile or torch\.export"):
                torch.jit.script(f)


def test_export_runs_convgrad_modules() -> None:
    """What the script error recommends works: torch.export of a drop-in module and a patched model."""
    for _, ours, ref in _models():
        x = torch.randn(1, 2, 7, 7, dtype=F64)
        torch.testing.assert_close(torch.export.export(ours, (x,)).module()(x), ref(x), **TOL[F64])

