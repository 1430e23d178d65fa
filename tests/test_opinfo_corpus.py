"""PyTorch's own OpInfo and ModuleInfo conv corpus as an oracle, over every backend (issue 25).

For nn.functional.conv{1,2,3}d and conv_transpose{1,2,3}d: every sample input (float64) gives torch's output and
gradients through convgrad's function of the same name; every error input that torch refuses is refused by convgrad
too (no escape); the samples pass gradcheck with check_batched_grad. For Conv*/ConvTranspose* in module_db: the
convgrad.nn module built with the same constructor arguments gives torch's output and gradients. Every test is in
the slow tier (importing the corpus alone takes seconds). Run with ``-s`` to see the counts.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import convgrad as cg
import convgrad.nn as cnn
from convgrad.backends import get_backend
from helpers import TOL

F64 = torch.float64
BACKENDS = cg.backends()
# The corpus is imported when a test first needs it, not at collection: torch.testing._internal takes several
# seconds to import, and every test here is in the slow tier. test_the_corpus_holds_these_entries pins the names.
OP_NAMES = [f"nn.functional.conv{t}{n}d" for t in ("", "_transpose") for n in (1, 2, 3)]
ERROR_OP_NAMES = [f"nn.functional.conv{n}d" for n in (1, 2, 3)]  # the ops with error_inputs_func
MODULE_NAMES = [f"Conv{t}{n}d" for t in ("", "Transpose") for n in (1, 2, 3)]


@functools.cache
def _corpus() -> tuple[dict[str, Any], dict[str, Any]]:
    """The conv entries of OpInfo's op_db and ModuleInfo's module_db, by name."""
    common_methods_invocations = pytest.importorskip("torch.testing._internal.common_methods_invocations")
    common_modules = pytest.importorskip("torch.testing._internal.common_modules")
    # importing torch.testing._internal freezes torch.backends' flags for the whole process (disable_global_flags,
    # as PyTorch's own test runner wants); the other tests, run in the same process, set them directly: unfreeze
    torch.backends.flags_frozen.__globals__["__allow_nonbracketed_mutation_flag"] = True
    assert not torch.backends.flags_frozen()
    ops = {op.name: op for op in common_methods_invocations.op_db if op.name.startswith("nn.functional.conv")}
    modules = {m.module_cls.__name__: m for m in common_modules.module_db
               if m.module_cls.__name__.startswith(("Conv", "ConvTranspose")) and hasattr(cnn, m.module_cls.__name__)}
    return ops, modules


def _op(name: str) -> Any:
    return _corpus()[0][name]


def _module(name: str) -> Any:
    return _corpus()[1][name]


@pytest.mark.slow
def test_the_corpus_holds_these_entries() -> None:
    """The names the tests are parametrised by are every conv entry of the corpus (a new one would be missed)."""
    ops, modules = _corpus()
    assert sorted(ops) == sorted(OP_NAMES)
    assert sorted(n for n, op in ops.items() if op.error_inputs_func is not None) == sorted(ERROR_OP_NAMES)
    assert sorted(modules) == sorted(MODULE_NAMES)


def _ours(op: Any) -> Any:
    return getattr(cg, op.name.rsplit(".", 1)[1])


def _differentiable(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


def _compare(ours: Any, theirs: Any, inputs: list[torch.Tensor], what: str, failures: list[str]) -> int:
    """Outputs and the gradients for one random grad_output; returns the number of comparisons."""
    count = 1
    try:
        torch.testing.assert_close(ours, theirs, **TOL[F64])
    except AssertionError as e:
        failures.append(f"{what} output: {str(e).splitlines()[0]}")
        return count
    if not inputs or not theirs.requires_grad:
        return count
    gy = torch.randn_like(theirs)
    got = torch.autograd.grad(ours, inputs, gy, allow_unused=True)
    want = torch.autograd.grad(theirs, inputs, gy, allow_unused=True)
    for i, (a, b) in enumerate(zip(got, want)):
        count += 1
        try:
            torch.testing.assert_close(a, b, **TOL[F64])
        except AssertionError as e:
            failures.append(f"{what} grad {i}: {str(e).splitlines()[0]}")
    return count


def _samples(op: Any) -> Iterator[Any]:
    yield from op.sample_inputs("cpu", F64, requires_grad=True)


def _check_op(op: Any, backend: str, limit: int | None = None) -> tuple[int, list[str]]:
    failures: list[str] = []
    count = 0
    for k, s in enumerate(_samples(op)):
        if limit is not None and k >= limit:
            break
        inputs = [t for t in (s.input, *s.args, *s.kwargs.values()) if _differentiable(t)]
        theirs = op.op(s.input, *s.args, **s.kwargs)
        ours = _ours(op)(s.input, *s.args, **s.kwargs, backend=backend)
        count += _compare(ours, theirs, inputs, f"{op.name} {backend} sample {k} {s.kwargs}", failures)
    return count, failures


@pytest.mark.slow  # its cost is the corpus's import, not the samples
def test_a_sample_of_the_corpus() -> None:
    """A quick slice: three conv2d and conv_transpose2d samples on fwdconv, one module input."""
    for name in ("nn.functional.conv2d", "nn.functional.conv_transpose2d"):
        count, failures = _check_op(_op(name), "fwdconv", limit=3)
        assert count >= 3 and not failures, failures
    count, failures = _check_module(_module("Conv2d"), "fwdconv", limit=1)
    assert count >= 1 and not failures, failures


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", OP_NAMES)
def test_opinfo_samples(name: str, backend: str) -> None:
    op = _op(name)
    count, failures = _check_op(op, backend)
    print(f"\n{op.name} {backend}: {count} comparisons, {len(failures)} mismatched")
    assert count > 0 and not failures, failures[:10]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", OP_NAMES)
def test_check_passes_torchs_own_kernel_on_every_sample_in_half_precision(name: str, dtype: torch.dtype) -> None:
    """`convgrad check`'s bound (issue 40, item 4) on each sample's layer, rounded to float16 and bfloat16: torch's
    own kernel (native) passes it in every one (tests/test_check.py sweeps random layers with large kernels)."""
    from convgrad.cli.check import check_config

    judged = 0
    for k, s in enumerate(_samples(_op(name))):
        weight = s.args[0]
        kw = {key: v for key, v in s.kwargs.items() if key != "bias"}
        _, results = check_config(tuple(s.input.shape), tuple(weight.shape), transposed="transpose" in name,
                                  dtype=dtype, backends=["native"], seed=k, **kw)
        failed = [r for r in results if r.failed]
        assert not failed, (k, s.kwargs, failed)
        judged += 1
    assert judged >= 10


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ERROR_OP_NAMES)
def test_opinfo_error_inputs_raise(name: str, backend: str) -> None:
    """Each input torch refuses is refused by convgrad too (an exception of any type: 0 escapes), except
    padding='same' with stride > 1, which convgrad defines (the TF/JAX rule; its output size is checked)."""
    op = _op(name)
    escapes, seen, extensions = [], 0, 0
    for e in op.error_inputs("cpu"):
        s = e.sample_input
        with pytest.raises(Exception):  # noqa: B017  # torch's own error types vary; what matters is a refusal
            op.op(s.input, *s.args, **s.kwargs)
        seen += 1
        if s.kwargs.get("padding") == "same" and s.kwargs.get("stride", 1) not in (1, (1,) * (s.input.dim() - 2)):
            # convgrad's documented extension (DESIGN.md, README): 'same' with stride > 1 by the TF/JAX rule,
            # out = ceil(i / stride); torch refuses it
            out = _ours(op)(s.input, *s.args, **s.kwargs, backend=backend)
            stride = s.kwargs["stride"]
            strides = (stride,) * (s.input.dim() - 2) if isinstance(stride, int) else tuple(stride)
            assert tuple(out.shape[2:]) == tuple(-(-i // st) for i, st in zip(s.input.shape[2:], strides))
            extensions += 1
            continue
        try:
            _ours(op)(s.input, *s.args, **s.kwargs, backend=backend)
        except Exception:  # any refusal counts
            continue
        escapes.append(f"{s.input.shape} {s.kwargs} (torch: {e.error_regex})")
    print(f"\n{op.name} {backend}: {seen} error inputs, {len(escapes)} escaped, {extensions} convgrad extensions")
    assert seen > 0 and not escapes, escapes


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in BACKENDS if get_backend(b).differentiable])
@pytest.mark.parametrize("name", OP_NAMES)
def test_opinfo_samples_pass_batched_gradcheck(name: str, backend: str) -> None:
    """OpInfo's test_fn_grad flags (check_batched_grad, check_grad_dtypes, check_undefined_grad, fast mode) on the
    first samples of each op."""
    op = _op(name)
    for k, s in enumerate(_samples(op)):
        if k >= 4:
            break
        tensors = tuple(t for t in (s.input, *s.args) if _differentiable(t))
        if not tensors or any(t.numel() == 0 for t in tensors):
            continue
        n = len(tensors)

        def f(*t: torch.Tensor, s: Any = s, n: int = n) -> torch.Tensor:
            args = list((s.input, *s.args))
            it = iter(t)
            args = [next(it) if _differentiable(a) else a for a in args]
            return _ours(op)(*args, **s.kwargs, backend=backend)

        assert torch.autograd.gradcheck(f, tensors, check_batched_grad=True, check_grad_dtypes=True,
                                        check_undefined_grad=True, fast_mode=True), (op.name, k)


def _check_module(info: Any, backend: str, limit: int | None = None) -> tuple[int, list[str]]:
    failures: list[str] = []
    count = 0
    inputs = info.module_inputs_func(info, device="cpu", dtype=F64, requires_grad=True, training=True)
    ours_cls = getattr(cnn, info.module_cls.__name__)
    for k, mi in enumerate(inputs):
        if limit is not None and k >= limit:
            break
        args, kwargs = mi.constructor_input.args, mi.constructor_input.kwargs
        theirs_m = info.module_cls(*args, **kwargs).to(F64)
        ours_m = ours_cls(*args, **kwargs, backend=backend).to(F64)
        ours_m.load_state_dict(theirs_m.state_dict())
        fwd_args, fwd_kwargs = mi.forward_input.args, mi.forward_input.kwargs
        x = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in fwd_args]
        theirs = theirs_m(*x, **fwd_kwargs)
        ours = ours_m(*x, **fwd_kwargs)
        what = f"{info.module_cls.__name__} {backend} input {k} {args} {kwargs}"
        leaves_ours = [t for t in x if _differentiable(t)] + list(ours_m.parameters())
        leaves_theirs = [t for t in x if _differentiable(t)] + list(theirs_m.parameters())
        count += 1
        try:
            torch.testing.assert_close(ours, theirs, **TOL[F64])
        except AssertionError as e:
            failures.append(f"{what} output: {str(e).splitlines()[0]}")
            continue
        gy = torch.randn_like(theirs)
        for i, (a, b) in enumerate(zip(torch.autograd.grad(ours, leaves_ours, gy),
                                       torch.autograd.grad(theirs, leaves_theirs, gy))):
            count += 1
            try:
                torch.testing.assert_close(a, b, **TOL[F64])
            except AssertionError as e:
                failures.append(f"{what} grad {i}: {str(e).splitlines()[0]}")
    return count, failures


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", MODULE_NAMES)
def test_moduleinfo_inputs(name: str, backend: str) -> None:
    info = _module(name)
    count, failures = _check_module(info, backend)
    print(f"\n{info.module_cls.__name__} {backend}: {count} comparisons, {len(failures)} mismatched")
    assert count > 0 and not failures, failures[:10]
