"""Every frame explain draws is right: its products are exactly the nonzero entries of torch's Jacobian.

A frame (convgrad.explain.frames) claims, for one result cell, which data cells meet which kernel taps.
With distinct kernel values (the t-th entry of the kernel tensor is t + 1), the Jacobian of the result
with respect to the data names the tap of every product, so a flipped kernel cannot pass as a set. The
claims are read from the very Frame objects the renderers draw; the Jacobian comes from torch.autograd
through torch's own convolution (tests/helpers.reference_forward).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from convgrad.backends.fwdconv import INPUT_METHODS, WEIGHT_METHODS, geometry, steps
from convgrad.errors import MethodRefused
from convgrad.explain.frames import GRADIENTS, Scene, scene
from convgrad.spec import ConvSpec
from helpers import Case, reference_forward

Config = tuple[Case, str | None, str | None]


def _case(spec: ConvSpec) -> Case:
    return Case(spec.input_shape, spec.weight_shape, spec.stride, spec.padding, spec.dilation, spec.groups,
                spec.transposed, spec.output_padding)


def _tensors(spec: ConvSpec, kernel: str) -> dict[str, torch.Tensor]:
    shapes = {"input": spec.input_shape, "weight": spec.weight_shape, "grad_output": spec.output_shape}
    gen = torch.Generator().manual_seed(0)
    out = {name: torch.randn(shape, generator=gen, dtype=torch.float64) for name, shape in shapes.items()}
    out[kernel] = torch.arange(1, math.prod(shapes[kernel]) + 1, dtype=torch.float64).reshape(shapes[kernel])
    return out


def _result(case: Case, gradient: str, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """The forward output, grad_input or grad_weight, by torch autograd through torch's conv."""
    x, w = t["input"], t["weight"]
    if gradient != "forward":  # the data may be the Jacobian's own input: keep its graph
        x, w = (v if v.requires_grad else v.detach().requires_grad_() for v in (x, w))
    y = reference_forward(case, x, w, None)
    if gradient == "forward":
        return y
    gi, gw = torch.autograd.grad(y, (x, w), t["grad_output"], create_graph=True)
    return gi if gradient == "grad_input" else gw


def jacobian(sc: Scene) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """d result / d data, shaped (*result shape, data numel), with the kernel's entries distinct."""
    case, t = _case(sc.spec), _tensors(sc.spec, sc.kernel)

    def result_of(data: torch.Tensor) -> torch.Tensor:
        return _result(case, sc.gradient, {**t, sc.data: data})

    jac = torch.autograd.functional.jacobian(result_of, t[sc.data])
    return jac.reshape(*sc.result_shape, -1), t


def mislabelled(sc: Scene) -> tuple[int, list[str]]:
    """(frames checked, one line per frame whose claims differ from the Jacobian row of its cell)."""
    jac, t = jacobian(sc)
    data_shape, kernel = t[sc.data].shape, t[sc.kernel]
    errors, count = [], 0
    for frame in sc.frames():
        lead = () if sc.gradient == "grad_weight" else (0,)
        row = jac[(*lead, *frame.channel, *frame.cell)]
        expected = torch.zeros_like(row)
        for data_index, kernel_index in frame.claims():
            flat = 0
            for i, n in zip((0, *data_index), data_shape, strict=True):
                flat = flat * n + i
            expected[flat] += kernel[(*(() if sc.kernel == "weight" else (0,)), *kernel_index)]
        count += 1
        if not torch.equal(row, expected) or frame.reached != bool(row.any()):
            errors.append(f"{sc.gradient} {sc.plan.method} channel {frame.channel} cell {frame.cell}: claims "
                          f"{sorted(frame.claims())} but the Jacobian row is {row.nonzero().flatten().tolist()} "
                          f"with values {row[row != 0].tolist()}")
    assert count == math.prod(sc.result_shape) // (1 if sc.gradient == "grad_weight" else sc.result_shape[0])
    return count, errors


TALLY: dict[str, Counter[str]] = defaultdict(Counter)  # profile -> configurations, scenes and frames checked


def check(config: Config, profile: str | None = None) -> int:
    """Every frame of the three scenes of a configuration is right; returns how many were checked.

    A passing check is counted in TALLY[profile] (not the mutants'); pytest's summary prints the counts.
    """
    case, input_method, weight_method = config
    spec = case.spec()
    total, scenes = 0, 0
    for gradient in GRADIENTS:
        try:
            sc = scene(spec, gradient, input_method=input_method, weight_method=weight_method)
        except MethodRefused:  # a forced method that cannot serve this configuration
            continue
        count, errors = mislabelled(sc)
        assert not errors, "\n".join([spec.describe(), *errors[:5]])
        total, scenes = total + count, scenes + 1
    if profile is not None:
        TALLY[profile].update(configurations=1, scenes=scenes, frames=total)
    return total


def tally_lines() -> list[str]:
    """One line per profile run: the configurations, scenes and frames checked (tests/conftest.py prints them)."""
    return [f"test_explain_frames [{profile}]: {n['frames']} frames of {n['scenes']} scenes in "
            f"{n['configurations']} configurations match the Jacobian" for profile, n in sorted(TALLY.items())]


@st.composite
def configs(draw: Any, max_size: int = 6) -> Config:
    """Tiny 1d/2d configurations, forward and transposed, with every hyperparameter drawn, and a method."""
    n = draw(st.sampled_from([1, 2]))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 2))

    def per_dim(lo: int, hi: int) -> tuple[int, ...]:
        return tuple(draw(st.integers(lo, hi)) for _ in range(n))

    size, k, s, d = per_dim(1, max_size), per_dim(1, 3), per_dim(1, 3), per_dim(1, 2)
    pads = tuple((draw(st.integers(0, 2)), draw(st.integers(0, 2))) for _ in range(n))
    op = tuple(draw(st.integers(0, max(a, b) - 1)) for a, b in zip(s, d)) if transposed else (0,) * n
    weight = (c_in, c_out // groups, *k) if transposed else (c_out, c_in // groups, *k)
    case = Case((1, c_in, *size), weight, s, pads, d, groups, transposed, op)
    try:
        case.spec()
    except ValueError:
        assume(False)
    return case, draw(st.sampled_from([None, *INPUT_METHODS])), draw(st.sampled_from([None, *WEIGHT_METHODS]))


def _c(input_shape: Any, weight_shape: Any, input_method: str | None = None, weight_method: str | None = None,
       **kw: Any) -> Config:
    return Case(input_shape, weight_shape, **kw), input_method, weight_method


EXAMPLES = [  # the cases where pictures go wrong: each gets its own run in the fast profile
    _c((1, 1, 5, 5), (1, 1, 3, 3), stride=2),  # sub-pixel phases
    _c((1, 1, 5, 5), (1, 1, 3, 3), "zero_insert", stride=2),
    _c((1, 1, 5, 5), (1, 1, 3, 3), "polyphase", "taps", stride=2),
    _c((1, 1, 3, 3), (1, 1, 3, 3), stride=2, padding=1, transposed=True, output_padding=1),
    _c((1, 1, 3, 3), (1, 1, 3, 3), "zero_insert", stride=2, padding=1, transposed=True, output_padding=1),
    _c((1, 1, 8), (1, 1, 3), stride=3, padding=((2, 0),)),  # leftover: an input row never read
    _c((1, 2, 7), (2, 1, 3), "polyphase", "blocks", dilation=2, padding=((1, 2),), groups=2),
    _c((1, 4, 5, 4), (4, 2, 2, 3), "polyphase", "per_sample", stride=(2, 3), dilation=(2, 1), groups=2,
       padding=((1, 0), (0, 2))),
    _c((1, 2, 3, 2), (2, 1, 3, 2), "polyphase", "kernel", stride=(3, 2), dilation=(2, 2), groups=2,
       transposed=True, output_padding=(1, 1), padding=((0, 1), (1, 0))),  # depthwise taps, dilation with stride
    _c((1, 3, 4), (3, 1, 1), stride=2, groups=3, transposed=True, output_padding=1),  # 1x1: matmuls, Subsample
    _c((1, 2, 4, 4), (2, 2, 1, 1)),  # stride 1, 1x1: the matmul plan
    _c((1, 2, 5), (4, 2, 5), padding=((1, 1),)),  # a kernel covering its whole input
    _c((1, 2, 7, 8), (2, 1, 3, 2), "polyphase", "phases", stride=(2, 3), padding=((1, 0), (0, 1)), groups=2),
    _c((1, 2, 3, 2), (2, 1, 3, 4), None, "phases", stride=(2, 3), transposed=True, output_padding=(1, 0)),
]


@pytest.mark.parametrize("config", EXAMPLES, ids=lambda c: f"{c[0].spec().describe()} {c[1]} {c[2]}")
def test_frames_of_the_hard_cases_match_the_jacobian(config: Config) -> None:
    assert check(config, "fast") > 0


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(configs())
def test_frames_match_the_jacobian(config: Config) -> None:
    assert check(config, "fast") > 0


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(configs(max_size=8))
@example(EXAMPLES[8])
def test_frames_match_the_jacobian_thorough(config: Config) -> None:
    assert check(config, "thorough") > 0


# ---- the check bites -----------------------------------------------------------------------------------------------

MUTANT_CASES = [EXAMPLES[0], EXAMPLES[1], EXAMPLES[3], EXAMPLES[6]]


@pytest.mark.parametrize("config", MUTANT_CASES, ids=lambda c: f"{c[0].spec().describe()} {c[1]}")
def test_a_renderer_one_tap_off_fails(config: Config, monkeypatch: pytest.MonkeyPatch) -> None:
    real = Scene.frame

    def one_tap_off(self: Scene, channel: Any, cell: Any) -> Any:
        frame = real(self, channel, cell)
        shifted = tuple((d, (k[0]._replace(source=(k[0].source + 1) % self.spec.kernel_size[0]), *k[1:]))
                        for d, k in frame.links)  # each product labelled with the next tap of dim 0
        return frame.__class__(**{**frame.__dict__, "links": shifted})

    monkeypatch.setattr(Scene, "frame", one_tap_off)
    if config[0].spec().kernel_size[0] == 1:
        pytest.skip("a 1-tap dim has no neighbouring tap")
    with pytest.raises(AssertionError, match="Jacobian row"):
        check(config)


def test_a_geometry_one_tap_off_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    real = geometry.conv_rows

    def off(data: Any, kernel: Any, stride: int, padding: int, dilation: int, rows: int) -> Any:
        return real(data, geometry.Axis(kernel.cells[1:] + kernel.cells[:1]), stride, padding, dilation, rows)

    monkeypatch.setattr(geometry, "conv_rows", off)
    with pytest.raises(AssertionError, match="Jacobian row"):
        check(EXAMPLES[1])


def test_a_kernel_left_unflipped_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steps.Flip, "rows", lambda self, dim, axis: axis)
    with pytest.raises(AssertionError, match="Jacobian row"):
        check(EXAMPLES[1])


def test_never_read_rows_are_marked() -> None:
    # stride 3 with padding (2, 0) on 8 rows: the last input row lies past the last window
    sc = scene(EXAMPLES[5][0].spec(), "grad_input")
    unreached = [f.cell for f in sc.frames() if not f.reached]
    assert unreached == [(7,)]
    assert scene(EXAMPLES[5][0].spec(), "forward").never_read(0) == {7}
