"""Property-based fuzzing of every per-sample method against a loop of torch autograd over single samples.

The convolutions are test_fuzz's (``cases``: dims 1-3, forward or transposed, stride and dilation 1-4, every padding
form, groups and depthwise, batch 0-3), batched; float64. Each per-sample method ("unfold", "conv", "native",
"fft") gives each sample's weight gradient, and each norm method ("ghost" too) its norm. The profile is test_fuzz's
(``CONVGRAD_FUZZ_PROFILE``, tests/conftest.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from hypothesis import given
from hypothesis import strategies as st

import convgrad as cg
from helpers import TOL, Case, make_tensors, per_sample_reference
from test_fuzz import cases

DT = torch.float64
METHODS = ("unfold", "conv", "native", "fft")


@st.composite
def batched(draw: Any) -> Case:
    case = draw(cases())
    if case.spec().unbatched:  # per-sample gradients need a batch dim: the same sample as a batch of 1
        case = dataclasses.replace(case, input_shape=(1, *case.input_shape))
    return case


@given(case=batched(), seed=st.integers(0, 2**16))
def test_every_per_sample_method_matches_a_loop_of_autograd(case: Case, seed: int) -> None:
    t = make_tensors(case, DT, seed=seed)
    ref = per_sample_reference(case, t)
    kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups,
              transposed=case.transposed, output_padding=case.output_padding)
    for method in METHODS:
        gw = cg.per_sample_weight_grad(t["input"], case.weight_shape, t["grad_output"], method=method, **kw)
        torch.testing.assert_close(gw, ref, **TOL[DT], msg=lambda m, k=method: f"{case} {k}: {m}")
    for method in ("ghost", *METHODS):
        norms = cg.per_sample_grad_norms(t["input"], case.weight_shape, t["grad_output"], bias=False, method=method,
                                         **kw)
        torch.testing.assert_close(norms, ref.flatten(1).norm(dim=1), **TOL[DT],
                                   msg=lambda m, k=method: f"{case} {k} norms: {m}")
