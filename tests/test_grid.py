"""Every backend on the full grid of hard cases, float64, against torch autograd."""

from __future__ import annotations

import pytest
import torch

import convgrad as cg
from helpers import (
    REPRESENTATIVE,
    Case,
    assert_matches_autograd,
    grid_backends,
    grid_cases,
    grid_params,
    make_tensors,
    random_cases,
    reference_grads,
    tensors_and_reference,
)

CASES = grid_cases() + random_cases(40, seed=1234)
BACKENDS = cg.backends()


def _ours(case: Case, t: dict[str, torch.Tensor], backend: str) -> dict[str, torch.Tensor | None]:
    gi, gw, gb = cg.conv_backward(t["grad_output"], t["input"], t["weight"], [case.spec().out_channels],
                                  transposed=case.transposed, backend=backend,
                                  **{**case.kwargs(), "output_padding": case.output_padding})
    return {"grad_input": gi, "grad_weight": gw, "grad_bias": gb}


@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("case", CASES, ids=str)
def test_conv_backward_matches_autograd_float64(case: Case, backend: str) -> None:
    t, ref = tensors_and_reference(case)
    assert_matches_autograd(_ours(case, t, backend), ref, torch.float64, f"{backend} {case}")


@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("case", grid_cases()[::5], ids=str)
def test_conv_backward_matches_autograd_float32(case: Case, backend: str) -> None:
    t, ref = tensors_and_reference(case, torch.float32)
    assert_matches_autograd(_ours(case, t, backend), ref, torch.float32, f"{backend} {case}")


# the helpers run the same backend code as conv_backward with an output_mask (the float64 grid above, in full)
@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("case", grid_params(grid_cases()), ids=str)
def test_single_gradient_helpers_match_conv_backward(case: Case, backend: str) -> None:
    """conv_input_grad / conv_weight_grad (and the transposed pair) agree with autograd too."""
    t, ref = tensors_and_reference(case)
    spec = case.spec()
    if case.transposed:
        kw = dict(stride=case.stride, padding=case.padding, output_padding=case.output_padding, groups=case.groups,
                  dilation=case.dilation, backend=backend)
        gi = cg.conv_transpose_input_grad(case.input_shape, t["weight"], t["grad_output"], **kw)
        gw = cg.conv_transpose_weight_grad(t["input"], case.weight_shape, t["grad_output"], **kw)
    else:
        kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups,
                  backend=backend)
        gi = cg.conv_input_grad(case.input_shape, t["weight"], t["grad_output"], **kw)
        gw = cg.conv_weight_grad(t["input"], case.weight_shape, t["grad_output"], **kw)
    ours = {"grad_input": gi, "grad_weight": gw}
    if not spec.unbatched:
        ours["grad_bias"] = cg.conv_bias_grad(t["grad_output"])
    assert_matches_autograd(ours, ref, torch.float64, f"{backend} {case}")


@pytest.mark.parametrize("mask", [(True, False, False), (False, True, False), (False, False, True),
                                  (False, False, False), (True, True, False)])
@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
def test_output_mask_returns_none_for_masked_gradients(mask: tuple[bool, bool, bool], backend: str) -> None:
    case = grid_cases()[1]
    t = make_tensors(case)
    ref = reference_grads(case, t)
    grads = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, stride=case.stride,
                             output_mask=mask, backend=backend)
    for m, g, name in zip(mask, grads, ["grad_input", "grad_weight", "grad_bias"]):
        if m:
            torch.testing.assert_close(g, ref[name], **{"rtol": 1e-7, "atol": 1e-9})
        else:
            assert g is None


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_nn_grad_names_match_torch(n: int) -> None:
    """conv{n}d_input / conv{n}d_weight agree with torch.nn.grad on a strided, grouped, dilated case."""
    case = grid_cases()[[c.name for c in grid_cases()].index(f"{n}d-groups2-cin4")]
    t = make_tensors(case)
    kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups)
    ours_i = getattr(cg, f"conv{n}d_input")(case.input_shape, t["weight"], t["grad_output"], **kw)
    ours_w = getattr(cg, f"conv{n}d_weight")(t["input"], case.weight_shape, t["grad_output"], **kw)
    torch.testing.assert_close(ours_i, getattr(torch.nn.grad, f"conv{n}d_input")(
        case.input_shape, t["weight"], t["grad_output"], **kw))
    torch.testing.assert_close(ours_w, getattr(torch.nn.grad, f"conv{n}d_weight")(
        t["input"], case.weight_shape, t["grad_output"], **kw))


def test_the_fast_tiers_representative_cases_are_grid_cases() -> None:
    """helpers.grid_params keeps these in the fast tier by name: a renamed or dropped case would leave its class to
    the slow tier alone."""
    names = {case.name for case in grid_cases()}
    assert REPRESENTATIVE <= names, sorted(REPRESENTATIVE - names)
    for n in (1, 2, 3):  # every dimension, forward and transposed
        assert any(name.startswith(f"{n}d-") and "-T-" not in name for name in REPRESENTATIVE), n
        assert any(name.startswith(f"{n}d-T-") for name in REPRESENTATIVE), n
