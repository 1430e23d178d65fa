"""Property-based fuzzing: every public gradient function and every backend against torch autograd.

Each example is one random valid convolution (dims 1-3, forward or transposed, stride and dilation
1-4, padding 0-3 as an int, per-dim tuple, asymmetric (lo, hi) pairs, 'same' or 'valid', groups
including depthwise, batch 0-3 or unbatched, kernels up to the padded input), a dtype (float64 or
float32) and a memory layout per tensor (contiguous, channels_last, a transposed or a sliced view).
For every registered backend it checks conv_backward, the single-gradient helpers, conv_bias_grad
and the autograd functions, and once per example the torch.nn.grad names; the reference is torch
autograd in float64 on the explicitly padded problem (tests/helpers.py).

Profiles (hypothesis settings profiles, registered in tests/conftest.py, chosen by CONVGRAD_FUZZ_PROFILE):

* ``convgrad-fast`` (default, ``python -m pytest``): 40 examples, fixed seed (derandomize), no example database.
* ``convgrad-ci`` (the full run, ``.ci/run``): 300 examples, fixed seed, no example database.
* ``convgrad-thorough``: 10,000 examples, random seed. Run it with
  ``pytest -m slow tests/test_fuzz.py -k thorough --hypothesis-show-statistics``, or make the
  default test use it: ``CONVGRAD_FUZZ_PROFILE=thorough pytest tests/test_fuzz.py``.

``CONVGRAD_FUZZ_LOG=file`` appends each example and each backend to that file before it runs, so that a crash
(a segfault kills the process before hypothesis can report) leaves the example that caused it on the last lines.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import assume, event, example, given, settings
from hypothesis import strategies as st

import convgrad as cg
from helpers import TOL, Case, assert_matches_autograd, make_tensors, reference_forward, reference_grads

BACKENDS = cg.backends()
LAYOUTS = ("contiguous", "channels_last", "transposed_view", "sliced_view")
MAX_SIZE = {1: 12, 2: 7, 3: 4}  # spatial extent of the side the user passes, per number of dims
MAX_ELEMENTS = 6_000  # of the big side, so that one example stays in milliseconds


@dataclass(frozen=True)
class Example:
    case: Case
    dtype: torch.dtype
    layouts: tuple[str, str, str]  # input, weight, grad_output
    output_mask: tuple[bool, bool, bool]
    generic_entry: bool  # cg.conv / cg.conv_transpose rather than cg.conv{n}d / cg.conv_transpose{n}d
    seed: int


def _ints(draw: Any, n: int, lo: int, hi: int) -> tuple[int, ...]:
    return tuple(draw(st.integers(lo, hi)) for _ in range(n))


def _padding(draw: Any, n: int, budget: tuple[int, ...], allow_same: bool) -> Any:
    """An int, a per-dim tuple, (lo, hi) pairs, 'same' or 'valid', with lo + hi <= budget per dim."""
    kinds = ["int", "tuple", "pairs", "valid", *(["same"] if allow_same else [])]
    kind = draw(st.sampled_from(kinds))
    if kind in ("same", "valid"):
        return kind
    if kind == "pairs":
        pairs = []
        for b in budget:
            lo = draw(st.integers(0, min(3, b)))
            pairs.append((lo, draw(st.integers(0, min(3, b - lo)))))
        return tuple(pairs)
    per_dim = tuple(draw(st.integers(0, min(3, b // 2))) for b in budget)
    return per_dim[0] if kind == "int" and len(set(per_dim)) == 1 else per_dim


@st.composite
def cases(draw: Any) -> Case:
    n = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 1, 2, 3]))
    depthwise = groups > 1 and draw(st.booleans())
    cin = groups * (1 if depthwise else draw(st.integers(1, 2)))
    cout = groups * draw(st.integers(1, 2))
    stride, dilation = _ints(draw, n, 1, 4), _ints(draw, n, 1, 4)
    size = _ints(draw, n, 1, MAX_SIZE[n])
    batch = draw(st.sampled_from([None, 0, 1, 2, 3]))
    if transposed:
        kernel = _ints(draw, n, 1, 4)
        output_padding = tuple(draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation))
        # keep the output non-empty: p_lo + p_hi <= (i-1)s + d(k-1) + output_padding
        budget = tuple((i - 1) * s + d * (k - 1) + op
                       for i, s, d, k, op in zip(size, stride, dilation, kernel, output_padding))
        padding = _padding(draw, n, budget, allow_same=False)
        weight = (cin, cout // groups, *kernel)
    else:
        output_padding = (0,) * n
        padding = _padding(draw, n, (6,) * n, allow_same=True)
        if isinstance(padding, str):
            padded = size  # 'same' pads enough for any kernel; 'valid' pads nothing
        else:
            per_dim = padding if isinstance(padding, tuple) else (padding,) * n
            pairs = [p if isinstance(p, tuple) else (p, p) for p in per_dim]
            padded = tuple(i + lo + hi for i, (lo, hi) in zip(size, pairs))
        # kernels up to the padded input: d(k-1) + 1 <= i + p_lo + p_hi ('same': any kernel, capped at 5)
        kernel = tuple(draw(st.integers(1, 5 if padding == "same" else (p - 1) // d + 1))
                       for p, d in zip(padded, dilation))
        weight = (cout, cin // groups, *kernel)
    shape = (cin, *size) if batch is None else (batch, cin, *size)
    case = Case(shape, weight, stride, padding, dilation, groups, transposed, output_padding)
    spec = case.spec()  # every drawn configuration is valid by construction; a ValueError here is a bug
    big = spec.x_size if transposed else spec.input_size
    assume(math.prod(big) * max(spec.batch, 1) * spec.x_channels <= MAX_ELEMENTS)  # stay fast
    return case


@st.composite
def examples(draw: Any) -> Example:
    return Example(
        case=draw(cases()),
        dtype=draw(st.sampled_from([torch.float64, torch.float32])),
        layouts=tuple(draw(st.sampled_from(LAYOUTS)) for _ in range(3)),  # type: ignore[arg-type]
        output_mask=tuple(draw(st.booleans()) for _ in range(3)),  # type: ignore[arg-type]
        generic_entry=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def relayout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The same values in another memory layout (a view where the layout is not contiguous)."""
    if layout == "channels_last" and t.dim() in (4, 5):
        return t.contiguous(memory_format=torch.channels_last if t.dim() == 4 else torch.channels_last_3d)
    if layout in ("transposed_view", "channels_last"):
        order = list(reversed(range(t.dim())))
        return t.permute(order).contiguous().permute(order)  # same shape, strides reversed
    if layout == "sliced_view":
        big = t.new_full([2 * s for s in t.shape], float("nan"))  # NaN: reading a gap would show
        view = big[tuple(slice(None, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view
    return t.contiguous()


@functools.cache
def _runs_on(backend: str, device: torch.device) -> bool:
    """False for a backend that refuses this device by design (numpy: CPU only), naming itself in the error."""
    t = torch.ones(1, 1, 2, device=device)
    try:
        cg.conv_backward(t, t, torch.ones(1, 1, 1, device=device), backend=backend)
    except (TypeError, ValueError) as err:
        if f"backend={backend!r}" not in str(err):
            raise
        return False
    return True


def _kwargs(case: Case) -> dict[str, Any]:
    kw = dict(stride=case.stride, padding=case.padding, dilation=case.dilation, groups=case.groups)
    return kw | ({"output_padding": case.output_padding} if case.transposed else {})


def _check_backend(ex: Example, t: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], backend: str,
                   forward: torch.Tensor) -> None:
    case, spec, dtype = ex.case, ex.case.spec(), ex.dtype
    ctx = f"{backend} {case} {dtype} layouts={ex.layouts}"
    x, w, gy, b = t["input"], t["weight"], t["grad_output"], t["bias"]
    kw = _kwargs(case)

    # conv_backward, aten's argument order, with a random output_mask
    grads = cg.conv_backward(gy, x, w, [spec.out_channels], transposed=case.transposed, output_mask=ex.output_mask,
                             backend=backend, **{"output_padding": 0, **kw})
    names = ("grad_input", "grad_weight", "grad_bias")
    assert all((g is None) != m for g, m in zip(grads, ex.output_mask)), f"{ctx}: output_mask not honoured"
    if any(ex.output_mask):
        assert_matches_autograd({k: g for k, g, m in zip(names, grads, ex.output_mask) if m}, ref, dtype, ctx)

    # the single-gradient helpers (torch.nn.grad order) and conv_bias_grad
    prefix = "conv_transpose" if case.transposed else "conv"
    ours = {"grad_input": getattr(cg, f"{prefix}_input_grad")(x.shape, w, gy, **kw, backend=backend),
            "grad_weight": getattr(cg, f"{prefix}_weight_grad")(x, w.shape, gy, **kw, backend=backend)}
    if not spec.unbatched:
        ours["grad_bias"] = cg.conv_bias_grad(gy)
    assert_matches_autograd(ours, ref, dtype, f"{ctx} {prefix}_*_grad")

    # the autograd functions: forward value and all three gradients
    leaves = [v.detach().requires_grad_() for v in (x, w, b)]
    fn = getattr(cg, prefix if ex.generic_entry else f"{prefix}{spec.n}d")
    y = fn(*leaves, **kw, backend=backend)
    torch.testing.assert_close(y, forward, **TOL[dtype], msg=lambda m: f"{ctx} forward: {m}")
    got = torch.autograd.grad(y, leaves, gy)
    assert_matches_autograd(dict(zip(names, got)), ref, dtype, f"{ctx} {fn.__name__}")


def _events(ex: Example) -> None:
    """Coverage, shown by --hypothesis-show-statistics."""
    spec = ex.case.spec()
    event(f"{spec.n}d {'transposed' if spec.transposed else 'forward'} {str(ex.dtype)[6:]}")
    for label, hit in (("asymmetric padding", not spec.is_symmetric), ("'same'", ex.case.padding == "same"),
                       ("stride > 1 with a leftover r > 0", any(spec.leftover)),
                       ("dilation > 1 and stride > 1", any(d > 1 for d in spec.dilation) and max(spec.stride) > 1),
                       ("1 < groups", spec.groups > 1), ("depthwise", 1 < spec.groups == spec.x_channels),
                       ("unbatched", spec.unbatched), ("batch 0", spec.batch == 0),
                       ("a non-contiguous tensor", any(la != "contiguous" for la in ex.layouts))):
        if hit:
            event(label)


def _log(line: str) -> None:
    """Append a line to the file CONVGRAD_FUZZ_LOG names, flushed at once: a crash (segfault) keeps the last one."""
    path = os.environ.get("CONVGRAD_FUZZ_LOG")
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


def check_example(ex: Example, device: torch.device) -> None:
    """Every backend and every public gradient function agree with torch autograd on this example."""
    _events(ex)
    _log(repr(ex))
    case = ex.case
    t64 = make_tensors(case, torch.float64, device, seed=ex.seed)
    ref = {k: v.to(ex.dtype) for k, v in reference_grads(case, t64).items()}  # float64 truth, rounded once
    forward = reference_forward(case, t64["input"], t64["weight"], t64["bias"]).to(ex.dtype)
    t = {k: v.to(ex.dtype) for k, v in t64.items()}
    for name, layout in zip(("input", "weight", "grad_output"), ex.layouts):
        t[name] = relayout(t[name], layout)
    for backend in (b for b in BACKENDS if _runs_on(b, t["input"].device)):
        _log(f"  backend {backend}")
        _check_backend(ex, t, ref, backend, forward)
    if not case.transposed:  # torch.nn.grad's names (backend "auto")
        n, kw = case.spec().n, _kwargs(case)
        ours = {"grad_input": getattr(cg, f"conv{n}d_input")(t["input"].shape, t["weight"], t["grad_output"], **kw),
                "grad_weight": getattr(cg, f"conv{n}d_weight")(t["input"], t["weight"].shape, t["grad_output"], **kw)}
        assert_matches_autograd(ours, ref, ex.dtype, f"conv{n}d_input/weight {case}")


# found by this fuzzer: x_read_pads (3, -2) on a 1-row input; tensor_ops.pad cropped before padding (narrow < 0)
PAD_THEN_CROP = Example(Case((1, 2, 1), (1, 1, 1, 1), (1, 1), ((3, 0), (0, 0)), (3, 1), 1, True, (2, 0)),
                        torch.float64, ("contiguous",) * 3, (True, True, True), False, 0)  # type: ignore[arg-type]
# found by the thorough profile: the same bug in the numpy backend's own pad, unbatched 3d, pads (2, -2)
NUMPY_PAD_THEN_CROP = Example(Case((1, 1, 1, 1), (1, 1, 1, 1, 1), (1, 1, 3), ((0, 0), (0, 0), (2, 0))),
                              torch.float64, ("contiguous",) * 3, (True, True, True), False, 0)  # type: ignore[arg-type]

# found by the thorough profile: slow_conv_transpose's "grad_weight needs to be contiguous" (slow_conv2d says "must be")
# was not retried on contiguous copies, for a 1d transposed conv with reversed-stride input and weight
NEEDS_TO_BE_CONTIGUOUS = Example(Case((2, 1, 2), (1, 2, 2), (1,), "valid", (1,), 1, True, (0,)), torch.float64,
                                 ("channels_last", "channels_last", "contiguous"), (False, False, False), False, 0)

# found by the thorough profile: the channels_last backend's grad_weight of an unbatched 1d grouped conv with
# reversed-stride input and weight
CHANNELS_LAST_1D_GROUPED = Example(Case((4, 2), (2, 2, 1), (1,), 0, (1,), 2, False, (0,)), torch.float64,
                                   ("channels_last", "channels_last", "contiguous"), (False, False, False), False, 0)


@given(ex=examples())  # the loaded profile (tests/conftest.py) sets the examples
@example(ex=PAD_THEN_CROP)
@example(ex=NUMPY_PAD_THEN_CROP)
@example(ex=NEEDS_TO_BE_CONTIGUOUS)
@example(ex=CHANNELS_LAST_1D_GROUPED)
def test_every_gradient_function_and_backend_matches_autograd(ex: Example, device: torch.device) -> None:
    check_example(ex, device)


# 10,000 random (not derandomized) examples: run by hand, CONVGRAD_FUZZ_PROFILE=thorough python -m pytest -m slow -k
# thorough; .ci/run stays reproducible with the ci profile's 300 fixed examples of the test above
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("CONVGRAD_FUZZ_PROFILE") != "thorough",
                    reason="the thorough fuzz runs by hand: CONVGRAD_FUZZ_PROFILE=thorough")
@settings(settings.get_profile("convgrad-thorough"))
@given(ex=examples())
def test_every_gradient_function_and_backend_matches_autograd_thorough(ex: Example, device: torch.device) -> None:
    check_example(ex, device)


def test_relayout_keeps_values_and_changes_strides() -> None:
    t = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)
    for layout in LAYOUTS:
        r = relayout(t, layout)
        assert torch.equal(r, t), layout
        assert r.is_contiguous() == (layout == "contiguous"), layout
    assert relayout(t, "channels_last").is_contiguous(memory_format=torch.channels_last)


def test_pad_crops_after_padding_when_the_crop_exceeds_the_input() -> None:
    """Regression (PAD_THEN_CROP): a pad (3, -2) of one row is 3 zeros and the row, less the last 2 entries."""
    from convgrad.tensor_ops import pad

    t = torch.tensor([[[5.0]]])
    torch.testing.assert_close(pad(t, [(3, -2)]), torch.zeros(1, 1, 2))
    torch.testing.assert_close(pad(t, [(-1, 3)]), torch.zeros(1, 1, 3))
    torch.testing.assert_close(pad(torch.arange(4.0).reshape(1, 1, 4), [(2, -1)]), torch.tensor([[[0.0, 0, 0, 1, 2]]]))
