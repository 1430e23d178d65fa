"""Every backend returns each gradient in the memory format torch's own backward returns for the same tensors.

The judge is torch at run time, never a rule written down here: for each configuration of the grid and each
layout of input, weight and grad_output, the gradients torch autograd computes through torch's own
convolution (and torch.nn.grad's, where it can express the case) are compared with ours through
``conv_backward``, through ``torch.autograd.grad`` of ``cg.conv`` and through the torch.nn.grad-compatible
helpers: the same strides on every dim longer than 1 (so the same ``is_contiguous(memory_format=...)`` for
every format, and ``.view`` works exactly where it works on torch's). A ``.backward()`` test could not show
any of this: AccumulateGrad re-lays ``.grad`` out to the parameter's layout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.grad

import convgrad as cg
from convgrad.backends import get_backend
from helpers import (
    DELEGATING,
    TOL,
    Case,
    backend_accepts,
    grid_backends,
    grid_cases,
    grid_params,
    make_tensors,
    reference_grads,
)

BACKENDS = cg.backends()
CASES = grid_cases()
FORMATS = (torch.contiguous_format, torch.channels_last, torch.channels_last_3d)
_RANK_FORMAT = {4: torch.channels_last, 5: torch.channels_last_3d}
# which of (input, weight, grad_output) is laid out channels last; the last: only grad_output, which torch
# ignores when it picks the layout of the gradients
LAYOUTS = ("---", "x--", "-w-", "--g")


pytestmark = pytest.mark.usefixtures("one_thread")


def channels_last(t: torch.Tensor) -> torch.Tensor:
    """t with its channels innermost in memory: channels_last(_3d) for 4d/5d, (N, L, C) in memory for 3d.

    Always a copy, never ``.contiguous(memory_format=...)``, which keeps a tensor that already counts as
    channels_last (a depthwise ``(C, 1, k, k)`` weight is both formats at once): torch tells the two apart
    by the stride of the size-1 dim, so the test must set it.
    """
    if t.dim() == 3:
        return t.transpose(1, 2).clone(memory_format=torch.contiguous_format).transpose(1, 2)  # (N, L, C) buffer
    return torch.empty_like(t, memory_format=_RANK_FORMAT[t.dim()]).copy_(t)


def laid_out(case: Case, t: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    unbatched = case.spec().unbatched  # an unbatched (C, *spatial) tensor has no channels-last format
    out = dict(t)
    for flag, name in zip(layout, ("input", "weight", "grad_output")):
        if flag != "-" and not (unbatched and name != "weight"):
            out[name] = channels_last(t[name])
    return out


def viewable(t: torch.Tensor, *shape: int) -> bool:
    try:
        t.view(*shape)
    except RuntimeError:
        return False
    return True


def layout_problems(ours: torch.Tensor, theirs: torch.Tensor) -> list[str]:
    """How ours is laid out differently from torch's gradient (empty when the same), values checked too."""
    torch.testing.assert_close(ours, theirs, **TOL[ours.dtype])  # a layout copy changes no value
    problems = []
    long = [d for d in range(ours.dim()) if ours.shape[d] != 1]
    # an empty tensor's strides show only through is_contiguous, checked below
    if ours.numel() and [ours.stride(d) for d in long] != [theirs.stride(d) for d in long]:
        problems.append(f"strides {ours.stride()} != torch's {theirs.stride()}")
    for fmt in FORMATS:
        if fmt is torch.contiguous_format or _RANK_FORMAT.get(ours.dim()) == fmt:
            a, b = ours.is_contiguous(memory_format=fmt), theirs.is_contiguous(memory_format=fmt)
            if a != b:
                problems.append(f"is_contiguous(memory_format={fmt}) is {a}, torch's {b}")
    for shape in ((-1,), (ours.shape[0], -1)):
        if viewable(ours, *shape) != viewable(theirs, *shape):
            problems.append(f"view{shape} works on torch's: {viewable(theirs, *shape)}, on ours: "
                            f"{viewable(ours, *shape)}")
    return problems


def _conv_kwargs(case: Case) -> dict:
    return {**case.kwargs(), "output_padding": case.output_padding}


def via_conv_backward(case: Case, t: dict[str, torch.Tensor], backend: str) -> dict[str, torch.Tensor]:
    gi, gw, _ = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, transposed=case.transposed,
                                 output_mask=(True, True, False), backend=backend, **_conv_kwargs(case))
    return {"grad_input": gi, "grad_weight": gw}


def via_autograd(case: Case, t: dict[str, torch.Tensor], backend: str) -> dict[str, torch.Tensor]:
    x, w = t["input"].detach().requires_grad_(), t["weight"].detach().requires_grad_()
    f = cg.conv_transpose if case.transposed else cg.conv
    y = f(x, w, t["bias"], **case.kwargs(), backend=backend)
    gi, gw = torch.autograd.grad(y, (x, w), t["grad_output"])
    return {"grad_input": gi, "grad_weight": gw}


def via_helpers(case: Case, t: dict[str, torch.Tensor], backend: str) -> dict[str, torch.Tensor]:
    kw = dict(case.kwargs(), backend=backend)
    if case.transposed:
        kw = dict(stride=case.stride, padding=case.padding, output_padding=case.output_padding, groups=case.groups,
                  dilation=case.dilation, backend=backend)
        return {"grad_input": cg.conv_transpose_input_grad(case.input_shape, t["weight"], t["grad_output"], **kw),
                "grad_weight": cg.conv_transpose_weight_grad(t["input"], case.weight_shape, t["grad_output"], **kw)}
    return {"grad_input": cg.conv_input_grad(case.input_shape, t["weight"], t["grad_output"], **kw),
            "grad_weight": cg.conv_weight_grad(t["input"], case.weight_shape, t["grad_output"], **kw)}


def reference_helpers(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """torch's gradients when the other operand is absent: as torch.nn.grad does, an expanded scalar of the
    operand's shape stands in for it (its values do not reach the gradient asked for)."""
    gy = t["grad_output"]
    gi = reference_grads(case, {**t, "input": gy.new_zeros(1).expand(case.input_shape)})["grad_input"]
    gw = reference_grads(case, {**t, "weight": gy.new_zeros(1).expand(case.weight_shape)})["grad_weight"]
    return {"grad_input": gi, "grad_weight": gw}


PATHS: dict[str, tuple[Callable, Callable]] = {
    "conv_backward": (via_conv_backward, reference_grads),
    "autograd.grad": (via_autograd, reference_grads),
    "helpers": (via_helpers, reference_helpers),
}


@functools.cache
def _tensors_and_references(case: Case, dtype: torch.dtype, device: torch.device | str, layout: str
                             ) -> tuple[dict[str, torch.Tensor], dict[Callable, dict[str, torch.Tensor]]]:
    """The laid-out tensors and torch's gradients of each reference, once per session: every backend of the grid is
    judged against the same ones (they were half the time of this module)."""
    t = laid_out(case, make_tensors(case, dtype, device), layout)
    return t, {ref_fn: ref_fn(case, t) for ref_fn in {ref_fn for _, ref_fn in PATHS.values()}}


def memory_format_problems(case: Case, backend: str, dtype: torch.dtype, device: torch.device | str = "cpu"
                           ) -> list[str]:
    problems = []
    for layout in LAYOUTS:
        shared, refs = _tensors_and_references(case, dtype, device, layout)
        t = {k: v.clone() for k, v in shared.items()}  # same strides (preserve_format); a backend gets its own copy
        for path, (ours_fn, ref_fn) in PATHS.items():
            for name, g in ours_fn(case, t, backend).items():
                problems += [f"{path} {layout} {name}: {p}" for p in layout_problems(g, refs[ref_fn][name])]
    return problems


@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("case", grid_params(CASES), ids=str)
def test_gradients_have_torchs_memory_format(case: Case, backend: str, device: torch.device) -> None:
    if not backend_accepts(backend, torch.float64, device):
        pytest.skip(f"backend {backend!r} does not run on {device}")
    problems = memory_format_problems(case, backend, torch.float64, device)
    assert not problems, f"{backend} {case}:\n" + "\n".join(problems)


# float32 takes other kernels than float64 in torch (oneDNN on the CPU), and so other layouts; torch builds
# complex convolutions from real ones, whose gradients come out contiguous whatever the layouts
OTHER_DTYPES = [pytest.param(dt, b, marks=[pytest.mark.slow] if b in DELEGATING else [])
                for dt, b in [(torch.float32, b) for b in BACKENDS] + [
                    (torch.complex128, b) for b in BACKENDS if get_backend(b).supports_complex]]


@pytest.mark.parametrize(("dtype", "backend"), OTHER_DTYPES, ids=lambda v: str(v).removeprefix("torch."))
@pytest.mark.parametrize("case", grid_params(CASES[::4]), ids=str)
def test_gradients_have_torchs_memory_format_in_other_dtypes(case: Case, dtype: torch.dtype, backend: str,
                                                             device: torch.device) -> None:
    if not backend_accepts(backend, dtype, device):
        pytest.skip(f"backend {backend!r} does not run on {device}")
    problems = memory_format_problems(case, backend, dtype, device)
    assert not problems, f"{backend} {case} {dtype}:\n" + "\n".join(problems)


NN_GRAD_CASES = [c for c in CASES if not c.transposed and c.spec().is_symmetric and not c.spec().unbatched]


@functools.cache
def _torch_nn_grads(case: Case, layout: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The laid-out tensors and torch.nn.grad's conv{n}d_input and conv{n}d_weight of them, once per session."""
    spec = case.spec()
    kw = dict(stride=spec.stride, padding=spec.symmetric_padding, dilation=spec.dilation, groups=spec.groups)
    t = laid_out(case, make_tensors(case), layout)
    x, w, gy = t["input"], t["weight"], t["grad_output"]
    return t, {f"conv{spec.n}d_input": getattr(torch.nn.grad, f"conv{spec.n}d_input")(x.shape, w, gy, **kw),
               f"conv{spec.n}d_weight": getattr(torch.nn.grad, f"conv{spec.n}d_weight")(x, w.shape, gy, **kw)}


@pytest.mark.parametrize("backend", grid_backends([b for b in BACKENDS if b != "auto"]))
@pytest.mark.parametrize("case", grid_params(NN_GRAD_CASES), ids=str)
def test_torch_nn_grad_names_have_torchs_memory_format(case: Case, backend: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """cg.conv{n}d_input / conv{n}d_weight against torch.nn.grad's own, with backend 'auto' choosing each
    backend in turn (as its tuning may)."""
    from convgrad.backends import auto

    monkeypatch.setattr(auto, "FIXED_CHOICE", backend)
    spec = case.spec()
    kw = dict(stride=spec.stride, padding=spec.symmetric_padding, dilation=spec.dilation, groups=spec.groups)
    problems = []
    for layout in LAYOUTS:
        shared, theirs_by_name = _torch_nn_grads(case, layout)
        t = {k: v.clone() for k, v in shared.items()}  # same strides; a backend gets its own copy
        x, w, gy = t["input"], t["weight"], t["grad_output"]
        for kind, args in (("input", (x.shape, w, gy)), ("weight", (x, w.shape, gy))):
            name = f"conv{spec.n}d_{kind}"
            ours = getattr(cg, name)(*args, **kw)
            problems += [f"{name} {layout}: {p}" for p in layout_problems(ours, theirs_by_name[name])]
    assert not problems, f"{backend} {case}:\n" + "\n".join(problems)


# ---- the reported cases, one by one ---------------------------------------------------------------------------

def _fwdconv_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """backend 'auto' picks fwdconv, as its tuning may: the torch.nn.grad names then run fwdconv."""
    from convgrad.backends import auto

    monkeypatch.setattr(auto, "FIXED_CHOICE", "fwdconv")


@pytest.mark.parametrize("weight_format", [torch.contiguous_format, torch.channels_last])
def test_fwdconv_grad_weight_is_laid_out_as_torchs(weight_format: torch.memory_format,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """w (8, 16, 3, 3): fwdconv gave strides (9, 72, 3, 1), so ``gw.view(8, -1)`` raised; with a channels_last
    weight it gave neither layout. Every path now returns torch's strides."""
    _fwdconv_everywhere(monkeypatch)
    x, gy = torch.randn(2, 16, 9, 9), torch.randn(2, 8, 7, 7)
    w = torch.randn(8, 16, 3, 3).contiguous(memory_format=weight_format)
    theirs = torch.nn.grad.conv2d_weight(x, w.shape, gy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch_autograd = torch.autograd.grad(torch.nn.functional.conv2d(xr, wr), wr, gy)[0]
    ours = {"conv2d_weight": cg.conv2d_weight(x, w.shape, gy),
            "conv_weight_grad": cg.conv_weight_grad(x, w.shape, gy, backend="fwdconv"),
            "conv_backward": cg.conv_backward(gy, x, w, backend="fwdconv")[1],
            "autograd.grad": torch.autograd.grad(cg.conv(xr, wr, backend="fwdconv"), wr, gy)[0]}
    for path, gw in ours.items():
        reference = torch_autograd if path in ("conv_backward", "autograd.grad") else theirs
        assert gw.stride() == reference.stride(), path
        assert viewable(gw, 8, -1) == viewable(reference, 8, -1), path
    assert torch_autograd.is_contiguous(memory_format=weight_format)


@pytest.mark.parametrize("backend", BACKENDS)
def test_depthwise_weight_is_both_formats_and_torch_reads_its_strides(backend: str) -> None:
    """A (C, 1, k, k) weight is contiguous in both formats; the stride of its size-1 dim tells torch which it
    is, and a channels_last one makes torch's gradients channels_last even for a contiguous input."""
    x, gy = torch.randn(2, 4, 6, 6), torch.randn(2, 4, 6, 6)
    contiguous = torch.randn(4, 1, 3, 3)
    for w, fmt in ((contiguous, torch.contiguous_format), (channels_last(contiguous), torch.channels_last)):
        assert w.is_contiguous() and w.is_contiguous(memory_format=torch.channels_last)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        theirs = torch.autograd.grad(torch.nn.functional.conv2d(xr, wr, padding=1, groups=4), (xr, wr), gy)
        assert theirs[0].is_contiguous(memory_format=fmt) and not theirs[0].is_contiguous(
            memory_format=torch.channels_last if fmt == torch.contiguous_format else torch.contiguous_format)
        ours = cg.conv_backward(gy, x, w, padding=1, groups=4, backend=backend)[:2]
        for a, b in zip(ours, theirs):
            assert layout_problems(a, b) == []


def test_suggested_format_is_torchs() -> None:
    """The traceable port of c10's suggest_memory_format agrees with torch's own on permuted, sliced,
    expanded, size-0 and size-1 layouts."""
    from torch._prims_common import suggest_memory_format

    from convgrad.backends.memory_format import _suggested

    g = torch.Generator().manual_seed(0)
    tried = set()
    for shape in [(2, 3, 4, 5), (1, 3, 1, 1), (2, 1, 3, 3), (0, 3, 4, 4), (2, 3, 1, 4), (2, 3, 4, 5, 6),
                  (1, 1, 1, 1, 2), (3, 2, 1, 1, 1)]:
        base = torch.zeros(shape)
        views = [base, base.expand(*shape), torch.zeros(()).expand(*shape)]
        for _ in range(12):
            perm = torch.randperm(len(shape), generator=g).tolist()
            views.append(base.permute(perm).contiguous().permute(sorted(range(len(shape)), key=perm.__getitem__)))
        big = torch.zeros([2 * s + 1 for s in shape]).contiguous(
            memory_format=torch.channels_last if len(shape) == 4 else torch.channels_last_3d)
        views.append(big[tuple(slice(0, 2 * s, 2) for s in shape)])  # a channels_last slice, not dense
        for v in views:
            assert _suggested(v) == suggest_memory_format(v), (shape, v.stride())
            tried.add(_suggested(v))
    assert tried == {torch.contiguous_format, torch.channels_last, torch.channels_last_3d}


@pytest.mark.slow  # torch.compile
def test_layouts_under_torch_compile() -> None:
    """While dynamo traces the backward, torch's kernel choice cannot be asked for: the meta kernel's rule
    lays the gradients out (channels_last when the input or the weight is)."""
    torch._dynamo.reset()
    f = torch.compile(lambda x, w: cg.conv(x, w, backend="fwdconv"), backend="aot_eager", fullgraph=True)
    x = torch.randn(2, 16, 9, 9, requires_grad=True)
    for fmt in (torch.contiguous_format, torch.channels_last):
        w = torch.randn(8, 16, 3, 3).contiguous(memory_format=fmt).requires_grad_()
        gx, gw = torch.autograd.grad(f(x, w).sum(), (x, w))
        assert gw.is_contiguous(memory_format=fmt) and gx.is_contiguous(memory_format=fmt)
        assert viewable(gw, 8, -1) == (fmt == torch.contiguous_format)  # fwdconv's own is (9, 72, 3, 1)
