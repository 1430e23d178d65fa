"""convgrad.numpy (arrays in, arrays out, no torch) and the torch-facing backend='numpy'."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import convgrad as cg
import convgrad.numpy as cgn
from helpers import Case, assert_matches_autograd, grid_cases, make_tensors, reference_forward, reference_grads

CASES = grid_cases()
SRC = Path(__file__).resolve().parents[1] / "src"
OTHERS = str([b for b in cg.backends() if b != "numpy"])  # the backends numpy's errors point to


def _forward(case: Case, t: dict[str, np.ndarray]) -> np.ndarray:
    if case.transposed:
        return cgn.conv_transpose(t["input"], t["weight"], t["bias"], **case.kwargs())
    return cgn.conv(t["input"], t["weight"], t["bias"], **case.kwargs())


def _arrays(t: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in t.items()}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_matches_torch_float64(case: Case) -> None:
    t = make_tensors(case)
    ours = _forward(case, _arrays(t))
    assert isinstance(ours, np.ndarray) and ours.dtype == np.float64
    expected = reference_forward(case, t["input"], t["weight"], t["bias"])
    torch.testing.assert_close(torch.from_numpy(ours), expected, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("case", CASES[::4], ids=str)
def test_forward_matches_torch_float32(case: Case) -> None:
    t = make_tensors(case, torch.float32)
    ours = _forward(case, _arrays(t))
    assert ours.dtype == np.float32
    expected = reference_forward(case, t["input"], t["weight"], t["bias"])
    torch.testing.assert_close(torch.from_numpy(ours), expected, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv_backward_matches_autograd(case: Case, dtype: torch.dtype) -> None:
    """The NumPy API's conv_backward, arrays only, against torch autograd."""
    t = make_tensors(case, dtype)
    a = _arrays(t)
    grads = cgn.conv_backward(a["grad_output"], a["input"], a["weight"], [case.spec().out_channels],
                              transposed=case.transposed, **{**case.kwargs(), "output_padding": case.output_padding})
    ours = {k: torch.from_numpy(g) for k, g in zip(["grad_input", "grad_weight", "grad_bias"], grads)}
    assert_matches_autograd(ours, reference_grads(case, t), dtype, f"convgrad.numpy {case}")


def test_output_mask_skips_gradients() -> None:
    case = CASES[1]
    a = _arrays(make_tensors(case))
    gi, gw, gb = cgn.conv_backward(a["grad_output"], a["input"], a["weight"], stride=case.stride,
                                   output_mask=(False, True, False))
    assert gi is None and gb is None and gw.shape == case.weight_shape


NO_TORCH = """
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
import numpy as np
import convgrad.numpy as cgn
x, w = np.ones((2, 4, 6, 6)), np.ones((6, 2, 3, 3))
y = cgn.conv(x, w, stride=2, padding=1, groups=2)
gi, gw, gb = cgn.conv_backward(np.ones_like(y), x, w, [6], stride=2, padding=1, groups=2)
assert y.shape == (2, 6, 3, 3) and gi.shape == x.shape and gw.shape == w.shape and gb.shape == (6,)
assert not [m for m in sys.modules if m.startswith("torch") and sys.modules[m] is not None]
print("ok", float(y[0, 0, 1, 1]), float(gb[0]))
"""


def test_imports_and_runs_without_torch() -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(NO_TORCH)], capture_output=True, text=True,
                         env={"PYTHONPATH": str(SRC), "PATH": ""}, timeout=60)
    assert out.returncode == 0, out.stderr
    # a window of ones over 2 channels x 3 x 3 interior taps; grad_bias = N * 3 * 3 ones
    assert out.stdout.split() == ["ok", "18.0", "18.0"]


@pytest.mark.parametrize("bad, message", [
    (np.ones((1, 2, 5, 5), np.int64), "input.dtype=int64 is not supported"),
    (np.ones((1, 2, 5, 5), np.float16), "input.dtype=float16 is not supported"),
    (np.ones((1, 2, 5, 5), np.float32), "weight.dtype=float64 does not match input.dtype=float32"),
    ([[[1.0]]], "input must be a numpy.ndarray, got list"),
])
def test_numpy_api_type_errors_name_function_parameter_and_value(bad: object, message: str) -> None:
    with pytest.raises(TypeError, match=f"convgrad.numpy.conv: {message}"):
        cgn.conv(bad, np.ones((3, 2, 3, 3)))  # type: ignore[arg-type]


def test_numpy_api_value_errors_come_from_the_spec() -> None:
    with pytest.raises(ValueError, match=r"convgrad\.numpy\.conv: groups=3 must divide in_channels=4"):
        cgn.conv(np.ones((1, 4, 5, 5)), np.ones((3, 2, 3, 3)), groups=3)
    with pytest.raises(ValueError, match=r"convgrad.numpy.conv_backward: grad_output.shape=\(1, 3, 2, 2\)"):
        cgn.conv_backward(np.ones((1, 3, 2, 2)), np.ones((1, 2, 5, 5)), np.ones((3, 2, 3, 3)))


# ---- the torch-facing backend ---------------------------------------------------------------------------------------

def test_backend_float32_gradients_keep_dtype() -> None:
    case = CASES[[c.name for c in CASES].index("2d-groups2-cin4")]
    t = make_tensors(case, torch.float32)
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], backend="numpy", **case.kwargs())
    ref = reference_grads(case, t)
    assert_matches_autograd({"grad_input": gi, "grad_weight": gw}, ref, torch.float32, "numpy float32")


def test_backend_first_derivative_works_second_raises() -> None:
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64, requires_grad=True)
    gx, gw = torch.autograd.grad(cg.conv(x, w, stride=2, backend="numpy").square().sum(), [x, w])
    rx, rw = torch.autograd.grad(torch.nn.functional.conv2d(x, w, stride=2).square().sum(), [x, w])
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gw, rw)
    y = cg.conv(x, w, stride=2, backend="numpy")
    with pytest.raises(ValueError, match=r"conv: backend='numpy' is not differentiable; a second derivative "
                                         r"\(create_graph=True\) needs one of " + re.escape(OTHERS)):
        torch.autograd.grad(y.sum(), [x], create_graph=True)


_TRANSFORMS = {
    "grad": lambda f, x: torch.func.grad(lambda a: f(a).sum())(x),
    "vjp": lambda f, x: torch.func.vjp(f, x)[1](torch.ones(1, 4, 2, 2, dtype=x.dtype)),
    "jacrev": lambda f, x: torch.func.jacrev(f)(x),
    "vmap(grad)": lambda f, x: torch.vmap(torch.func.grad(lambda a: f(a).sum()))(x.expand(3, *x.shape)),
    "is_grads_batched": lambda f, x: torch.autograd.grad(f(x.requires_grad_()), x,
                                                         torch.ones(2, 1, 4, 2, 2, dtype=x.dtype),
                                                         is_grads_batched=True),
}


@pytest.mark.parametrize("transform", _TRANSFORMS)
def test_backend_refuses_torch_func_transforms_naming_the_backends_that_support_them(transform: str) -> None:
    """Not the second-derivative message: no second derivative was asked for."""
    x = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, dtype=torch.float64)
    msg = (r"conv2d: backend='numpy' does not support torch.func transforms \(grad, vjp, jacrev, vmap, \.\.\.\) "
           r"nor is_grads_batched, but (input|grad_output) comes from one; use one of " + re.escape(OTHERS))
    with pytest.raises(ValueError, match=msg):
        _TRANSFORMS[transform](lambda a: cg.conv2d(a, w, stride=2, backend="numpy"), x)
    for backend in ("native", "fwdconv"):  # the backends it names do run the transform
        _TRANSFORMS[transform](lambda a, b=backend: cg.conv2d(a, w, stride=2, backend=b), x.detach())


def test_backend_conv_backward_on_tensors_that_require_grad_raises() -> None:
    """The results of a NumPy computation carry no graph: returning them would detach them silently."""
    gy, x, w = (torch.randn(s, dtype=torch.float64) for s in ((1, 3, 3, 3), (1, 2, 5, 5), (3, 2, 3, 3)))
    msg = (r"conv_backward: backend='numpy' computes outside autograd, but weight.requires_grad=True: the "
           r"gradients would come back silently detached from the graph; pass detached tensors, call it under "
           r"torch.no_grad\(\), or use one of " + re.escape(OTHERS))
    with pytest.raises(ValueError, match=msg):
        cg.conv_backward(gy, x, w.requires_grad_(), backend="numpy")
    with pytest.raises(ValueError, match=r"conv_weight_grad: backend='numpy' computes outside autograd, but "
                                         r"input\.requires_grad=True"):
        cg.conv_weight_grad(x.requires_grad_(), w.shape, gy, backend="numpy")
    with torch.no_grad():  # nothing to detach from: the results are what the user asked for
        gi, gw, _ = cg.conv_backward(gy, x, w, backend="numpy")
    ref = cg.conv_backward(gy, x.detach(), w.detach(), backend="native")
    torch.testing.assert_close((gi, gw), ref[:2])
    gi, gw, _ = cg.conv_backward(gy, x.detach(), w.detach(), backend="numpy")
    torch.testing.assert_close((gi, gw), ref[:2])
    assert cg.conv_backward(gy, x, w, backend="native")[0].requires_grad  # a traceable backend keeps the graph


DEVICES = ["meta"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_backend_refuses_non_cpu_tensors(device: str) -> None:
    """A CUDA tensor (here also the meta device, which needs no GPU) gets a ValueError naming the device."""
    gy, x, w = (torch.empty(s, device=device) for s in ((1, 3, 3, 3), (1, 2, 5, 5), (3, 2, 3, 3)))
    with pytest.raises(ValueError, match=f"conv_backward: backend='numpy' needs CPU tensors, but "
                                         f"grad_output.device={device}"):
        cg.conv_backward(gy, x, w, backend="numpy")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backend_refuses_unsupported_dtypes(dtype: torch.dtype) -> None:
    gy, x, w = (torch.ones(s, dtype=dtype) for s in ((1, 3, 3, 3), (1, 2, 5, 5), (3, 2, 3, 3)))
    with pytest.raises(TypeError, match=f"conv_input_grad: backend='numpy' supports float32 and float64, but "
                                        f"weight.dtype={dtype}; use one of "):
        cg.conv_input_grad(x.shape, w, gy, backend="numpy")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_backend_refuses_unsupported_dtypes_at_the_forward(dtype: torch.dtype) -> None:
    """The first call refuses, not the backward after a whole forward pass; a module's call names the module."""
    x, w = torch.ones(1, 2, 5, 5, dtype=dtype), torch.ones(3, 2, 3, 3, dtype=dtype)
    with pytest.raises(TypeError, match=f"^conv2d: backend='numpy' supports float32 and float64, but "
                                        f"input.dtype={dtype}; use one of"):
        cg.conv2d(x, w, backend="numpy")
    m = cg.nn.Conv2d(2, 3, 3, backend="numpy", dtype=dtype)
    with pytest.raises(TypeError, match=f"^Conv2d: backend='numpy' supports float32 and float64, but "
                                        f"input.dtype={dtype}"):
        m(x)


def test_backend_under_autocast_names_what_the_user_passed() -> None:
    """autocast casts the float32 operands to bfloat16: the error says so, and names no dtype never passed."""
    x, w = torch.ones(1, 2, 5, 5), torch.ones(3, 2, 3, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError) as err:
        cg.conv2d(x, w, backend="numpy")
    assert str(err.value) == ("conv2d: backend='numpy' cannot run inside torch.autocast('cpu'), which casts input "
                              "(torch.float32) to a dtype this backend does not compute in; run this call with "
                              "torch.autocast('cpu', enabled=False) or use one of " + OTHERS)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autocast("cpu", enabled=False):
        assert cg.conv2d(x, w, backend="numpy").dtype == torch.float32  # the way out the message gives
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match=r"input\.dtype=torch\.float16"):
        cg.conv2d(x.half(), w, backend="numpy")  # a dtype the user did pass is named as passed


def test_backend_refuses_complex() -> None:
    gy, x, w = (torch.ones(s, dtype=torch.complex128) for s in ((1, 3, 3, 3), (1, 2, 5, 5), (3, 2, 3, 3)))
    with pytest.raises(TypeError, match="backend='numpy' does not support complex dtypes"):
        cg.conv_backward(gy, x, w, backend="numpy")
