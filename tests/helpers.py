"""The one comparison helper of the test suite: anything against torch autograd.

The reference for every gradient is torch autograd through torch's own
convolution. Where torch's functional API cannot express a configuration
(asymmetric padding, 'same' with stride), the reference runs torch's conv on the
explicitly padded input (forward) or crops torch's transposed output.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import random
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from convgrad.spec import ConvSpec

# One tolerance table, keyed by dtype (STYLE.md).
TOL: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"rtol": 1e-7, "atol": 1e-9},
    torch.float32: {"rtol": 2e-4, "atol": 2e-5},
    torch.complex128: {"rtol": 1e-7, "atol": 1e-9},
    torch.complex64: {"rtol": 2e-4, "atol": 2e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
    torch.float16: {"rtol": 2e-3, "atol": 2e-3},
}

_F_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_F_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class Case:
    """One convolution configuration, in torch's argument names."""

    input_shape: tuple[int, ...]
    weight_shape: tuple[int, ...]
    stride: Any = 1
    padding: Any = 0
    dilation: Any = 1
    groups: int = 1
    transposed: bool = False
    output_padding: Any = 0
    name: str = field(default="", compare=False)

    def spec(self) -> ConvSpec:
        return ConvSpec.from_shapes(self.input_shape, self.weight_shape, self.stride, self.padding, self.dilation,
                                    self.transposed, self.output_padding, self.groups, fn="test")

    def kwargs(self) -> dict[str, Any]:
        kw = dict(stride=self.stride, padding=self.padding, dilation=self.dilation, groups=self.groups)
        if self.transposed:
            kw["output_padding"] = self.output_padding
        return kw

    def __str__(self) -> str:
        return self.name or self.spec().describe()


def layer_case(name: str, cin: int, cout: int, size: tuple[int, ...], k: tuple[int, ...], batch: int = 3,
               transposed: bool = False, **kw: object) -> Case:
    """A Case from channels (C_in -> C_out), spatial size and kernel size, the weight laid out as torch's."""
    g = int(kw.get("groups", 1))  # type: ignore[call-overload]
    weight = (cin, cout // g, *k) if transposed else (cout, cin // g, *k)
    return Case((batch, cin, *size), weight, transposed=transposed, name=name, **kw)  # type: ignore[arg-type]


def per_sample_reference(case: Case, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """(N, *weight_shape): torch autograd's weight gradient of each sample alone (the per-sample oracle)."""
    one = dataclasses.replace(case, input_shape=(1, *case.input_shape[1:]))
    n = case.input_shape[0]
    if n == 0:
        return t["input"].new_zeros(0, *case.weight_shape)
    return torch.stack([reference_grads(one, {**t, "input": t["input"][i:i + 1],
                                              "grad_output": t["grad_output"][i:i + 1]})["grad_weight"]
                        for i in range(n)])


def backend_accepts(backend: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether a backend computes this dtype on this device (numpy refuses half precision and CUDA, by design):
    a refusal must name the backend; any other error propagates."""
    import convgrad as cg

    t = torch.ones(1, 1, 2, dtype=dtype, device=device)
    try:
        cg.conv_backward(t, t, torch.ones(1, 1, 1, dtype=dtype, device=device), backend=backend)
    except (TypeError, ValueError) as err:
        if f"backend={backend!r}" not in str(err):
            raise
        return False
    return True


def reference_forward(case: Case, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """torch's own conv for the case, with explicit padding where torch cannot express it."""
    spec = case.spec()
    n = spec.n
    unbatched = spec.unbatched
    if unbatched:
        x = x.unsqueeze(0)
    if not spec.transposed:
        if spec.is_symmetric:
            y = _F_CONV[n](x, w, b, spec.stride, spec.symmetric_padding, spec.dilation, spec.groups)
        else:
            flat = [v for lo, hi in reversed(spec.padding) for v in (lo, hi)]
            y = _F_CONV[n](F.pad(x, flat), w, b, spec.stride, 0, spec.dilation, spec.groups)
    elif spec.is_symmetric:
        y = _F_CONV_T[n](x, w, b, spec.stride, spec.symmetric_padding, spec.output_padding, spec.groups, spec.dilation)
    else:
        full = _F_CONV_T[n](x, w, b, spec.stride, 0, spec.output_padding, spec.groups, spec.dilation)
        y = full[(..., *(slice(lo, full.shape[2 + j] - hi) for j, (lo, hi) in enumerate(spec.padding)))]
    return y.squeeze(0) if unbatched else y


def make_tensors(case: Case, dtype: torch.dtype = torch.float64, device: str = "cpu", seed: int = 0,
                 bias: bool = True) -> dict[str, torch.Tensor]:
    """Random input, weight, bias and grad_output for the case (grad_output shaped like the output)."""
    g = torch.Generator().manual_seed(seed)
    spec = case.spec()

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)

    out_shape = spec.output_shape[1:] if spec.unbatched else spec.output_shape
    t = {"input": rand(*case.input_shape), "weight": rand(*case.weight_shape), "grad_output": rand(*out_shape)}
    if bias:
        t["bias"] = rand(spec.out_channels)
    return t


def reference_grads(case: Case, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """grad_input, grad_weight, grad_bias by torch autograd through torch's conv."""
    x = t["input"].detach().requires_grad_()
    w = t["weight"].detach().requires_grad_()
    b = t["bias"].detach().requires_grad_() if "bias" in t else None
    y = reference_forward(case, x, w, b)
    leaves = [x, w] + ([b] if b is not None else [])
    grads = torch.autograd.grad(y, leaves, t["grad_output"], allow_unused=True)
    names = ["grad_input", "grad_weight", "grad_bias"]
    return {k: (torch.zeros_like(leaf) if gr is None else gr) for k, leaf, gr in zip(names, leaves, grads)}


@functools.cache
def _shared_reference(case: Case, dtype: torch.dtype, seed: int) -> tuple[dict[str, torch.Tensor],
                                                                          dict[str, torch.Tensor]]:
    t = make_tensors(case, dtype, seed=seed)
    return t, reference_grads(case, t)


def tensors_and_reference(case: Case, dtype: torch.dtype = torch.float64, seed: int = 0
                          ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """make_tensors and reference_grads for the case, the reference computed once per session (a grid judges every
    backend against the same one). The tensors are fresh copies, so what a backend does to its inputs stays there."""
    t, ref = _shared_reference(case, dtype, seed)
    return {k: v.clone() for k, v in t.items()}, ref


def assert_matches_autograd(ours: dict[str, torch.Tensor | None], ref: dict[str, torch.Tensor], dtype: torch.dtype,
                            context: str = "") -> None:
    """Every gradient in `ours` equals torch autograd's within TOL[dtype]; shapes and dtypes match exactly."""
    assert ours, "nothing to compare"
    for name, value in ours.items():
        assert value is not None, f"{context}: {name} is None"
        expected = ref[name]
        assert value.shape == expected.shape, f"{context}: {name} shape {tuple(value.shape)} != {tuple(expected.shape)}"
        assert value.dtype == expected.dtype, f"{context}: {name} dtype {value.dtype} != {expected.dtype}"
        torch.testing.assert_close(value, expected, **TOL[dtype], msg=lambda m, n=name: f"{context}: {n}: {m}")


# ---- the grid ---------------------------------------------------------------------------------------------------

# On the grid's small cases these backends compute through another: auto in fixed mode is native, chunked holds the
# batch in one chunk, regroup merges by a factor of 1. tests/test_auto.py, test_chunked.py and test_regroup.py force
# their own paths (a tuning race, several chunks, merges > 1); the full grids over them run in the slow tier.
DELEGATING = ("auto", "chunked", "regroup")


def grid_backends(names: list[str]) -> list[Any]:
    """Backend parameters for a full grid: the ones in DELEGATING marked slow (the full tier only)."""
    import pytest

    return [pytest.param(b, marks=pytest.mark.slow) if b in DELEGATING else b for b in names]


# One case of each configuration class the project's standards name, for grids whose other cases run the same code
# on the same backend: a stride leaving rows unread (r = 1 and r = 2 with an even kernel), 1 < groups < C_in,
# depthwise (its (C, 1, k, k) weight is contiguous in both memory formats), dilation with stride, even and
# non-square kernels, asymmetric padding, 'same', 1d and 3d, transposed with output_padding (also grouped and with
# asymmetric padding), batch 0 and 1, unbatched. Every backend of such a grid runs these in the fast tier and every
# case in the slow tier.
REPRESENTATIVE = frozenset({
    "2d-plain", "1d-dilation2-stride2", "3d-dilation2-stride2", "2d-stride3-leftover2", "3d-stride2-leftover",
    "2d-groups2-cin4", "2d-depthwise-multiplier", "1d-asym-padding", "2d-same-even-kernel", "2d-mixed-per-dim",
    "3d-mixed-per-dim", "2d-batch0", "2d-batch1", "3d-batch1", "2d-unbatched",
    "1d-T-stride2-op1", "2d-T-stride2-op1", "3d-T-stride3-op2-groups2", "2d-T-asym-padding", "2d-T-batch0",
    "2d-T-unbatched",
})


def grid_params(cases: list[Case]) -> list[Any]:
    """Case parameters for such a grid (ids: the case names): the REPRESENTATIVE cases in both tiers, the others
    marked slow (the full tier only)."""
    import pytest

    return [c if c.name in REPRESENTATIVE else pytest.param(c, marks=pytest.mark.slow) for c in cases]


def _c(n: int, name: str, cin: int, cout: int, size: Any, k: Any, transposed: bool = False, batch: int | None = 2,
       **kw: Any) -> Case:
    size = (size,) * n if isinstance(size, int) else tuple(size)
    k = (k,) * n if isinstance(k, int) else tuple(k)
    g = kw.get("groups", 1)
    weight = (cin, cout // g, *k) if transposed else (cout, cin // g, *k)
    shape = (cin, *size) if batch is None else (batch, cin, *size)
    return Case(shape, weight, transposed=transposed, name=f"{n}d-{'T-' if transposed else ''}{name}", **kw)


def grid_cases() -> list[Case]:
    """Every hard case of the field, in 1d, 2d and 3d, forward and transposed."""
    cases: list[Case] = []
    for n in (1, 2, 3):
        s = 7 if n < 3 else 5
        cases += [
            _c(n, "plain", 3, 4, s, 3),
            _c(n, "stride2-leftover", 2, 3, s + 1, 3, stride=2),  # r = 1, a real row unread
            _c(n, "stride3-leftover2", 2, 3, s + 1, 2, stride=3),  # even kernel, r = 2
            _c(n, "asym-padding", 2, 3, s, 3, padding=((1, 2),) * n),
            _c(n, "dilation2-stride2", 2, 4, s + 2, 3, stride=2, dilation=2, padding=1),
            _c(n, "dilation3-stride2-pad", 2, 2, s + 3, 2, stride=2, dilation=3, padding=2),
            _c(n, "groups2-cin4", 4, 6, s, 3, groups=2, stride=2, padding=1),
            _c(n, "depthwise", 4, 4, s, 3, groups=4, padding=1),
            _c(n, "depthwise-multiplier", 3, 6, s, 3, groups=3, stride=2),
            _c(n, "same-even-kernel", 2, 3, s, 4, padding="same"),
            _c(n, "same-stride2", 2, 3, s, 3, padding="same", stride=2),
            _c(n, "valid", 2, 3, s, 2, padding="valid"),
            _c(n, "padding-ge-kernel", 2, 2, 3, 2, padding=3, stride=2),
            _c(n, "batch0", 2, 3, s, 3, batch=0, stride=2),
            _c(n, "batch1", 2, 3, s, 3, batch=1, padding=1),
            _c(n, "unbatched", 2, 3, s, 3, batch=None, stride=2),
            _c(n, "plain", 3, 4, 4, 3, transposed=True),
            _c(n, "stride2-op1", 2, 3, 4, 3, transposed=True, stride=2, padding=1, output_padding=1),
            _c(n, "stride3-op2-groups2", 4, 6, 3, 2, transposed=True, stride=3, output_padding=2, groups=2),
            _c(n, "dilation3-op2-ge-stride", 2, 3, 3, 3, transposed=True, stride=2, dilation=3, output_padding=2),
            _c(n, "asym-padding", 2, 3, 4, 3, transposed=True, stride=2, padding=((2, 1),) * n),
            _c(n, "depthwise", 3, 3, 4, 3, transposed=True, groups=3, stride=2),
            _c(n, "batch0", 2, 3, 3, 3, transposed=True, batch=0, stride=2),
            _c(n, "unbatched", 2, 3, 3, 3, transposed=True, batch=None, stride=2, output_padding=1),
        ]
    cases.append(_c(2, "mixed-per-dim", 3, 6, (9, 6), (3, 2), stride=(2, 1), dilation=(1, 2),
                    padding=((0, 2), (1, 0)), groups=3))
    cases.append(_c(3, "mixed-per-dim", 2, 4, (5, 4, 6), (2, 3, 1), stride=(1, 2, 3), dilation=(2, 1, 1), groups=2,
                    padding=(1, 0, 2)))
    return cases


def random_cases(count: int, seed: int) -> list[Case]:
    """Seeded random valid configurations (forward and transposed, dims 1-3)."""
    rng = random.Random(seed)
    out: list[Case] = []
    while len(out) < count:
        n = rng.choice((1, 2, 3))
        transposed = rng.random() < 0.4
        g = rng.choice((1, 1, 2, 3))
        cin, cout = g * rng.randint(1, 3), g * rng.randint(1, 3)
        k = tuple(rng.randint(1, 4) for _ in range(n))
        s = tuple(rng.randint(1, 3) for _ in range(n))
        d = tuple(rng.randint(1, 3) for _ in range(n))
        size = tuple(rng.randint(1, 9 if n < 3 else 6) for _ in range(n))
        if transposed:
            pad = tuple(rng.randint(0, 2) for _ in range(n))
            op = tuple(rng.randint(0, max(si, di) - 1) for si, di in zip(s, d))
            case = Case((rng.randint(0, 3), cin, *size), (cin, cout // g, *k), s, pad, d, g, True, op)
        else:
            pad = rng.choice([tuple((rng.randint(0, 3), rng.randint(0, 3)) for _ in range(n)), "same",
                              tuple(rng.randint(0, 3) for _ in range(n))])
            case = Case((rng.randint(0, 3), cin, *size), (cout, cin // g, *k), s, pad, d, g)
        try:
            spec = case.spec()
        except ValueError:
            continue
        if math.prod(spec.output_shape[2:]) <= 4096:
            out.append(Case(case.input_shape, case.weight_shape, case.stride, case.padding, case.dilation, case.groups,
                            case.transposed, case.output_padding, name=f"random{seed}-{len(out)}"))
    return out


def assert_gradchecks(backend: str, xs: tuple[int, ...], ws: tuple[int, ...], kw: dict[str, Any],
                      transposed: bool = False, bias: bool = True, seed: int = 0) -> None:
    """gradcheck and gradgradcheck (fast mode) of cg.conv (or cg.conv_transpose) with this backend, float64."""
    import convgrad as cg

    g = torch.Generator().manual_seed(seed)
    shapes = (xs, ws, (ws[1] * kw.get("groups", 1) if transposed else ws[0],))[:3 if bias else 2]
    tensors = tuple(torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes)
    conv = cg.conv_transpose if transposed else cg.conv

    def f(*t: torch.Tensor) -> torch.Tensor:
        return conv(*t, backend=backend, **kw)

    assert torch.autograd.gradcheck(f, tensors)
    assert torch.autograd.gradgradcheck(f, tensors, fast_mode=True)


def load_script(name: str, path: Path) -> ModuleType:
    """A script that is not in a package (docs/*.py), imported as module ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def graph_node_names(t: torch.Tensor) -> set[str]:
    """Names of every autograd node behind t."""
    seen, todo = set(), [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        todo += [nxt for nxt, _ in node.next_functions]
    return {type(node).__name__ for node in seen}


def python_frames(step: Callable[[], object]) -> int:
    """How many Python frames one call of step enters (``sys.setprofile``'s call events): deterministic, where a
    timing of a per-call cut is noise."""
    count = 0

    def profile(frame: object, event: str, arg: object) -> None:
        nonlocal count
        count += event == "call"

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return count


def per_sample_loop(model: torch.nn.Module, loss: Callable[[torch.Tensor], torch.Tensor],
                    *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    """The per-sample gradients of every trainable parameter, one sample at a time by torch autograd:
    {name: (N, *param.shape)}, each sample's own loss(model(sample))."""
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    for i in range(inputs[0].shape[0]):
        grads = torch.autograd.grad(loss(model(*(t[i:i + 1] for t in inputs))), list(params.values()))
        for k, g in zip(params, grads, strict=True):
            rows[k].append(g)
    return {k: torch.stack(v) if v else p.new_zeros(0, *p.shape) for (k, v), p in zip(rows.items(), params.values())}


def assert_per_sample_matches_the_loop(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                                       loss: Callable[[torch.Tensor], torch.Tensor], norms_only: bool,
                                       dtype: torch.dtype = torch.float64) -> Any:
    """PerSampleGrads over ``model`` with a summed ``loss`` against ``per_sample_loop``: every trainable parameter's
    per-sample gradients (full mode), the norms and the clipped sum at the median norm (both modes). Returns the
    context (for its report)."""
    import convgrad as cg

    ref = per_sample_loop(model, loss, *inputs)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=norms_only) as psg:
        loss(model(*inputs)).backward()
    if not norms_only:
        assert_matches_autograd({k: p.grad_sample for k, p in params.items()}, ref, dtype, "grad_sample")
    torch.testing.assert_close(psg.norms(), norms, **TOL[dtype])
    model.zero_grad()
    bound = float(norms.median())
    psg.clip_and_accumulate(bound)
    factors = (bound / (norms + 1e-6)).clamp(max=1.0)
    assert_matches_autograd({k: p.grad for k, p in params.items()},
                            {k: torch.tensordot(factors, g, dims=1) for k, g in ref.items()}, dtype, "clipped sum")
    return psg


def opacus_private_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str, max_norm: float,
                        reduction: str = "sum") -> dict[str, Any]:
    """One Opacus PrivacyEngine step (hooks or ghost ``mode``, a cross-entropy loss) with noise 0 and one fixed
    batch; the optimizer's lr 0 leaves .grad to read. Returns {name: .grad} and, under "functorch", the modules
    Opacus ran its functorch fallback on."""
    from opacus import PrivacyEngine

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    criterion = torch.nn.CrossEntropyLoss(reduction=reduction)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus warns about its secure RNG and about the accountant's alphas
        made = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                            data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_norm,
                                            poisson_sampling=False, loss_reduction=reduction,
                                            grad_sample_mode=mode, criterion=criterion)
    gsm, opt, loader = made[0], made[1], made[-1]
    criterion = made[2] if mode == "ghost" else criterion  # ghost wraps the loss for its two backward passes
    for xb, yb in loader:
        opt.zero_grad()
        criterion(gsm(xb), yb).backward()
        opt.step()
    out = {k: p.grad.clone() for k, p in model.named_parameters()}
    out["functorch"] = [k for k, m in model.named_modules() if hasattr(m, "ft_compute_sample_grad")]  # type: ignore
    gsm._close()
    return out
