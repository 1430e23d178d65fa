"""The fwdconv plans: which formulation the rules pick, that every formulation matches autograd, and forward ops only.

Covers the polyphase geometry of spec/formulation.py (empty phases, gcd(s, d) > 1, d not dividing s, phases
whose window lies in the padding, 3d), every forced method on the whole grid, channels_last,
double backward through each formulation, and a TorchDispatchMode proof that fwdconv never runs
aten.convolution_backward nor a transposed aten.convolution.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import convgrad as cg
from convgrad.backends.fwdconv import (
    INPUT_METHODS,
    WEIGHT_METHODS,
    BatchFold,
    contractions,
    execute,
    grad_input,
    grad_weight,
    plan_input_grad,
    plan_weight_grad,
)
from convgrad.backends.fwdconv.plan import Chain
from convgrad.errors import MethodRefused
from convgrad.spec import ConvSpec
from helpers import TOL, Case, assert_matches_autograd, grid_cases, make_tensors, random_cases, reference_grads

# shapes that hit every phase situation of the polyphase grad of x
PHASE_CASES = [
    Case((2, 3, 9, 9), (4, 3, 1, 1), stride=2, name="1x1-s2-one-live-phase"),
    Case((2, 2, 11), (3, 2, 2), stride=3, padding=1, name="k2-s3-empty-phases"),
    Case((2, 2, 13), (3, 2, 3), stride=4, dilation=2, padding=2, name="gcd2-s4-d2"),
    Case((2, 2, 12), (2, 2, 3), stride=2, dilation=2, name="gcd2-s2-d2"),
    Case((2, 2, 14), (3, 2, 3), stride=2, dilation=3, padding=((4, 1),), name="d3-s2-dilated-phases"),
    Case((2, 2, 3), (2, 2, 2), stride=4, padding=3, name="windows-in-padding"),
    Case((1, 2, 2), (2, 2, 3), stride=3, padding=2, name="input-shorter-than-stride"),
    Case((2, 4, 7, 6, 5), (4, 2, 3, 2, 3), stride=(2, 3, 2), dilation=(1, 2, 2), padding=(1, 0, 2), groups=2,
         name="3d-mixed-phases"),
    Case((2, 3, 8, 8), (6, 1, 3, 3), stride=2, padding=1, groups=3, name="depthwise-multiplier-s2"),
    Case((2, 3, 10, 9), (4, 3, 7, 7), stride=2, padding=3, name="stem-like-7x7-s2"),
    Case((2, 1, 31), (4, 1, 10), stride=5, name="wav2vec-like-k10-s5"),
    Case((1, 1, 1), (1, 1, 3), stride=2, padding=((3, 0),), name="cropping-x-first-would-empty-it"),
    Case((2, 2, 23), (3, 2, 4), stride=5, dilation=2, padding=1, name="s5-d2-inverse-of-d-is-not-d"),
]


def _spec(input_shape: tuple[int, ...], weight_shape: tuple[int, ...], **kw: Any) -> ConvSpec:
    return ConvSpec.from_shapes(input_shape, weight_shape, **kw)


@pytest.mark.parametrize(("spec", "method"), [
    (_spec((8, 64, 56, 56), (64, 64, 3, 3), padding=1), "direct"),
    (_spec((8, 128, 56, 56), (128, 128, 3, 3), stride=2, padding=1), "polyphase"),
    (_spec((8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3), "subpixel"),
    (_spec((16, 144, 56, 56), (144, 1, 3, 3), stride=2, padding=1, groups=144), "polyphase"),  # depthwise
    (_spec((8, 256, 56, 56), (64, 256, 1, 1)), "matmul"),
    (_spec((8, 256, 56, 56), (512, 256, 1, 1), stride=2), "polyphase"),
    (_spec((4, 1, 16000), (512, 1, 10), stride=5), "subpixel"),
    (_spec((2, 4, 9), (3, 4, 3), stride=2, dilation=3), "polyphase"),  # d does not divide s: no sub-pixel
    (_spec((2, 15, 9, 9), (8, 15, 3, 3), stride=2), "subpixel"),  # below SUBPIXEL_MAX_CHANNELS = 16
    (_spec((2, 16, 9, 9), (8, 16, 3, 3), stride=2), "polyphase"),
], ids=lambda v: v if isinstance(v, str) else v.describe())
def test_input_rules_pick_the_expected_formulation(spec: ConvSpec, method: str) -> None:
    assert plan_input_grad(spec).method == method


@pytest.mark.parametrize(("spec", "plan", "first", "last"), [
    (_spec((2, 8, 9, 9), (8, 8, 1, 1)), plan_input_grad, "stride 1 and a 1x1", "a matmul"),
    (_spec((2, 8, 9, 9), (8, 8, 3, 3)), plan_input_grad, "stride 1: no zeros", "to insert"),
    (_spec((2, 3, 9, 9), (8, 3, 3, 3), stride=2), plan_input_grad, "strided, fewer than 16", "one fused conv"),
    (_spec((2, 32, 9, 9), (8, 32, 3, 3), stride=2), plan_input_grad, "strided: one conv per phase", "inserted zeros"),
    (_spec((8, 64, 9, 9), (64, 64, 1, 1)), plan_weight_grad, "tap windows do not overlap", "; a matmul"),
    (_spec((2, 6, 5, 9, 8), (6, 1, 3, 3, 3), stride=(1, 2, 2), padding=1, groups=6), plan_weight_grad,
     "strided 3d depthwise", "not dilated ones"),
    (_spec((8, 3, 9, 9), (8, 3, 3, 3)), plan_weight_grad, "at most 3 input channels per group", "convs, summed"),
    (_spec((8, 64, 33, 33), (64, 64, 3, 3), padding=2, dilation=2), plan_weight_grad, "dilated, stride 1",
     "a small stride-1 one"),
    (_spec((2, 64, 9, 9), (64, 64, 3, 3)), plan_weight_grad, "batch of at most 2", "convs, summed"),
    (_spec((8, 64, 9, 9), (64, 64, 3, 3)), plan_weight_grad, "grad_output as the kernel", "into channels"),
], ids=lambda v: v if isinstance(v, str) else getattr(v, "__name__", None) or v.describe())
def test_each_rule_gives_its_reason(spec: ConvSpec, plan: Any, first: str, last: str) -> None:
    """The reason explain prints beside the formulation a rule chose (its wording, at both ends)."""
    reason = plan(spec).reason
    assert reason.startswith(first) and reason.endswith(last), reason


def test_strided_1x1_grad_input_is_one_matmul_phase_and_zeros() -> None:
    conv = plan_input_grad(_spec((8, 256, 56, 56), (512, 256, 1, 1), stride=2)).conv
    live = [p for p in conv.phases if p is not None]
    assert len(conv.phases) == 4 and len(live) == 1 and type(live[0].conv).__name__ == "MatMul"
    assert plan_input_grad(_spec((8, 256, 56, 56), (512, 256, 1, 1), stride=2)).post_steps == ()


@pytest.mark.parametrize(("spec", "method"), [
    (_spec((8, 64, 56, 56), (64, 64, 3, 3), padding=1), "kernel"),
    (_spec((8, 256, 56, 56), (64, 256, 1, 1)), "taps"),
    (_spec((8, 256, 56, 56), (512, 256, 1, 1), stride=2), "taps"),
    (_spec((2, 1024, 28, 28), (1024, 512, 2, 2), stride=2, transposed=True), "taps"),
    (_spec((16, 144, 56, 56), (144, 1, 3, 3), padding=1, groups=144), "per_sample"),
    (_spec((1, 2048, 33, 33), (256, 2048, 3, 3), padding=12, dilation=12), "blocks"),
    (_spec((8, 128, 56, 56), (128, 4, 3, 3), padding=1, groups=32), "kernel"),
    (_spec((8, 3, 224, 224), (64, 3, 7, 7), stride=2, padding=3), "per_sample"),  # RGB stem
    (_spec((4, 1, 16000), (512, 1, 10), stride=5), "per_sample"),  # C_in = 1
    (_spec((2, 128, 8, 28, 28), (128, 128, 3, 3, 3), padding=1), "per_sample"),  # batch 2
    # the edges of each rule
    (_spec((8, 64, 28, 28), (64, 64, 2, 2), stride=2), "taps"),  # k = s: windows tile x exactly
    (_spec((8, 64, 28, 28), (64, 64, 3, 2), stride=(3, 2)), "taps"),  # taps = prod(stride) per dim product
    (_spec((8, 64, 28, 28), (64, 64, 3, 3), stride=2, padding=1), "kernel"),  # 9 taps > 4: windows overlap
    (_spec((2, 6, 5, 9, 8), (6, 1, 3, 3, 3), stride=(1, 2, 2), padding=1, groups=6), "phases"),  # X3D-like
    (_spec((2, 6, 5, 9, 8), (6, 1, 3, 3, 3), stride=(1, 2, 2), padding=2, dilation=2, groups=6), "per_sample"),
    (_spec((2, 6, 5, 9, 8), (6, 1, 3, 3, 3), padding=1, groups=6), "per_sample"),  # stride 1: no phases
    (_spec((2, 6, 9, 8), (6, 1, 3, 3), stride=2, padding=1, groups=6), "per_sample"),  # 2d: phases lose
    (_spec((8, 12, 5, 9, 8), (12, 6, 3, 3, 3), stride=2, padding=1, groups=2), "kernel"),  # 6 channels per group
    (_spec((8, 12, 9, 9), (12, 3, 3, 3), padding=1, groups=4), "per_sample"),  # 3 input channels per group
    (_spec((8, 16, 9, 9), (12, 4, 3, 3), padding=1, groups=4), "kernel"),  # 4 per group
    (_spec((8, 64, 33, 33), (64, 64, 3, 3), padding=2, dilation=2), "blocks"),  # dilation 2 is enough
    (_spec((8, 64, 33, 33), (64, 64, 3, 3), stride=(1, 2), padding=2, dilation=2), "kernel"),  # strided: no blocks
    (_spec((3, 64, 28, 28), (64, 64, 3, 3), padding=1), "kernel"),  # batch 3 > PER_SAMPLE_MAX_BATCH
    (_spec((2, 64, 28, 28), (64, 64, 3, 3), padding=1), "per_sample"),  # batch 2
], ids=lambda v: v if isinstance(v, str) else v.describe())
def test_weight_rules_pick_the_expected_formulation(spec: ConvSpec, method: str) -> None:
    assert plan_weight_grad(spec).method == method


@pytest.mark.parametrize(("spec", "dtype", "method"), [
    (_spec((4, 144, 56, 56), (144, 1, 3, 3), padding=1, groups=144), torch.float64, "taps"),  # depthwise
    (_spec((8, 256, 28, 28), (256, 8, 3, 3), padding=1, groups=32), torch.float64, "taps"),  # ResNeXt
    (_spec((8, 64, 56, 56), (64, 64, 3, 3), padding=1), torch.float64, "taps"),
    (_spec((16, 144, 56, 56), (144, 1, 3, 3), padding=1, groups=144), torch.float32, None),  # oneDNN: the rules
    (_spec((4, 1, 16000), (512, 1, 10), stride=5), torch.float64, None),  # one input channel
    (_spec((2, 8, 9, 9), (8, 8, 3, 3), padding=1), torch.float32, None),  # oneDNN, however small
    (_spec((2, 8, 9, 9), (8, 8, 3, 3), padding=1), torch.bfloat16, None),
    (_spec((2, 8, 9, 9), (8, 8, 3, 3), padding=1), torch.float16, "taps"),
    (_spec((8, 256, 56, 56), (256, 256, 3, 3), padding=1), torch.float64, None),  # 58M folded > TAPS_MAX_ELEMENTS
    (_spec((2, 256, 256, 256), (8, 256, 1, 1)), torch.float64, "taps"),  # exactly TAPS_MAX_ELEMENTS = 2**25
], ids=str)
def test_non_onednn_dtypes_fold_the_taps_for_grad_weight(spec: ConvSpec, dtype: torch.dtype,
                                                          method: str | None) -> None:
    assert grad_weight.im2col_weight_method(spec, torch.empty(0, dtype=dtype)) == method


def test_the_im2col_rule_is_for_the_cpu_only() -> None:
    spec = _spec((2, 8, 9, 9), (8, 8, 3, 3), padding=1)
    assert grad_weight.im2col_weight_method(spec, torch.empty(0, dtype=torch.float64)) == "taps"
    assert grad_weight.im2col_weight_method(spec, torch.empty(0, dtype=torch.float64, device="meta")) is None


def test_depthwise_one_tap_phase_is_a_per_channel_scale() -> None:
    conv = plan_input_grad(_spec((16, 144, 56, 56), (144, 1, 3, 3), stride=2, padding=1, groups=144)).conv
    kinds = sorted(type(p.conv).__name__ for p in conv.phases)
    # phase (0, 0) gets one tap of each channel's kernel; the others 2, 2 and 4 taps, summed tap by tap
    assert kinds == ["DepthwiseTaps", "DepthwiseTaps", "DepthwiseTaps", "MatMul"]


PAIRED_CASES = [  # stride 2 in the last dim and an even big side: both phases of a row written as one complex
    Case((2, 6, 8, 8), (6, 1, 3, 3), stride=2, padding=1, groups=6, name="depthwise-3x3-s2"),
    Case((2, 4, 6, 10), (5, 4, 3, 2), stride=(3, 2), padding=(1, 0), name="s3x2-even-kernel"),
    Case((2, 3, 12), (4, 3, 3), stride=2, dilation=3, padding=2, name="1d-d3-s2"),
    Case((1, 4, 4, 6, 8), (4, 2, 3, 3, 3), stride=2, padding=1, groups=2, name="3d-grouped-s2"),
]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", PAIRED_CASES, ids=str)
def test_paired_phases_written_as_complex_match_autograd_and_the_plain_writes(case: Case, dtype: torch.dtype,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_input_grad(case.spec(), "polyphase")
    t = make_tensors(case, dtype)
    assert plan.conv._pairs_as_complex(torch.empty(plan.shape, dtype=dtype), t["grad_output"], t["weight"])
    paired = execute(plan, t["grad_output"], t["weight"])
    assert_matches_autograd({"grad_input": paired}, reference_grads(case, t), dtype, f"paired {case}")
    monkeypatch.setattr(type(plan.conv), "_pairs_as_complex", lambda *a: False)
    plain = execute(plan, t["grad_output"], t["weight"])
    assert paired.dtype == plain.dtype == dtype and torch.allclose(paired, plain, **TOL[dtype])


CHUNKED_CASES = [  # memory-bound phases (<= CHUNK_MAX_CHANNELS channels of y per group), 5 samples: chunks 2, 2, 1
    Case((5, 6, 8, 8), (6, 1, 3, 3), stride=2, padding=1, groups=6, name="depthwise-3x3-s2"),
    Case((5, 4, 9), (4, 1, 3), stride=2, padding=1, groups=4, name="1d-depthwise-odd"),
    Case((5, 4, 5, 7, 6), (4, 2, 3, 2, 3), stride=(2, 3, 2), padding=(1, 0, 1), groups=2, name="3d-grouped-uneven"),
    Case((5, 4, 7, 7), (4, 1, 3, 3), stride=2, dilation=2, padding=2, groups=4, name="depthwise-s2-d2"),
]


@pytest.mark.parametrize(("spec", "chunked"), [
    (_spec((16, 144, 56, 56), (144, 1, 3, 3), stride=2, padding=1, groups=144), True),  # depthwise
    (_spec((16, 256, 56, 56), (256, 8, 3, 3), stride=2, padding=1, groups=32), True),  # 8 channels per group
    (_spec((16, 32, 56, 56), (32, 16, 3, 3), stride=2, padding=1, groups=2), False),  # 16 per group: conv-bound
    (_spec((8, 128, 56, 56), (128, 128, 3, 3), stride=2, padding=1), False),  # ResNet-50's 3x3/2
])
def test_only_memory_bound_phases_run_in_batch_chunks(spec: ConvSpec, chunked: bool) -> None:
    conv = plan_input_grad(spec, "polyphase").conv
    assert conv.chunked is chunked
    assert ("a few samples at a time" in conv.describe()) is chunked


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", CHUNKED_CASES, ids=str)
def test_batch_chunks_match_autograd_and_the_whole_batch(case: Case, dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    plan = plan_input_grad(case.spec(), "polyphase")
    assert plan.conv.chunked
    t = make_tensors(case, dtype)
    out, gy = torch.empty(plan.shape, dtype=dtype), t["grad_output"]
    per_sample = (2 * out[0].numel() + gy[0].numel()) * out.element_size()
    monkeypatch.setattr(contractions, "CHUNK_BYTES", 2 * per_sample + 1)
    assert plan.conv.batch_chunk(out, gy) == 2
    chunks: list[int] = []
    for name in ("_write_pairs", "_write_phases"):
        method = getattr(type(plan.conv), name)
        monkeypatch.setattr(type(plan.conv), name,
                            lambda self, o, *a, m=method: (chunks.append(o.shape[0]), m(self, o, *a))[1])
    chunked = execute(plan, gy, t["weight"])
    assert chunks == [2, 2, 1]
    assert_matches_autograd({"grad_input": chunked}, reference_grads(case, t), dtype, f"chunked {case}")
    monkeypatch.setattr(contractions, "CHUNK_BYTES", 2**40)
    whole = execute(plan, gy, t["weight"])
    assert chunks[3:] == [5] and torch.equal(chunked, whole)


@pytest.mark.parametrize("fast_mode", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_batch_chunks_keep_double_backward_and_batch_zero(monkeypatch: pytest.MonkeyPatch, fast_mode: bool) -> None:
    """gradcheck's fast mode (a random projection of the Jacobian) in the fast tier, the whole Jacobian in the slow."""
    monkeypatch.setattr(contractions, "CHUNK_BYTES", 1)  # one sample per chunk
    case = CHUNKED_CASES[0]
    gy = make_tensors(case)["grad_output"][:2].requires_grad_()
    w = make_tensors(case)["weight"].requires_grad_()

    def input_grad(gy: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        shape = (gy.shape[0], *case.input_shape[1:])
        return cg.conv_input_grad(shape, w, gy, stride=2, padding=1, groups=6, backend="fwdconv")

    assert torch.autograd.gradcheck(input_grad, (gy, w), fast_mode=fast_mode)
    assert torch.autograd.gradgradcheck(input_grad, (gy, w), fast_mode=fast_mode)
    empty = input_grad(gy[:0].detach(), w.detach())
    assert empty.shape == (0, *case.input_shape[1:])


def test_paired_phases_fall_back_while_a_graph_is_being_built() -> None:
    case = PAIRED_CASES[0]
    plan = plan_input_grad(case.spec(), "polyphase")
    t = make_tensors(case)
    gy = t["grad_output"].requires_grad_()
    assert not plan.conv._pairs_as_complex(torch.empty(plan.shape, dtype=gy.dtype), gy, t["weight"])
    out = execute(plan, gy, t["weight"])
    assert out.grad_fn is not None  # differentiable: double backward goes through it


def _depthwise_s2(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return cg.conv2d(a, w, stride=2, padding=1, groups=2, backend="fwdconv")


def test_paired_phases_under_vmap_jacrev_and_forward_ad() -> None:
    """Transforms see through none of torch.complex's out=: the plain writes run under them (even sizes, stride 2)."""
    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((1, 2, 4, 4), (2, 1, 3, 3)))
    ref = torch.func.jacrev(lambda a: torch.nn.functional.conv2d(a, w, stride=2, padding=1, groups=2))(x)
    assert torch.allclose(torch.func.jacrev(lambda a: _depthwise_s2(a, w))(x), ref)
    assert torch.allclose(torch.func.hessian(lambda a: _depthwise_s2(a, w).pow(2).sum())(x).sum(), torch.func.hessian(
        lambda a: torch.nn.functional.conv2d(a, w, stride=2, padding=1, groups=2).pow(2).sum())(x).sum())
    gy, t = (torch.randn(2, 2, 2, 2, generator=g, dtype=torch.float64) for _ in range(2))

    def input_grad(v: torch.Tensor) -> torch.Tensor:
        return cg.conv_input_grad((2, 2, 4, 4), w, v, stride=2, padding=1, groups=2, backend="fwdconv")

    _, tangent = torch.func.jvp(input_grad, (gy,), (t,))
    assert torch.allclose(tangent, input_grad(t))  # linear in grad_output: the tangent is the map applied to t
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(gy, t)
        assert torch.allclose(torch.autograd.forward_ad.unpack_dual(input_grad(dual)).tangent, input_grad(t))
    batched = torch.func.vmap(input_grad)(torch.stack([gy, t]))
    assert torch.allclose(batched, torch.stack([input_grad(gy), input_grad(t)]))


def _forward(cases: list[Case]) -> list[Case]:
    """The forward convolutions: a transposed one's grad_input is a forward conv itself (no phases, no methods)."""
    return [c for c in cases if not c.transposed]


@pytest.mark.parametrize("case", _forward([*PHASE_CASES, *random_cases(12, seed=44)]), ids=str)
def test_phase_taps_are_exactly_the_taps_that_reach_each_row(case: Case) -> None:
    """Brute force: row u of x gets tap t from output j exactly when u + p_lo = j*s + t*d with 0 <= j < o."""
    spec = case.spec()
    for dim, phases in enumerate(spec.phases):
        i, k, s, d, (lo, _), o = (spec.x_size[dim], spec.kernel_size[dim], spec.stride[dim], spec.dilation[dim],
                                  spec.padding[dim], spec.y_size[dim])
        g = math.gcd(s, d)
        assert sum(p is not None for p in phases) <= s // g
        for u in range(i):
            reach = {t for t in range(k) if (u + lo - t * d) % s == 0 and 0 <= (u + lo - t * d) // s < o}
            p = phases[u % s]
            if p is None:
                assert not reach, (dim, u)
                continue
            taps = {k - 1 - (p.first + p.step * q) for q in range(p.count)}  # unflipped
            assert reach <= taps and all((u + lo - t * d) % s == 0 for t in taps), (dim, u, reach, p)


def _execute_checking_shapes(plan: Any, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """``execute``, asserting that every step and the contraction give the shape they declare (the shapes that the
    recipe's text, script and pictures show, which the computation alone never reads)."""
    if plan.conv is None:
        return execute(plan, data, kernel)
    for path, steps in (("data", plan.data_steps), ("kernel", plan.kernel_steps)):
        for step in steps:
            if path == "data":
                data = step(data)
                got = data.shape
            else:
                kernel = step(kernel)
                got = kernel.shape
            assert tuple(got) == tuple(step.shape), (path, step)
    out = plan.conv(data, kernel)
    assert tuple(out.shape) == tuple(plan.conv.shape), plan.conv
    for step in plan.post_steps:
        out = step(out)
        assert tuple(out.shape) == tuple(step.shape), step
    return out


def _forced_cases() -> list[Case]:
    return [*PHASE_CASES, *grid_cases()]


def _input_method_cases(serves: bool) -> list[Any]:
    """(case, method) for every forward case and input formulation that serves it (or, serves=False, refuses it:
    sub-pixel needs every phase at dilation 1)."""
    return [pytest.param(c, m, id=f"{c}-{m}") for c in _forward(_forced_cases()) for m in INPUT_METHODS
            if (m != "subpixel" or c.spec().subpixel_taps is not None) is serves]


@pytest.mark.parametrize(("case", "method"), _input_method_cases(serves=True))
def test_every_input_formulation_matches_autograd(case: Case, method: str) -> None:
    spec = case.spec()
    plan = plan_input_grad(spec, method)
    assert plan.method == ("direct" if method == "zero_insert" and max(spec.stride) == 1 else method)  # no zeros
    t = make_tensors(case)
    gy = t["grad_output"].unsqueeze(0) if spec.unbatched else t["grad_output"]
    gi = _execute_checking_shapes(plan, gy, t["weight"])
    gi = gi.squeeze(0) if spec.unbatched else gi
    assert_matches_autograd({"grad_input": gi}, reference_grads(case, t), torch.float64, f"{method} {case}")


@pytest.mark.parametrize(("case", "method"), _input_method_cases(serves=False))
def test_an_input_formulation_that_cannot_serve_is_refused(case: Case, method: str) -> None:
    with pytest.raises(MethodRefused) as refused:
        plan_input_grad(case.spec(), method)
    assert refused.value.method == method


def _refuses(method: str, spec: Any) -> bool:
    """The weight formulations that cannot serve a spec: blocks needs stride 1, phases dilation 1."""
    return (method == "blocks" and any(s > 1 for s in spec.stride)) or (
        method == "phases" and any(d > 1 for d in spec.dilation))


def _weight_method_cases(serves: bool) -> list[Any]:
    """(case, method) for every case and weight formulation that serves it (or, serves=False, refuses it)."""
    return [pytest.param(c, m, id=f"{c}-{m}") for c in _forced_cases() for m in WEIGHT_METHODS
            if (not _refuses(m, c.spec())) is serves]


@pytest.mark.parametrize(("case", "method"), _weight_method_cases(serves=False))
def test_a_weight_formulation_that_cannot_serve_is_refused(case: Case, method: str) -> None:
    with pytest.raises(MethodRefused) as refused:
        plan_weight_grad(case.spec(), method)
    assert refused.value.method == method


@pytest.mark.parametrize(("case", "method"), _weight_method_cases(serves=True))
def test_every_weight_formulation_matches_autograd(case: Case, method: str) -> None:
    spec = case.spec()
    plan = plan_weight_grad(spec, method)
    assert plan.method == ("empty" if spec.batch == 0 else method)
    t = make_tensors(case)
    x, gy = t["input"], t["grad_output"]
    if spec.unbatched:
        x, gy = x.unsqueeze(0), gy.unsqueeze(0)
    gw = _execute_checking_shapes(plan, *((gy, x) if spec.transposed else (x, gy)))
    assert_matches_autograd({"grad_weight": gw}, reference_grads(case, t), torch.float64, f"{method} {case}")


@pytest.mark.parametrize("batch", [0, 2])
def test_a_method_that_cannot_serve_is_refused_at_every_batch(batch: int) -> None:
    """A batch of 0 has an empty plan, but a forced method the layer rules out is still an error (found by a
    helper: batch 0 accepted 'bogus', 'phases' with dilation and 'blocks' with stride)."""
    spec = _spec((batch, 4, 9, 9, 9), (4, 1, 3, 3, 3), stride=2, padding=1, dilation=2, groups=4)
    for method, reason in (("phases", "needs dilation 1 in every dim"), ("blocks", "needs stride 1 in every dim")):
        with pytest.raises(MethodRefused) as refused:
            plan_weight_grad(spec, method)
        assert (refused.value.method, refused.value.reason) == (method, reason)
    with pytest.raises(ValueError, match="method='bogus'"):
        plan_weight_grad(spec, "bogus")
    assert plan_weight_grad(spec, "kernel").method == ("empty" if batch == 0 else "kernel")


def test_unknown_methods_are_refused() -> None:
    spec = _spec((1, 1, 5), (1, 1, 3))
    with pytest.raises(ValueError, match="method='magic'"):
        plan_input_grad(spec, "magic")
    with pytest.raises(ValueError, match="method='magic'"):
        plan_weight_grad(spec, "magic")


@pytest.mark.parametrize("shape, weight, kw", [
    ((2, 8, 9, 9), (6, 8, 3, 3), dict(stride=2, padding=1)),  # polyphase
    ((2, 3, 9, 9), (6, 3, 3, 3), dict(stride=2, padding=1)),  # sub-pixel
    ((2, 8, 9, 9), (6, 8, 1, 1), {}),  # pointwise matmul
    ((2, 8, 9, 9), (6, 8, 1, 1), dict(stride=2)),  # one live matmul phase
    ((2, 8, 5, 9, 9), (6, 8, 3, 3, 3), dict(stride=2, padding=1)),  # 3d
])
def test_channels_last_grad_input_stays_channels_last(shape: tuple[int, ...], weight: tuple[int, ...],
                                                      kw: dict[str, Any]) -> None:
    """float32: torch's own float64 3d conv returns contiguous tensors whatever its input."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    spec = _spec(shape, weight, **kw)
    w = torch.randn(weight)
    gy = torch.randn(spec.output_shape).contiguous(memory_format=fmt)
    gi = cg.backends.get_backend("fwdconv").input_grad(spec, w, gy)
    assert gi.is_contiguous(memory_format=fmt), plan_input_grad(spec).method
    expected = cg.backends.get_backend("native").input_grad(spec, w, gy.contiguous())
    torch.testing.assert_close(gi, expected, **TOL[torch.float32])


@pytest.mark.parametrize("shape, weight, kw", [
    ((2, 6, 5, 9, 8), (6, 1, 3, 3, 3), dict(stride=(1, 2, 2), padding=1, groups=6)),  # X3D-like, the rule's case
    ((3, 4, 9, 7), (6, 2, 3, 2), dict(stride=(2, 3), padding=((1, 0), (0, 1)), groups=2)),
])
def test_channels_last_phases_split_stays_channels_last(shape: tuple[int, ...], weight: tuple[int, ...],
                                                        kw: dict[str, Any]) -> None:
    """The phases of a channels-last x are channels last (oneDNN's depthwise convs want no reorder), same sums."""
    fmt = torch.channels_last if len(shape) == 4 else torch.channels_last_3d
    spec = _spec(shape, weight, **kw)
    x, gy = torch.randn(shape), torch.randn(spec.output_shape)
    plan = plan_weight_grad(spec, "phases")
    phases = plan.data_steps[0](x.contiguous(memory_format=fmt))
    assert phases.is_contiguous(memory_format=fmt) and not phases.is_contiguous()
    torch.testing.assert_close(phases, plan.data_steps[0](x), rtol=0, atol=0)
    gw = execute(plan, x.contiguous(memory_format=fmt), gy.contiguous(memory_format=fmt))
    expected = cg.backends.get_backend("native").weight_grad(spec, x, gy)
    torch.testing.assert_close(gw, expected, **TOL[torch.float32])


@pytest.fixture
def forced(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """force(input_method, weight_method): make the fwdconv rules choose these (plans re-built)."""
    def force(input_method: str | None, weight_method: str | None) -> None:
        if input_method:
            monkeypatch.setattr(grad_input, "input_method", lambda spec: (input_method, "forced"))
        if weight_method:
            monkeypatch.setattr(grad_weight, "weight_method", lambda spec: (weight_method, "forced"))
        plan_input_grad.cache_clear()
        plan_weight_grad.cache_clear()

    yield force
    plan_input_grad.cache_clear()
    plan_weight_grad.cache_clear()


@pytest.mark.parametrize(("input_method", "weight_method", "case"), [
    ("polyphase", "kernel", Case((1, 2, 5, 4), (2, 2, 3, 2), stride=2, padding=1, name="s2")),
    ("subpixel", "per_sample", Case((2, 2, 4, 3), (2, 1, 3, 2), stride=(2, 1), padding=1, groups=2, name="dw")),
    ("matmul", "taps", Case((2, 2, 3, 3), (2, 2, 1, 1), name="1x1")),
    ("polyphase", "blocks", Case((1, 2, 6), (2, 2, 2), stride=1, dilation=2, padding=1, name="dilated-1d")),
    ("polyphase", "taps", Case((1, 1, 2, 4, 4), (2, 1, 1, 2, 2), stride=(1, 2, 2), name="3d-k<=s")),
], ids=lambda v: v if isinstance(v, str) else str(v))
def test_double_backward_through_every_formulation(forced: Any, input_method: str, weight_method: str,
                                                   case: Case) -> None:
    forced(input_method, weight_method)
    t = make_tensors(case, bias=False)
    x, w = t["input"].requires_grad_(), t["weight"].requires_grad_()
    assert plan_input_grad(case.spec()).method == input_method
    assert plan_weight_grad(case.spec()).method == weight_method

    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cg.conv(x, w, None, case.stride, case.padding, case.dilation, case.groups, backend="fwdconv")

    assert torch.autograd.gradgradcheck(f, (x, w))


class _ConvOps(TorchDispatchMode):
    """Records every convolution-like aten op and whether aten.convolution ran transposed."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if "conv" in name:
            self.ops.append((name, name == "convolution" and bool(args[6])))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("case", [*grid_cases(), *PHASE_CASES], ids=str)
def test_fwdconv_never_dispatches_a_backward_or_transposed_convolution(case: Case) -> None:
    t = make_tensors(case)
    backend = cg.backends.get_backend("fwdconv")
    spec = case.spec()
    x, gy = t["input"], t["grad_output"]
    if spec.unbatched:
        x, gy = x.unsqueeze(0), gy.unsqueeze(0)
    with _ConvOps() as log:
        backend.backward(spec, gy, x, t["weight"], True, True)
        for method in INPUT_METHODS if not spec.transposed else ():
            if method != "subpixel" or spec.subpixel_taps is not None:
                execute(plan_input_grad(spec, method), gy, t["weight"])
        for method in WEIGHT_METHODS:
            if not _refuses(method, spec):
                execute(plan_weight_grad(spec, method), *((gy, x) if spec.transposed else (x, gy)))
    assert not any("backward" in name or transposed for name, transposed in log.ops), log.ops


@pytest.mark.parametrize("order, perm", [("group_major", (2, 1, 0, 3, 4)), ("sample_major", (2, 0, 1, 3, 4))])
def test_batch_fold_lays_out_the_samples_in_its_order(order: str, perm: tuple[int, ...]) -> None:
    # one step for grad_weight's "kernel" plan (group-major) and its per-sample plans (sample-major)
    n, g, cxg, size = 3, 2, 4, (5, 2)
    x = torch.arange(n * g * cxg * math.prod(size), dtype=torch.float64).reshape(n, g * cxg, *size)
    fold = BatchFold(g, order, (cxg, n * g, *size))  # type: ignore[arg-type]
    expected = x.reshape(n, g, cxg, *size).permute(perm).reshape(cxg, n * g, *size)  # (C_x/g, g*N or N*g, *i)
    torch.testing.assert_close(fold(x), expected, rtol=0, atol=0)
    namespace: dict[str, Any] = {"t": x}
    exec("\n".join(fold.code("t", tuple(x.shape))), namespace)  # its script lines compute the same
    torch.testing.assert_close(namespace["t"], expected, rtol=0, atol=0)


PER_SAMPLE_PLAN_CASES = [
    *PHASE_CASES,
    Case((3, 6, 11, 9), (6, 2, 3, 2), stride=(2, 3), padding=((1, 2), (0, 1)), dilation=(2, 1), groups=3,
         name="groups3-asymmetric-dilated-strided"),
    Case((2, 4, 5, 5), (4, 3, 4, 4), stride=2, padding=1, output_padding=1, transposed=True,
         name="transposed-output-padding"),
    Case((0, 2, 7), (3, 2, 3), stride=2, name="batch-0"),
    Case((1, 3, 7, 7), (5, 3, 2, 4), padding=((0, 1), (2, 0)), name="batch-1-even-kernel"),
]


@pytest.mark.parametrize("case", PER_SAMPLE_PLAN_CASES, ids=str)
def test_the_per_sample_weight_plan_gives_each_samples_own_gradient(case: Case) -> None:
    """plan_per_sample_weight_grad's rows n*C_y.. are sample n's weight gradient (float64, against autograd on that
    sample alone); its samples summed are plan_weight_grad's per_sample result."""
    t = make_tensors(case)
    spec = case.spec()
    x, y = (t["grad_output"], t["input"]) if spec.transposed else (t["input"], t["grad_output"])
    got = execute(grad_weight.plan_per_sample_weight_grad(spec), x, y).reshape(spec.batch, *spec.weight_shape)
    assert got.shape == (spec.batch, *spec.weight_shape)
    one = dataclasses.replace(case, input_shape=(1, *case.input_shape[1:]))
    for n in range(spec.batch):
        ref = reference_grads(one, {k: v[n:n + 1] if k in ("input", "grad_output") else v for k, v in t.items()})
        torch.testing.assert_close(got[n], ref["grad_weight"], **TOL[torch.float64])
    summed = execute(plan_weight_grad(spec, "per_sample"), x, y)
    torch.testing.assert_close(got.sum(0), summed, **TOL[torch.float64])


# ---- one list of tensor operations: what a step runs is what its code writes ------------------------------------
def _script(lines: list[str], **tensors: torch.Tensor) -> dict[str, Any]:
    scope: dict[str, Any] = {"torch": torch, "F": torch.nn.functional, **tensors}
    exec("\n".join(lines), scope)
    return scope


def test_a_mutated_step_changes_the_run_the_text_and_the_code_together() -> None:
    """A step's call, its sentence and its code are one object's: zero-insertion told a stride of (2, 1) instead of
    (2, 2) inserts fewer zeros when the plan runs, says the new stride in the recipe's text, writes the new reshape
    and pad in its code, and that code run gives exactly what the plan gives. Nothing else in the plan changes."""
    from convgrad.backends.fwdconv.steps import ZeroInsert
    from convgrad.explain.code import plan_code
    from convgrad.explain.recipe import plan_steps

    spec = ConvSpec.from_shapes((2, 4, 9, 9), (6, 2, 3, 3), stride=2, padding=((1, 2), (0, 1)), groups=2)
    p = plan_input_grad(spec, "zero_insert")
    step = p.data_steps[0]
    assert isinstance(step, ZeroInsert) and step.stride == (2, 2)
    mutated = dataclasses.replace(p, data_steps=(dataclasses.replace(step, stride=(2, 1)), *p.data_steps[1:]))
    gy, w = torch.randn(spec.output_shape, dtype=torch.float64), torch.randn(spec.weight_shape, dtype=torch.float64)
    before, after = execute(p, gy, w), execute(mutated, gy, w)
    assert before.shape == spec.input_shape and after.shape == (2, 4, 9, 6)  # 3 zero-inserted columns, not 7
    text = [(a.description, b.description) for a, b in zip(plan_steps(p), plan_steps(mutated), strict=True)]
    changed = [pair for pair in text if pair[0] != pair[1]]
    assert changed == [("zero-insert by stride (2, 2) (stride-1 zeros between entries)",
                        "zero-insert by stride (2, 1) (stride-1 zeros between entries)")]
    shapes = {"grad_output": spec.output_shape, "weight": spec.weight_shape}
    code, old_code = plan_code(mutated, "out", shapes), plan_code(p, "out", shapes)
    assert len(code) == len(old_code) and sum(a != b for a, b in zip(old_code, code, strict=True)) == 3
    assert torch.equal(_script(code, grad_output=gy, weight=w)["out"], after)
    assert torch.equal(_script(old_code, grad_output=gy, weight=w)["out"], before)


@pytest.mark.parametrize("case", [c for c in grid_cases() if not c.spec().unbatched and c.spec().batch], ids=str)
def test_every_chain_steps_code_gives_exactly_what_it_runs(case: Case) -> None:
    """Every step that is a chain of tensor operations (``plan.Chain``), in every plan of both gradients, the taps
    each polyphase phase takes of the kernel too: its ``code()`` run on its input gives exactly its call's result
    (one list of ``TensorOp``s, run and written)."""
    spec, t = case.spec(), make_tensors(case)
    checked = 0
    plans = []
    for planner, methods in ((plan_input_grad, INPUT_METHODS), (plan_weight_grad, WEIGHT_METHODS)):
        for method in methods:
            try:
                plans.append(planner(spec, method))
            except MethodRefused:  # a formulation that does not serve this layer has no steps to check
                continue
    for p in plans:
        phases = [ph for ph in getattr(p.conv, "phases", ()) if ph is not None]
        for source, steps in ((p.data, p.data_steps), (p.kernel, (*p.kernel_steps, *(ph.taps for ph in phases)))):
            v = t[source]
            for step in steps:
                out = step(v)
                if isinstance(step, Chain):
                    got = _script(step.code("v", tuple(v.shape)), v=v)["v"]
                    assert got.shape == out.shape and torch.equal(got, out), (str(case), p.method, step)
                    checked += 1
                if not isinstance(step, contractions.TakeTaps):  # each phase's taps read the whole kernel
                    v = out
    assert checked > 0
