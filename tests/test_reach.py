"""patch() reaches every convolution a model runs (issue 38): subclasses with a forward of their own, F.conv*d called
in a forward, weights computed in the forward; gradients equal torch's in float64, and no call is left to torch's
own convolution. The small copies of timm's and StyleGAN's layers are in tests/patterns.py; timm itself runs in the
full tier (tests/test_timm.py)."""

from __future__ import annotations

import copy
import io
import pickle
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import convgrad as cg
from convgrad.nn.patching import Routing
from helpers import TOL, assert_matches_autograd
from patterns import BlurPool, Functional, ModulatedConv, SameConv, StdConv, network

DT = torch.float64
_CONVS = (torch.conv1d, torch.conv2d, torch.conv3d, torch.conv_transpose1d, torch.conv_transpose2d,
          torch.conv_transpose3d)

pytestmark = pytest.mark.usefixtures("one_thread")


class Bypass(TorchFunctionMode):
    """Counts the torch conv function calls that reach it. Entered around a patched model's call, it sits below
    convgrad's routing mode: a routed call never reaches it as a conv function (convgrad's native forward runs
    aten.convolution), one that escaped routing does."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        if func in _CONVS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _grads(model: nn.Module, *inputs: torch.Tensor) -> dict[str, torch.Tensor]:
    out = model(*inputs)
    names = [k for k, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), [p for p in model.parameters() if p.requires_grad])
    return dict(zip(names, grads, strict=True))


def _inputs(name: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    if name == "functional":
        return (torch.randn(3, 2, 5, dtype=DT, generator=g),)
    if name == "modulated":
        return torch.randn(3, 4, 6, 6, dtype=DT, generator=g), torch.randn(3, 5, dtype=DT, generator=g)
    return (torch.randn(3, 3, 12, 12, dtype=DT, generator=g),)


MODELS = {"network": lambda: network(), "functional": lambda: Functional(),
          "modulated": lambda: ModulatedConv(4, 3, 3, 5)}


@pytest.mark.parametrize("backend", ["native", "fwdconv", "auto", "fft", "gemm"])
@pytest.mark.parametrize("name", list(MODELS))
def test_patched_gradients_equal_torchs_for_every_way_of_calling_a_conv(name: str, backend: str) -> None:
    torch.manual_seed(0)
    model = MODELS[name]().to(DT)
    inputs = _inputs(name)
    expected = _grads(model, *inputs)
    patched = cg.patch(copy.deepcopy(model), backend=backend, force=True)  # every layer, where it cannot win too
    assert_matches_autograd(_grads(patched, *inputs), expected, DT, f"{name} patched {backend}")


@pytest.mark.parametrize("name", list(MODELS))
def test_no_conv_call_of_a_patched_model_is_left_to_torch(name: str) -> None:
    """Before issue 38 a subclass's own forward, a blur pool and a modulated conv called torch's conv themselves."""
    model = MODELS[name]().to(DT)
    with Bypass() as plain:
        model(*_inputs(name))
    assert plain.calls, "the model makes torch conv calls"
    cg.patch(model, backend="native")
    with Bypass() as bypass:
        model(*_inputs(name))
    assert bypass.calls == []


def test_the_weight_a_forward_computes_gets_no_gradient_under_no_weight_gradients() -> None:
    """A routed conv honours the scope: before issue 38 StdConv's weight still got its gradient."""
    model = cg.patch(network().to(DT), backend="fwdconv")
    x = _inputs("network")[0].requires_grad_()
    with cg.no_weight_gradients():
        model(x).square().sum().backward()
    conv_weights = {k for k, p in model.named_parameters() if p.dim() == 4}
    assert conv_weights and all(model.get_parameter(k).grad is None for k in conv_weights)
    assert model[-1].a.grad is not None and x.grad is not None  # the rest still gets its gradients


def test_a_routed_modules_repr_names_its_backend_and_an_error_names_the_call() -> None:
    model = cg.patch(nn.Sequential(SameConv(2, 3, 3, stride=2), BlurPool(3)), backend="gemm")
    assert repr(model[0]).startswith("PatchedSameConv(2, 3, kernel_size=(3, 3), stride=(2, 2), backend='gemm')")
    assert repr(model[1]) == "BlurPool()"  # no backend of its own to claim
    with pytest.raises(ValueError, match=r"conv2d in BlurPool\.forward: .*channels"):
        model[1](torch.randn(1, 4, 6, 6))  # 4 channels where the kernel has 3 groups


def test_nested_routed_forwards_share_one_mode() -> None:
    """An operation pays one __torch_function__ call however deep the routed modules nest."""
    depths: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = torch._C._len_torch_function_stack()
            depths.append(sum(isinstance(torch._C._get_function_stack_at(i), Routing) for i in range(n)))
            return F.conv1d(x, torch.ones(1, 1, 1, dtype=x.dtype))

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(Probe(), Probe())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(x)

    cg.patch(Outer())(torch.randn(1, 1, 3))
    assert depths == [1, 1]


def test_unpatch_pickle_and_deepcopy_keep_routed_modules_as_they_were() -> None:
    model = network().to(DT)
    x = _inputs("network")[0]
    classes = [type(m) for m in model.modules()]
    cg.patch(model, backend="fwdconv")
    clone = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for twin in (clone, copy.deepcopy(model), torch.load(buffer, weights_only=False)):
        assert [type(m).__name__ for m in twin.modules()] == [type(m).__name__ for m in model.modules()]
        torch.testing.assert_close(twin(x), model(x), **TOL[DT])
    assert [type(m) for m in cg.unpatch(model).modules()] == classes
    assert not any(hasattr(m, "_convgrad_backend") or hasattr(m, "backend") for m in model.modules())


def test_a_patched_model_with_functional_convs_runs_under_vmap_and_trace() -> None:
    model = cg.patch(network().to(DT), backend="fwdconv")
    x = _inputs("network")[0]
    expected = model(x)
    batched = torch.func.vmap(model)(x.unsqueeze(1))  # (N, 1, ...): a batch of one per call
    torch.testing.assert_close(batched.squeeze(1), expected, **TOL[DT])
    traced = torch.jit.trace(model, x, check_trace=False)
    torch.testing.assert_close(traced(x), expected, **TOL[DT])


@pytest.mark.slow  # torch.compile and torch.export: Dynamo
@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_patched_model_with_functional_convs_compiles_and_keeps_torchs_gradients(fullgraph: bool) -> None:
    torch._dynamo.reset()
    model = network().to(DT)
    x = _inputs("network")[0]
    expected = _grads(model, x)
    patched = cg.patch(copy.deepcopy(model), backend="fwdconv")
    compiled = torch.compile(patched, backend="aot_eager", fullgraph=fullgraph)
    grads = torch.autograd.grad(compiled(x).square().sum(), [p for p in patched.parameters() if p.requires_grad])
    assert_matches_autograd(dict(zip(expected, grads, strict=True)), expected, DT, f"compiled fullgraph={fullgraph}")


@pytest.mark.slow
@pytest.mark.parametrize("strict", [False, True])
def test_a_patched_model_with_functional_convs_exports(strict: bool) -> None:
    model = cg.patch(network().to(DT), backend="fwdconv")
    x = _inputs("network")[0]
    program = torch.export.export(model, (x,), strict=strict)
    torch.testing.assert_close(program.module()(x), model(x), **TOL[DT])


@pytest.mark.slow  # torch.compile: Dynamo
@pytest.mark.parametrize("backend", ["native", "fwdconv", "auto", "fft", "gemm", "channels_last", "regroup",
                                     "chunked"])
def test_a_strided_depthwise_conv_compiles_in_one_graph(backend: str) -> None:
    """Regression: fwdconv's polyphase plan of a strided depthwise layer failed to trace (math.prod over a
    generator; a cached_property's lock): timm's resnetblur18 patched, under torch.compile(fullgraph=True)."""
    torch._dynamo.reset()
    x = torch.randn(2, 3, 8, 8, dtype=DT, requires_grad=True)
    w = torch.randn(3, 1, 3, 3, dtype=DT, requires_grad=True)
    f = torch.compile(lambda a, b: cg.conv2d(a, b, stride=2, groups=3, backend=backend).square().sum(),
                      backend="aot_eager", fullgraph=True)
    ours = torch.autograd.grad(f(x, w), (x, w))
    ref = torch.autograd.grad(F.conv2d(x, w, stride=2, groups=3).square().sum(), (x, w))
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[DT])


def test_patch_routes_a_user_subclass_of_a_convgrad_module() -> None:
    class Doubled(cg.nn.Conv2d):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.conv2d(x, 2 * self.weight, self.bias)

    model = Doubled(2, 2, 3).to(DT)
    x = torch.randn(1, 2, 5, 5, dtype=DT)
    expected = _grads(model, x)
    cg.patch(model, backend="native")
    with Bypass() as bypass:
        assert_matches_autograd(_grads(model, x), expected, DT, "subclass of cg.nn.Conv2d")
    assert bypass.calls == [] and type(model).__name__ == "PatchedDoubled"


def test_stdconv_is_standardised_in_the_patched_forward() -> None:
    """A direct check of what the patterns stand for: StdConv's patched output is the conv of the standardised
    weight (not of the raw one)."""
    conv = StdConv(2, 3, 3).to(DT)
    x = torch.randn(2, 2, 5, 5, dtype=DT)
    w = conv.weight.detach()
    std = (w - w.mean((1, 2, 3), keepdim=True)) / torch.sqrt(w.var((1, 2, 3), unbiased=False, keepdim=True) + 1e-6)
    torch.testing.assert_close(cg.patch(conv, backend="fwdconv")(x), F.conv2d(x, std, conv.bias), **TOL[DT])


def _replknet_block() -> nn.Module:
    """A RepLKNet-style block: 1x1 convs around a 31x31 depthwise conv (fft wins only on the large kernel)."""
    return nn.Sequential(nn.Conv2d(4, 8, 1), nn.Conv2d(8, 8, 31, padding=15, groups=8), nn.Conv2d(8, 4, 1))


def test_patch_keeps_torchs_conv_where_the_forced_backends_cost_model_rules_it_out() -> None:
    """Regression (issue 41, item 4): patch(model, backend="fft") ran fft on the 1x1 convs too, 20-90x slower
    each, silently; the block ran 0.70x as fast as unpatched."""
    x = torch.randn(2, 4, 40, 40, requires_grad=True)
    model = cg.patch(_replknet_block(), backend="fft")
    with pytest.warns(UserWarning, match=r"patch\(backend='fft'\): fft's cost model rules it out on conv2d "
                                         r"input=\(2, 4, 40, 40\) weight=\(8, 4, 1, 1\).*force=True") as seen:
        model(x).sum().backward()
    assert len([w for w in seen if "cost model rules it out" in str(w.message)]) == 2  # the two 1x1 layers
    rows = cg.report(model, x).calls
    assert [r.gradients for r in rows] == ["native", "fft", "native"]
    forced = cg.patch(_replknet_block(), backend="fft", force=True)
    assert [r.gradients for r in cg.report(forced, x).calls] == ["fft", "fft", "fft"]
    with pytest.raises(TypeError, match="patch: force='yes' must be a bool"):
        cg.patch(_replknet_block(), force="yes")  # type: ignore[arg-type]


def test_patch_of_a_model_with_nothing_to_patch_says_so() -> None:
    """Regression (issue 41, item 4): patch(nn.Linear(3, 3)) silently did nothing."""
    with pytest.warns(UserWarning, match="patch: Linear has no convolution module and no module with a forward"):
        cg.patch(nn.Linear(3, 3))


def test_report_names_each_conv_call_and_what_auto_chose_from_the_store(tuned: None) -> None:
    """cg.report (issue 38: patch says what it routed; issue 41: what auto chose, per layer): one row per conv call
    of the forward, in order, each reached by convgrad once patched, with auto's choice as its store holds it."""
    from convgrad.backends import auto

    model = network().to(DT)
    x = _inputs("network")[0]
    plain = cg.report(model, x)
    assert plain.reached == 0 and [c.backend for c in plain.calls] == ["torch"] * 7
    cg.patch(model)
    for _ in range(3):
        model(x).square().sum().backward()
    report = cg.report(model, x)
    assert report.reached == 7 and [c.call for c in report.calls] == [
        "conv2d in SameConv.forward", "conv2d in StdConv.forward", "conv2d in ScaledStdConv.forward",
        "conv2d in BlurPool.forward", "Conv2d", "Conv2d", "Conv2d"]
    assert [c.module for c in report.calls] == ["0", "2", "3", "4", "5.dw", "5.pw1", "5.pw2"]
    specs = [cg.ConvSpec.from_shapes(*shapes) for shapes in (
        ((3, 3, 13, 13), (4, 3, 3, 3), 2), ((3, 4, 6, 6), (4, 4, 3, 3), 1, 1), ((3, 4, 6, 6), (4, 4, 3, 3), 1, 1),
        ((3, 4, 8, 8), (4, 1, 3, 3), 2, 0, 1, False, 0, 4), ((3, 4, 3, 3), (4, 1, 3, 3), 1, 1, 1, False, 0, 4),
        ((3, 4, 3, 3), (8, 4, 1, 1)), ((3, 8, 3, 3), (4, 8, 1, 1)))]
    # the first conv's input needs no gradient, the blur pool's kernel is a buffer
    needs = ["grad_weight", "both", "both", "grad_input", "both", "both", "both"]
    for row, spec, wanted in zip(report.calls, specs, needs, strict=True):
        assert row.layer == spec.describe()
        choices = [auto.chosen(spec, wanted, like) for like in (torch.empty(spec.output_shape, dtype=DT),
                   torch.empty(spec.output_shape, dtype=DT).to(memory_format=torch.channels_last))]
        choice = next(c for c in choices if c is not None)
        assert row.gradients == (" / ".join(choice.parts) if choice.backend == "split" else choice.backend)
        assert row.why.startswith(wanted) and set(choice.pending) <= set(row.pending)
    assert report.settled == (not any(row.pending for row in report.calls))
    assert "7 of 7 conv calls reached by convgrad" in str(report)


def test_a_patched_conv_in_a_routed_forward_keeps_its_memo(monkeypatch: pytest.MonkeyPatch) -> None:
    """Inside a parent's routed forward the module's memo of its last native call serves again (it validated every
    call before, routing being a function mode); under PerSampleGrads it does not (the capture must see it)."""
    import convgrad.nn.modules as modules

    calls: list[str] = []
    apply = modules.apply
    monkeypatch.setattr(modules, "apply", lambda *a, **k: calls.append(a[0]) or apply(*a, **k))

    class Own(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(2, 2, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x)

    model = cg.patch(Own(), backend="native")
    x = torch.randn(1, 2, 5, 5)
    for _ in range(3):
        model(x)
    assert calls == ["Conv2d"]  # validated once
    with cg.PerSampleGrads(model):
        model(x).sum().backward()
    assert calls == ["Conv2d", "Conv2d"]  # the capture saw the call


def test_a_routed_forward_keeps_the_original_signature() -> None:
    """torch.export binds dynamic_shapes to forward's parameters: a routed forward of (*args, **kwargs) failed it
    ("inputs[0] is a tuple, but dynamic_shapes[0] is a dict", tests/test_export.py's own-forward cases)."""
    import inspect

    model = cg.patch(nn.Sequential(SameConv(2, 3, 3), BlurPool(3)), backend="fwdconv")
    for patched, original in ((model[0], SameConv), (model[1], BlurPool)):
        assert inspect.signature(patched.forward) == inspect.signature(original.forward.__get__(patched))
        assert type(patched).forward.__doc__ == original.forward.__doc__
