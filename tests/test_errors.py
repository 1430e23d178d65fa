"""Every bad input is answered by a ValueError or TypeError naming the function, the parameter and the values.

Each is a ``convgrad.errors.ConvgradError`` too (the command line shows exactly those as one line), and refusals
carry their fields (``MethodRefused``) so that nothing parses a message.

One table row per distinct invalid call. None may end in a RuntimeError from deep inside torch, a
segfault or a silent broadcast: pytest.raises fails on any other exception, and on no exception.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import convgrad as cg
import convgrad.numpy as cgnp
from convgrad.backends import Backend, get_backend
from convgrad.backends.fwdconv import plan_input_grad, plan_weight_grad
from convgrad.errors import ConvgradError, ConvgradTypeError, ConvgradValueError, MethodRefused
from convgrad.spec import ConvSpec

F64 = torch.float64


def _t(*shape: int, dtype: torch.dtype = F64, device: str | torch.device | None = None) -> torch.Tensor:
    return torch.ones(*shape, dtype=dtype, device=device)


# A valid configuration the rows perturb: conv2d, stride 2, groups 2.
X, W, GY = _t(2, 4, 9, 9), _t(6, 2, 3, 3), _t(2, 6, 4, 4)
KW: dict[str, Any] = dict(stride=2, groups=2)


def _bw(**changes: Any) -> Callable[[], Any]:
    """conv_backward on the valid configuration with some arguments replaced."""
    args: dict[str, Any] = dict(grad_output=GY, input=X, weight=W, bias_sizes=[6], **KW) | changes
    return lambda: cg.conv_backward(**args)


def _no_complex_backend() -> str:
    """A registered backend without complex support (numpy, gemm, ...)."""
    return next(name for name in cg.backends() if not get_backend(name).supports_complex)


# (id, call, exception, regex that names the function, the parameter and the values)
ROWS: list[tuple[str, Callable[[], Any], type[Exception], str]] = [
    # shapes
    ("grad_output-shape", _bw(grad_output=_t(2, 6, 5, 5)), ValueError,
     r"conv_backward: grad_output\.shape=\(2, 6, 5, 5\) does not match the output shape \(2, 6, 4, 4\)"),
    ("grad_output-batch", _bw(grad_output=_t(3, 6, 4, 4)), ValueError,
     r"conv_backward: grad_output\.shape=\(3, 6, 4, 4\)"),
    ("grad_output-unbatched-for-batched", _bw(grad_output=_t(6, 4, 4)), ValueError,
     r"conv_backward: grad_output\.shape=\(6, 4, 4\) does not match"),
    ("weight-rank", _bw(weight=_t(6, 2)), ValueError, r"conv_backward: weight\.shape=\(6, 2\) must have 3, 4 or 5"),
    ("input-rank", _bw(input=_t(4, 9)), ValueError, r"conv_backward: input\.shape=\(4, 9\) must have 4 dims"),
    ("channels", _bw(input=_t(2, 6, 9, 9)), ValueError,
     r"conv_backward: weight\.shape=\(6, 2, 3, 3\) with groups=2 expects in_channels=4, but input has 6"),
    ("groups-not-dividing-input", _bw(input=_t(2, 3, 9, 9)), ValueError,
     r"conv_backward: groups=2 must divide in_channels=3"),
    ("kernel-larger-than-padded-input", lambda: cg.conv(_t(1, 1, 2, 2), _t(1, 1, 3, 3), padding=0), ValueError,
     r"conv: kernel extent dilation\*\(k-1\)\+1=3 is larger than the padded input 2\+0\+0=2"),
    ("empty-spatial", lambda: cg.conv(_t(1, 1, 0, 4), _t(1, 1, 1, 1)), ValueError,
     r"conv: input\.shape=\(1, 1, 0, 4\) has an empty spatial dim"),
    ("empty-kernel", lambda: cg.conv(_t(1, 1, 4, 4), _t(1, 1, 0, 1)), ValueError,
     r"conv: weight\.shape=\(1, 1, 0, 1\) has an empty kernel"),
    ("zero-out-channels", lambda: cg.conv(_t(1, 1, 4, 4), _t(0, 1, 1, 1)), ValueError,
     r"conv: channels must be positive \(in_channels=1, out_channels=0\)"),
    ("conv2d-rank", lambda: cg.conv2d(_t(1, 2, 5), _t(3, 2, 3)), ValueError,
     r"conv2d: weight\.shape=\(3, 2, 3\) must have 4 dims"),
    ("nn-grad-rank", lambda: cg.conv1d_input((2, 4, 9, 9), W, GY), ValueError,
     r"conv1d_input: weight has 4 dims; a 1d convolution needs 3"),
    ("bias-shape", lambda: cg.conv(X, W, _t(1), **KW), ValueError,
     r"conv: bias\.shape=\(1,\) must be \(out_channels,\)=\(6,\)"),
    ("transposed-output-empty", lambda: cg.conv_transpose(_t(1, 1, 2), _t(1, 1, 2), padding=2), ValueError,
     r"conv_transpose: the transposed convolution's output size \(-1,\) must be positive; padding=\(\(2, 2\),\)"),
    ("weight_size-inconsistent", lambda: cg.conv_transpose_weight_grad(X, (5, 3, 3, 3), _t(2, 6, 19, 19), stride=2,
                                                                       groups=2), ValueError,
     r"conv_transpose_weight_grad: weight\.shape=\(5, 3, 3, 3\) expects in_channels=5 for a transposed conv, "
     r"but input has 4 channels"),
    ("grad_output-transposed", lambda: cg.conv_transpose_weight_grad(X, (4, 3, 3, 3), _t(2, 5, 19, 19), stride=2,
                                                                     groups=2), ValueError,
     r"conv_transpose_weight_grad: grad_output\.shape=\(2, 5, 19, 19\) does not match the output shape "
     r"\(2, 6, 19, 19\) of conv_transpose2d"),
    ("conv_bias_grad-rank", lambda: cg.conv_bias_grad(_t(2, 6)), ValueError,
     r"conv_bias_grad: grad_output\.shape=\(2, 6\) must be \(N, C_out, \*spatial\)"),
    # dtypes
    ("int-input", _bw(input=X.long()), TypeError, r"conv_backward: input\.dtype=torch\.int64 is not supported"),
    ("bool-weight", _bw(weight=W.bool()), TypeError, r"conv_backward: weight\.dtype=torch\.bool is not supported"),
    ("uint8-grad_output", lambda: cg.conv_bias_grad(GY.to(torch.uint8)), TypeError,
     r"conv_bias_grad: grad_output\.dtype=torch\.uint8 is not supported"),
    ("dtype-mismatch", _bw(weight=W.float()), TypeError,
     r"conv_backward: weight\.dtype=torch\.float32 does not match grad_output\.dtype=torch\.float64"),
    ("bias-dtype", lambda: cg.conv(X, W, _t(6, dtype=torch.float32), **KW), TypeError,
     r"conv: bias\.dtype=torch\.float32 does not match input\.dtype=torch\.float64"),
    ("complex-unsupported-backend", lambda: cg.conv_backward(GY.cdouble(), X.cdouble(), W.cdouble(), **KW,
                                                              backend=_no_complex_backend()), TypeError,
     r"conv_backward: backend='\w+' does not support complex dtypes \(torch\.complex128\)"),
    # devices ('meta' stands in for a second device)
    ("device-mismatch", _bw(weight=_t(6, 2, 3, 3, device="meta")), ValueError,
     r"conv_backward: weight\.device=meta does not match grad_output\.device=\w+"),
    ("device-mismatch-autograd", lambda: cg.conv(X, W.to("meta"), **KW), ValueError,
     r"conv: weight\.device=meta does not match input\.device=\w+"),
    # tuple lengths
    ("stride-length", _bw(stride=(2, 2, 2)), ValueError,
     r"conv_backward: stride=\(2, 2, 2\) must have 1 or 2 entries, one per spatial dim \(got 3\)"),
    ("dilation-length", _bw(dilation=(1, 1, 1)), ValueError,
     r"conv_backward: dilation=\(1, 1, 1\) must have 1 or 2 entries"),
    ("stride-empty", _bw(stride=()), ValueError, r"conv_backward: stride=\(\) must have 1 or 2 entries"),
    ("padding-pairs-count", _bw(padding=((1, 1),)), ValueError,
     r"conv_backward: padding=\(\(1, 1\),\) must have 2 \(lo, hi\) pairs"),
    ("padding-pair-length", _bw(padding=((1, 1, 1), (0, 0))), ValueError,
     r"conv_backward: padding=\(\(1, 1, 1\), \(0, 0\)\) must mix no ints with \(lo, hi\) pairs"),
    ("output_mask-length", _bw(output_mask=(True, True)), ValueError,
     r"conv_backward: output_mask=\(True, True\) must be three bools"),
    ("output_mask-non-bool", _bw(output_mask=(1, 1, 1)), ValueError,
     r"conv_backward: output_mask=\(1, 1, 1\) must be three bools"),
    # ranges
    ("stride-zero", _bw(stride=0), ValueError, r"conv_backward: stride=0 must be positive"),
    ("stride-negative", _bw(stride=(2, -1)), ValueError, r"conv_backward: stride=\(2, -1\) must be positive"),
    ("dilation-zero", _bw(dilation=0), ValueError, r"conv_backward: dilation=0 must be positive"),
    ("padding-negative", _bw(padding=-1), ValueError, r"conv_backward: padding=-1 must be >= 0"),
    ("groups-zero", _bw(groups=0), ValueError, r"conv_backward: groups=0 must be positive"),
    ("groups-not-dividing", lambda: cg.conv_weight_grad(X, (6, 2, 3, 3), GY, stride=2, groups=4), ValueError,
     r"conv_weight_grad: groups=4 must divide out_channels=6"),
    ("output_padding-forward", _bw(output_padding=1), ValueError,
     r"conv_backward: output_padding=\(1, 1\) is only allowed for a transposed convolution"),
    ("output_padding-too-large", lambda: cg.conv_transpose(X, _t(4, 3, 3, 3), stride=2, output_padding=2),
     ValueError, r"conv_transpose: output_padding=\(2, 2\) must be smaller than max\(stride, dilation\)"),
    ("input_size-negative", lambda: cg.conv_input_grad((2, 4, -9, 9), W, GY, **KW), ValueError,
     r"conv_input_grad: input_size=\(2, 4, -9, 9\) must be >= 0"),
    # non-integers
    ("stride-float", _bw(stride=1.5), TypeError, r"conv_backward: stride=1\.5 must be an int or a tuple of 2 ints"),
    ("dilation-float-entry", _bw(dilation=(1, 2.0)), TypeError,
     r"conv_backward: dilation=\(1, 2\.0\) must contain only ints \(got float\)"),
    ("groups-float", _bw(groups=2.0), TypeError, r"conv_backward: groups=2\.0 must be an int"),
    ("stride-bool", _bw(stride=True), TypeError, r"conv_backward: stride=True must be an int"),
    ("weight_size-float", lambda: cg.conv_weight_grad(X, (6, 2, 3.0, 3), GY, **KW), TypeError,
     r"conv_weight_grad: weight_size=\(6, 2, 3\.0, 3\) must contain only ints \(got float\)"),
    ("transposed-not-bool", _bw(transposed=1), TypeError, r"conv_backward: transposed=1 must be a bool"),
    # strings
    ("padding-unknown-string", _bw(padding="full"), ValueError,
     r"conv_backward: padding='full' must be an int, a tuple, 'same' or 'valid'"),
    ("padding-same-transposed", lambda: cg.conv_transpose(X, _t(4, 3, 3, 3), padding="same"), ValueError,
     r"conv_transpose: padding='same' is not defined for a transposed convolution"),
    ("stride-string", _bw(stride="2"), TypeError, r"conv_backward: stride='2' must be an int or a tuple of 2 ints"),
    ("backend-unknown", _bw(backend="cudnn"), ValueError,
     r"conv_backward: backend='cudnn' is not registered; choose one of \["),
    ("input_size-string", lambda: cg.conv_input_grad("2,4,9,9", W, GY, **KW), TypeError,
     r"conv_input_grad: input_size='2,4,9,9' must be a sequence of ints"),
    ("input_size-tensor", lambda: cg.conv_input_grad(X, W, GY, **KW), TypeError,
     r"conv_input_grad: input_size=<Tensor of shape \(2, 4, 9, 9\), float64> must be a sequence of ints such as "
     r"torch\.Size \(pass its \.shape\)$"),
    # None or a non-tensor where a tensor is needed
    ("grad_output-None", _bw(grad_output=None), TypeError,
     r"conv_backward: grad_output is None, but a tensor is required"),
    ("weight-None", lambda: cg.conv(X, None), TypeError, r"conv: weight is None, but a tensor is required"),
    ("input-list", lambda: cg.conv2d([[1.0]], W), TypeError, r"conv2d: input must be a torch\.Tensor, got list"),
    ("backend-None", _bw(backend=None), TypeError, r"conv_backward: backend=None must be a string"),
    ("nn-grad-weight_size-None", lambda: cg.conv2d_weight(X, None, GY, **KW), TypeError,
     r"conv2d_weight: weight_size=None must be a sequence of ints"),
    ("nn-grad-input_size-int", lambda: cg.conv2d_input(5, W, GY, **KW), TypeError,
     r"conv2d_input: input_size=5 must be a sequence of ints"),
    ("PerSampleGrads-None", lambda: cg.PerSampleGrads(None), TypeError,
     r"PerSampleGrads: model must be a torch\.nn\.Module, got NoneType"),
    ("patch-None", lambda: cg.patch(None), TypeError, r"patch: model must be a torch\.nn\.Module, got NoneType"),
    ("unpatch-None", lambda: cg.unpatch(None), TypeError, r"unpatch: model must be a torch\.nn\.Module, got NoneType"),
    ("numpy-input-None", lambda: cgnp.conv(None, np.ones((6, 2, 3, 3))), TypeError,
     r"convgrad\.numpy\.conv: input is None, but a numpy\.ndarray is required"),
    ("numpy-weight-None", lambda: cgnp.conv_backward(np.ones((2, 6, 4, 4)), np.ones((2, 4, 9, 9)), None), TypeError,
     r"convgrad\.numpy\.conv_backward: weight is None, but a numpy\.ndarray is required"),
    # bias_sizes
    ("bias_sizes-mismatch", _bw(bias_sizes=[5]), ValueError,
     r"conv_backward: bias_sizes=\[5\] must be None or \[out_channels\]=\[6\]"),
    ("bias_sizes-int", _bw(bias_sizes=6), ValueError, r"conv_backward: bias_sizes=6 must be None or \[out_channels\]"),
    ("bias_sizes-float", _bw(bias_sizes=[6.0]), ValueError,
     r"conv_backward: bias_sizes=\[6\.0\] must be None or \[out_channels\]=\[6\]"),
]


def test_table_has_at_least_30_distinct_calls() -> None:
    ids = [row[0] for row in ROWS]
    assert len(set(ids)) == len(ids) >= 30


@pytest.mark.parametrize(("call", "exc", "match"), [row[1:] for row in ROWS], ids=[row[0] for row in ROWS])
def test_invalid_call_raises_clear_error(call: Callable[[], Any], exc: type[Exception], match: str) -> None:
    with pytest.raises(exc, match=match) as info:
        call()
    assert type(info.value) in (ConvgradValueError, ConvgradTypeError), f"{type(info.value).__name__}: {info.value}"


def test_the_error_types_keep_the_builtin_classes() -> None:
    """``except ValueError`` / ``except TypeError`` written before the types still catch them."""
    assert issubclass(ConvgradValueError, ValueError) and issubclass(ConvgradTypeError, TypeError)
    assert issubclass(MethodRefused, ConvgradValueError) and issubclass(ConvgradValueError, ConvgradError)


@pytest.mark.parametrize(("build", "method", "reason"), [
    (plan_weight_grad, "blocks", "needs stride 1 in every dim"),
    (plan_weight_grad, "phases", "needs dilation 1 in every dim"),
    (plan_input_grad, "subpixel", "needs dilation dividing stride and a phase with taps in every dim"),
])
def test_a_refused_method_carries_its_fields(build: Callable[..., Any], method: str, reason: str) -> None:
    """The refusal is read from its fields, and survives pickling (a DataLoader worker, DDP)."""
    spec = ConvSpec.from_shapes((2, 4, 9, 9), (4, 1, 3, 3), stride=2, padding=1, dilation=3, groups=4)
    with pytest.raises(MethodRefused) as info:
        build(spec, method)
    err = info.value
    assert (err.method, err.reason, err.layer.startswith(spec.describe())) == (method, reason, True)
    again = pickle.loads(pickle.dumps(err))
    assert (type(again), str(again), again.reason) == (MethodRefused, str(err), reason)


@pytest.mark.parametrize("which", ["input_size", "weight_size"])
def test_explain_given_tensors_names_their_type_and_shape_not_their_values(which: str) -> None:
    """Before: ``cg.explain(x, w)`` put the tensor's whole repr (a line per row of numbers) into the message."""
    x, w = torch.randn(1, 1, 9, 9), torch.randn(1, 1, 3, 3)
    args = (x, w.shape) if which == "input_size" else (x.shape, w)
    with pytest.raises(ConvgradTypeError) as info:
        cg.explain(*args)
    shape = "(1, 1, 9, 9)" if which == "input_size" else "(1, 1, 3, 3)"
    assert str(info.value) == (f"explain: {which}=<Tensor of shape {shape}, float32> must be a sequence of ints "
                               "such as torch.Size (pass its .shape)")


def test_explain_rewords_a_refusal_from_its_reason() -> None:
    """explain's message takes the builder's reason field (it split the builder's message on "; " before)."""
    with pytest.raises(MethodRefused) as info:
        cg.explain((2, 4, 9, 9), (4, 4, 3, 3), stride=2, weight_method="blocks")
    assert info.value.param == "weight_method" and info.value.method == "blocks"
    assert str(info.value).startswith("explain: weight_method='blocks' cannot serve ")
    assert str(info.value).endswith(": needs stride 1 in every dim")


@pytest.mark.parametrize("backend", [b for b in cg.backends() if not get_backend(b).supports_complex])
@pytest.mark.parametrize("fn", ["conv_input_grad", "conv_weight_grad"])
def test_backends_without_complex_refuse_it(backend: str, fn: str) -> None:
    x, w, gy = X.cdouble(), W.cdouble(), GY.cdouble()
    args = (x.shape, w, gy) if fn == "conv_input_grad" else (x, w.shape, gy)
    with pytest.raises(TypeError, match=rf"{fn}: backend='{backend}' does not support complex dtypes"):
        getattr(cg, fn)(*args, **KW, backend=backend)


def test_every_backend_declares_complex_support_honestly() -> None:
    """A backend claiming complex support computes it (numerics are in test_numerics.py)."""
    for name in cg.backends():
        b: Backend = get_backend(name)
        if b.supports_complex:
            gi, gw, _ = cg.conv_backward(GY.cdouble(), X.cdouble(), W.cdouble(), **KW, backend=name)
            assert gi.dtype == gw.dtype == torch.complex128, name


@pytest.mark.slow  # a fresh interpreter
def test_importing_one_backend_module_first_still_registers_every_backend() -> None:
    """Regression: importing convgrad.backends.native (as autograd does) left the registry holding native alone."""
    code = "import convgrad.backends.native, convgrad; print(convgrad.backends())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}).stdout
    assert out.strip() == str(cg.backends())
