"""torch.compile(fullgraph=True) over convgrad, each case of issue 25, item 7: one graph, torch's gradients, and no
Dynamo warning that points into convgrad. Compiling is slow: every test is in the slow tier.

A fresh process is part of some cases (what is imported, which warnings Dynamo has already given once), so those
run a script in a subprocess.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call, grad, vmap

import convgrad as cg
from convgrad.tuning import modes
from helpers import TOL

F64 = torch.float64
SRC = str(Path(cg.__file__).resolve().parents[1])


def _run(script: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """The script in a fresh interpreter that imports this checkout's convgrad."""
    env = dict(os.environ, PYTHONPATH=SRC, CONVGRAD_AUTOTUNE=os.environ.get("CONVGRAD_AUTOTUNE", "fixed"))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.slow  # torch.compile: Dynamo and AOT tracing
def test_auto_with_one_gradient_compiles_in_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model's first layer needs grad_weight alone; auto's lookup key called torch.get_num_threads, which Dynamo
    cannot trace. While compiling, auto runs native for one gradient as it already did for both."""
    monkeypatch.setattr(modes, "_mode", "tune")
    torch._dynamo.reset()
    torch.manual_seed(0)
    ours, ref = cg.nn.Conv2d(2, 3, 3, stride=2).double(), torch.nn.Conv2d(2, 3, 3, stride=2).double()
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(4, 2, 9, 9, dtype=F64)  # no grad: grad_weight (and grad_bias) only
    torch.compile(lambda t: ours(t).square().sum(), backend="aot_eager", fullgraph=True)(x).backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, **TOL[F64])


@pytest.mark.slow
@pytest.mark.parametrize("backend", [b for b in cg.backends() if b != "numpy"])
def test_a_fresh_process_compiles_every_backend_in_one_graph(backend: str) -> None:
    """The first lookup of a backend imported the built-in backends (__import__), which Dynamo cannot trace."""
    done = _run(f"""
        import torch, torch.nn.functional as F, convgrad as cg
        x = torch.randn(2, 4, 9, 9, dtype=torch.float64, requires_grad=True)
        w = torch.randn(6, 2, 3, 3, dtype=torch.float64, requires_grad=True)
        f = torch.compile(lambda x, w: cg.conv2d(x, w, stride=2, groups=2, backend={backend!r}).square().sum(),
                          backend="aot_eager", fullgraph=True)
        ours = torch.autograd.grad(f(x, w), (x, w))
        ref = torch.autograd.grad(F.conv2d(x, w, stride=2, groups=2).square().sum(), (x, w))
        for a, b in zip(ours, ref):
            torch.testing.assert_close(a, b)
        print("compiled")
    """)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def _per_sample_grads(model: torch.nn.Module, x: torch.Tensor, compiled: bool) -> dict[str, torch.Tensor]:
    """torch.func's per-sample recipe: vmap(grad(functional_call)), compiled with fullgraph=True or eager."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def loss(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi.unsqueeze(0),)).square().sum()

    per_sample = vmap(grad(loss), in_dims=(None, 0))
    if compiled:
        per_sample = torch.compile(per_sample, backend="aot_eager", fullgraph=True)
    return per_sample(params, x)


@pytest.mark.slow
def test_compiled_per_sample_recipe_over_convgrad_modules() -> None:
    """compile(vmap(grad(functional_call))) over convgrad.nn modules and a patched model, convs feeding convs:
    nn.py's name helper read vars(cls), which Dynamo refuses once the trace mutated a dict; and Dynamo cannot vmap
    the Function wrapper of one conv whose output feeds the next."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, stride=2), torch.nn.Tanh(), torch.nn.Conv2d(4, 3, 3, padding=1),
                              torch.nn.ConvTranspose2d(3, 2, 3, stride=2)).double()
    built = torch.nn.Sequential(cg.nn.Conv2d(2, 4, 3, stride=2), torch.nn.Tanh(), cg.nn.Conv2d(4, 3, 3, padding=1),
                                cg.nn.ConvTranspose2d(3, 2, 3, stride=2)).double()
    built.load_state_dict(ref.state_dict())
    patched = cg.patch(copy.deepcopy(ref), backend="fwdconv")
    x = torch.randn(3, 2, 9, 9, dtype=F64)
    expected = _per_sample_grads(ref, x, compiled=False)
    for model in (built, patched):
        torch._dynamo.reset()
        got = _per_sample_grads(model, x, compiled=True)
        assert got.keys() == expected.keys()
        for name in expected:
            torch.testing.assert_close(got[name], expected[name], **TOL[F64], msg=name)


@pytest.mark.slow
def test_no_weight_gradients_is_never_ignored_under_compiled_grad() -> None:
    """torch.compile(torch.func.grad(...)) drops a Function's backward (pytorch/pytorch#193279): weights got their
    gradient (1235 where eager gives 0). With fullgraph=True convgrad refuses, naming no_weight_gradients; without
    it Dynamo falls back to eager, where the gradient is 0; outside the scope the compiled gradient is torch's."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(1, 2, 5, 5, generator=g, dtype=F64), torch.randn(3, 2, 3, 3, generator=g, dtype=F64)

    def loss(w_: torch.Tensor, x_: torch.Tensor) -> torch.Tensor:
        return cg.conv2d(x_, w_, backend="fwdconv").square().sum()

    with cg.no_weight_gradients():
        assert torch.func.grad(loss)(w, x).abs().max() == 0  # eager: the backward skips grad_weight
        with pytest.raises(Exception, match="no_weight_gradients"):
            torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)(w, x)
        torch._dynamo.reset()
        assert torch.compile(torch.func.grad(loss), backend="aot_eager")(w, x).abs().max() == 0
    torch._dynamo.reset()
    plain = torch.compile(loss, backend="aot_eager", fullgraph=True)  # no transform: the backward is convgrad's
    wr = w.clone().requires_grad_()
    with cg.no_weight_gradients():
        plain(wr, x).backward()
    assert wr.grad is None
    ref = torch.func.grad(lambda w_, x_: F.conv2d(x_, w_).square().sum())(w, x)
    got = torch.compile(torch.func.grad(loss), backend="aot_eager", fullgraph=True)(w, x)
    torch.testing.assert_close(got, ref, **TOL[F64])


@pytest.mark.slow
def test_compiling_a_fwdconv_model_gives_no_warning_from_convgrad() -> None:
    """Dynamo warned twice that it ignores the lru_cache of fwdconv's plans ("Silent incorrectness is only a
    potential risk"), pointing into fwdconv.py. Dynamo warns once per process, hence the fresh one."""
    done = _run("""
        import warnings, torch, convgrad as cg
        warnings.simplefilter("always")
        m = cg.patch(torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3, stride=2), torch.nn.ReLU(),
                                         torch.nn.Conv2d(3, 3, 3, dilation=2, padding=2)), backend="fwdconv")
        x = torch.randn(2, 2, 9, 9, requires_grad=True)
        with warnings.catch_warnings(record=True) as caught:
            torch.compile(m, backend="aot_eager", fullgraph=True)(x).sum().backward()
        for w in caught:
            print("WARNING", w.filename, str(w.message).splitlines()[0])
        print("compiled")
    """)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
    convgrad_warnings = [line for line in (done.stdout + done.stderr).splitlines()
                         if ("WARNING" in line or "Warning" in line) and ("convgrad" in line or "fwdconv" in line
                                                                          or "Silent incorrectness" in line)]
    assert not convgrad_warnings


@pytest.mark.slow
def test_two_explains_with_a_reset_leave_what_torch_leaves() -> None:
    """Issue 25, item 8 (a process hung at exit after two torch._dynamo.explain calls with a reset between them):
    convgrad's per-call import made Dynamo trace importlib (a posix.stat warning) and left 12 captured tracebacks
    alive where torch's own conv_transpose2d leaves 4. Each process counts them after the resets and must exit."""
    code = """
        import gc, torch, torch._dynamo, torch.nn.functional as F, warnings
        import convgrad as cg
        x, w = torch.randn(1, 2, 5, 5, requires_grad=True), torch.randn(2, 3, 3, 3, requires_grad=True)
        f = ((lambda x, w: F.conv_transpose2d(x, w, stride=2)) if "WHICH" == "torch"
             else (lambda x, w: cg.conv_transpose2d(x, w, stride=2)))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch._dynamo.explain(f)(x, w)
            torch._dynamo.reset()
            torch._dynamo.explain(f)(x, w)
            torch._dynamo.reset()
        gc.collect()
        print("tracebacks", sum(type(o).__name__ == "CapturedTraceback" for o in gc.get_objects()))
        print("warnings", [str(m.message)[:60] for m in caught if "posix" in str(m.message)])
    """
    counts = {}
    for which in ("torch", "convgrad"):
        done = _run(code.replace("WHICH", which), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        counts[which] = done.stdout
    assert counts["convgrad"] == counts["torch"], counts
