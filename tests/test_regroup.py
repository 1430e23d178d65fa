"""The regroup backend with its merges forced: every hard case with 1 < groups, gradcheck, gradgradcheck, vmap.

Registered, it also runs the whole grid (tests/test_grid.py) and every ecosystem test, but there its rule picks no
merge for the grid's few channels per group (merge 1: native's own call); here the groups are merged.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad.backends import regroup
from convgrad.spec import ConvSpec
from helpers import assert_gradchecks, assert_matches_autograd, grid_cases, make_tensors, random_cases, reference_grads

GROUPED = [c for c in grid_cases() + random_cases(60, seed=99) if c.groups > 1]


@pytest.fixture
def merge(request: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """Merge this many groups wherever they divide the groups (all of them where they do not)."""
    m = request.param
    monkeypatch.setattr(regroup, "merge_factor", lambda spec: m if spec.groups % m == 0 else spec.groups)
    return m


@pytest.mark.parametrize("merge", [2, 3], indirect=True)
@pytest.mark.parametrize("case", GROUPED, ids=str)
def test_merged_groups_match_autograd_float64(merge: int, case: Any) -> None:
    t = make_tensors(case)
    gi, gw, gb = cg.conv_backward(t["grad_output"], t["input"], t["weight"], [case.spec().out_channels],
                                  transposed=case.transposed, backend="regroup",
                                  **{**case.kwargs(), "output_padding": case.output_padding})
    assert regroup.plan(case.spec()).run.spec.groups < case.groups
    assert_matches_autograd({"grad_input": gi, "grad_weight": gw, "grad_bias": gb}, reference_grads(case, t),
                            torch.float64, f"regroup merge {merge} {case}")


@pytest.mark.parametrize("merge", [2], indirect=True)
@pytest.mark.parametrize(("xs", "ws", "kw"), [
    ((2, 4, 7), (6, 2, 3), dict(stride=2, groups=2, padding=((0, 1),))),
    ((1, 4, 5, 4), (4, 1, 2, 3), dict(groups=4, stride=2, dilation=(2, 1), padding=1)),
    # 3d: its first derivatives run in the fast tier (the grid above), the costly gradgradcheck in the slow one
    pytest.param((1, 4, 3, 3, 4), (8, 2, 2, 2, 2), dict(groups=2, stride=(1, 2, 1), padding=((1, 0), (0, 1), (1, 1))),
                 marks=pytest.mark.slow),
], ids=str)
def test_merged_groups_pass_gradcheck_and_gradgradcheck(merge: int, xs: tuple, ws: tuple, kw: dict) -> None:
    assert_gradchecks("regroup", xs, ws, kw)


@pytest.mark.parametrize("merge", [2], indirect=True)
def test_merged_groups_transposed_gradcheck(merge: int) -> None:
    assert_gradchecks("regroup", (1, 4, 3, 3), (4, 3, 3, 2), dict(stride=2, groups=2, output_padding=1),
                      transposed=True, bias=False, seed=2)


@pytest.mark.parametrize("merge", [2], indirect=True)
def test_merged_groups_under_vmap_and_grad(merge: int) -> None:
    """torch.func: per-sample weight gradients through the regrouped backward equal native's."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(3, 4, 6, 6, generator=g, dtype=torch.float64), torch.randn(6, 2, 3, 3, generator=g,
                                                                               dtype=torch.float64)

    def loss(w: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        return (cg.conv(x.unsqueeze(0), w, groups=2, padding=1, backend=backend) ** 2).sum()

    ours = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(w, x, "regroup")
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(w, x, "native")
    torch.testing.assert_close(ours, ref)


def test_merge_factor_reaches_sixteen_channels_within_four_groups() -> None:
    def spec(cin: int, groups: int, cout: int | None = None) -> ConvSpec:
        return ConvSpec.from_shapes((1, cin, 8, 8), ((cout or cin), cin // groups, 3, 3), groups=groups)

    assert regroup.merge_factor(spec(64, 8)) == 2  # 8 per group -> 16
    assert regroup.merge_factor(spec(128, 32)) == 4  # 4 per group -> 16
    assert regroup.merge_factor(spec(60, 4)) == 2  # 15 per group -> 30
    assert regroup.merge_factor(spec(15, 3)) == 1  # 5 per group: 3 groups of 5 make 15 < 16
    assert regroup.merge_factor(spec(64, 64)) == 1  # depthwise: 16 groups would be 16x the multiply-adds
    assert regroup.merge_factor(spec(64, 4)) == 1  # 16 per group already
    assert regroup.merge_factor(spec(64, 8, cout=16)) == 1  # 2 output channels per group: 4 groups make 8 < 16
    like = torch.zeros(1)
    assert regroup.RegroupBackend.can_serve(spec(64, 8), like)
    assert not regroup.RegroupBackend.can_serve(spec(64, 8), like.double())
    assert not regroup.RegroupBackend.can_serve(spec(64, 64), like)


def test_plan_describes_its_steps() -> None:
    p = regroup.plan(ConvSpec.from_shapes((2, 32, 6, 6), (32, 4, 3, 3), groups=8))
    lines = p.describe().splitlines()
    assert len(lines) == 3 and "merge the 8 groups 4 at a time" in lines[0]
    assert lines[1].endswith("groups=2") and "diagonal blocks" in lines[2]
