"""The gemm backend beyond the grid: bounded workspace (chunks) and second derivatives."""

from __future__ import annotations

import math

import pytest
import torch

import convgrad as cg
from convgrad.backends import gemm, get_backend
from helpers import TOL, Case, assert_matches_autograd, grid_cases, make_tensors, reference_grads

CASES = {c.name: c for c in grid_cases()}


def _grads(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    gi, gw, gb = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, transposed=case.transposed,
                                  backend="gemm", **{**case.kwargs(), "output_padding": case.output_padding})
    return {"grad_input": gi, "grad_weight": gw, "grad_bias": gb}


@pytest.mark.parametrize("name", ["2d-groups2-cin4", "3d-dilation2-stride2", "2d-T-stride3-op2-groups2",
                                  "1d-asym-padding"])
def test_tiny_workspace_cap_runs_several_chunks_and_changes_nothing(name: str, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    case = CASES[name]
    t = make_tensors(case)
    spec = case.spec()
    backend = get_backend("gemm")
    unlimited = _grads(case, t)
    calls = {"_windows": 0, "_columns": 0}
    for fn in calls:
        def counted(*args: object, _fn: str = fn, _orig: object = getattr(gemm, fn)) -> torch.Tensor:
            calls[_fn] += 1
            return _orig(*args)  # type: ignore[operator]

        monkeypatch.setattr(gemm, fn, counted)
    # one channel of one sample is the smallest chunk: a cap of one element forces it
    monkeypatch.setattr(backend, "max_workspace_bytes", 8)
    chunked = _grads(case, t)
    assert calls["_windows"] == spec.batch  # one batch chunk per sample
    assert calls["_columns"] == spec.batch * spec.x_channels // spec.groups  # one column block per channel
    assert calls["_columns"] > 1
    assert_matches_autograd(chunked, reference_grads(case, t), torch.float64, f"gemm chunked {case}")
    for key, value in unlimited.items():
        torch.testing.assert_close(chunked[key], value, **TOL[torch.float64])


@pytest.mark.parametrize("cap", [1, 2**10, 2**14, 2**16, 2**30])
def test_chunking_keeps_the_columns_under_the_cap(cap: int) -> None:
    spec = Case((5, 12, 9, 9), (6, 4, 3, 3), stride=2, padding=1, groups=3).spec()
    samples, channels = gemm.chunking(spec, 8, cap)
    one_channel = spec.groups * math.prod(spec.kernel_size) * math.prod(spec.y_size) * 8
    assert 1 <= samples <= spec.batch and 1 <= channels <= spec.x_channels // spec.groups
    assert samples * channels * one_channel <= max(cap, one_channel)
    if channels < spec.x_channels // spec.groups:
        assert samples == 1  # channels are split only once a single sample does not fit


# small enough for gradgradcheck, each with r != 0, groups, dilation or asymmetric padding
# (the 1d and 3d ones in the slow tier: gemm has one N-d code path, and each gradgradcheck takes seconds)
SECOND_ORDER = [
    pytest.param(Case((2, 2, 9), (4, 1, 3), stride=2, dilation=2, padding=1, groups=2), marks=pytest.mark.slow),
    Case((1, 2, 5, 4), (2, 1, 2, 3), stride=(2, 1), padding=((1, 0), (0, 2)), groups=2),
    Case((1, 2, 3, 3), (2, 2, 3, 3), stride=2, padding=1, transposed=True, output_padding=1),
    pytest.param(Case((1, 2, 3, 4, 4), (2, 1, 2, 1, 2), stride=(1, 2, 1), dilation=(1, 1, 2), groups=2),
                 marks=pytest.mark.slow),
]


@pytest.mark.parametrize("case", SECOND_ORDER, ids=str)
@pytest.mark.parametrize("cap", [None, 8])
def test_second_derivatives_through_gemm(case: Case, cap: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """gradgradcheck through cg.conv / cg.conv_transpose with backend='gemm', chunked or not."""
    if cap is not None:
        monkeypatch.setattr(get_backend("gemm"), "max_workspace_bytes", cap)
    t = make_tensors(case)
    x, w, b = (t[k].clone().requires_grad_() for k in ("input", "weight", "bias"))
    op = cg.conv_transpose if case.transposed else cg.conv
    kw = {**case.kwargs(), "backend": "gemm"}
    assert torch.autograd.gradgradcheck(lambda x_, w_, b_: op(x_, w_, b_, **kw), (x, w, b))


@pytest.mark.parametrize("transposed", [False, True])
def test_expanded_grad_output_and_channels_last_inputs(transposed: bool) -> None:
    """y.sum() sends an expanded (stride 0) grad_output; channels_last tensors have permuted strides."""
    x = torch.randn(2, 4, 7, 6, dtype=torch.float64).to(memory_format=torch.channels_last).requires_grad_()
    w = torch.randn(4, 2, 3, 2, dtype=torch.float64).to(memory_format=torch.channels_last).requires_grad_()
    kw = {"stride": 2, "padding": 1, "groups": 2}
    ours = (cg.conv_transpose if transposed else cg.conv)(x, w, backend="gemm", **kw)
    ref = (torch.nn.functional.conv_transpose2d if transposed else torch.nn.functional.conv2d)(x, w, **kw)
    expected = torch.autograd.grad(ref.sum(), [x, w])
    for got, want in zip(torch.autograd.grad(ours.sum(), [x, w]), expected):
        torch.testing.assert_close(got, want, **TOL[torch.float64])


def test_workspace_default_is_256_mib() -> None:
    assert get_backend("gemm").max_workspace_bytes == 256 * 2**20 == gemm.DEFAULT_MAX_WORKSPACE_BYTES
