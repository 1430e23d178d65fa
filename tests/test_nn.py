"""convgrad.nn modules and patch()/unpatch(), against torch.nn modules and torch autograd in float64."""

from __future__ import annotations

import copy
import pickle
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrizations, parametrize

import convgrad as cg
from helpers import TOL, assert_matches_autograd, graph_node_names

# torch's reference convs warn about their own copy for an even kernel with 'same'
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")

DT = torch.float64
BACKENDS = cg.backends()
TORCH_CONV = {(n, t): getattr(nn, f"ConvTranspose{n}d" if t else f"Conv{n}d") for n in (1, 2, 3) for t in (0, 1)}
CG_CONV = {(n, t): getattr(cg.nn, f"ConvTranspose{n}d" if t else f"Conv{n}d") for n in (1, 2, 3) for t in (0, 1)}

# (transposed, constructor kwargs after in/out/kernel); every padding_mode, groups, dilation, stride
CONFIGS: list[tuple[bool, dict[str, Any]]] = [
    (False, dict(stride=2, padding=1, groups=2)),
    (False, dict(stride=2, padding=2, dilation=2, padding_mode="reflect")),
    (False, dict(padding=(1,), padding_mode="replicate", groups=2)),
    (False, dict(stride=2, padding=2, padding_mode="circular")),
    (False, dict(padding="same", padding_mode="reflect", bias=False)),  # stride 1: torch accepts it too
    (False, dict(padding="same", dilation=2, padding_mode="circular")),
    (False, dict(padding="valid", stride=3, padding_mode="replicate")),
    (True, dict(stride=2, padding=1, output_padding=1, groups=2)),
    (True, dict(stride=2, dilation=3, output_padding=2, bias=False)),
]



def _pair(n: int, transposed: bool, kw: dict[str, Any], backend: str = "auto", k: int = 4) -> tuple[nn.Module, Any]:
    """A torch module and its convgrad twin with the torch module's weights."""
    kw = {key: (v * n if isinstance(v, tuple) else v) for key, v in kw.items()}
    ref = TORCH_CONV[n, transposed](4, 6, k, dtype=DT, **kw)
    ours = CG_CONV[n, transposed](4, 6, k, dtype=DT, backend=backend, **kw)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def _grads(module: nn.Module, x: torch.Tensor, grad_output_seed: int = 1, **call: Any) -> dict[str, torch.Tensor]:
    """Output and grad_input / grad_weight / grad_bias of one module on x, with a seeded grad_output."""
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    y = module(x, **call)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(grad_output_seed), dtype=y.dtype)
    y.backward(g)
    out = {"output": y.detach(), "grad_input": x.grad}
    for name, p in module.named_parameters():
        out[f"grad_{name}"] = p.grad
    return out


@pytest.mark.parametrize(("n", "backend"), [(1, "fwdconv"), (3, "fwdconv")] + [(2, b) for b in BACKENDS])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c[1].items()))
def test_module_matches_torch_module(cfg: tuple[bool, dict[str, Any]], n: int, backend: str) -> None:
    transposed, kw = cfg
    ref, ours = _pair(n, transposed, kw, backend)
    x = torch.randn(2, 4, *[7 if n < 3 else 5] * n, dtype=DT)
    expected, got = _grads(ref, x), _grads(ours, x)
    assert got.keys() == expected.keys()
    assert_matches_autograd(got, expected, DT, f"{backend} {type(ours).__name__} {kw}")


@pytest.mark.parametrize("transposed", [False, True])
def test_unbatched_input(transposed: bool) -> None:
    kw = dict(stride=2, output_padding=1) if transposed else dict(stride=2, padding=1, padding_mode="reflect")
    ref, ours = _pair(2, transposed, kw, "fwdconv", k=3)
    x = torch.randn(4, 6, 5, dtype=DT)
    assert_matches_autograd(_grads(ours, x), _grads(ref, x), DT, "unbatched")


# 'same' with stride 2, pads derived by hand from TF's rule out = ceil(i/s), total = (out-1)s + d(k-1) + 1 - i:
#   i=8, k=3, s=2: out=4, total=1 -> (0, 1);   i=7, k=4, s=2: out=4, total=3 -> (1, 2)
@pytest.mark.parametrize("mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize(("size", "k", "pads"), [(8, 3, (0, 1)), (7, 4, (1, 2))])
def test_same_stride2_matches_explicit_padding(size: int, k: int, pads: tuple[int, int], mode: str) -> None:
    ours = cg.nn.Conv2d(3, 5, k, stride=2, padding="same", padding_mode=mode, dtype=DT, backend="fwdconv")
    ref = nn.Conv2d(3, 5, k, stride=2, padding=0, dtype=DT)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 3, size, size, dtype=DT)
    padded = F.pad(x, [*pads, *pads], mode="constant" if mode == "zeros" else mode)  # (N, C, i + 1, i + 1)
    got = _grads(ours, x)
    assert got["output"].shape[-2:] == (4, 4)
    xp = padded.detach().requires_grad_()
    y = ref(xp)
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=DT))
    expected = {"output": y.detach(), "grad_weight": ref.weight.grad, "grad_bias": ref.bias.grad}
    got.pop("grad_input")  # differs by the pad's own backward; checked in test_module_matches_torch_module
    assert_matches_autograd(got, expected, DT, f"same stride 2 {mode}")


def test_same_stride2_input_grad_through_pad() -> None:
    ours = cg.nn.Conv1d(2, 3, 4, stride=2, padding="same", padding_mode="replicate", dtype=DT, backend="fwdconv")
    ref = nn.Conv1d(2, 3, 4, stride=2, dtype=DT)
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(2, 2, 7, dtype=DT, requires_grad=True)
    expected = torch.autograd.grad(ref(F.pad(x, [1, 2], mode="replicate")).square().sum(), x)[0]
    got = torch.autograd.grad(ours(x).square().sum(), x)[0]
    torch.testing.assert_close(got, expected, **TOL[DT])


@pytest.mark.parametrize("n", [1, 2, 3])
def test_conv_transpose_output_size(n: int) -> None:
    ref, ours = _pair(n, True, dict(stride=3, padding=1), "fwdconv", k=3)
    x = torch.randn(2, 4, *[3] * n, dtype=DT)
    for size in (7, 8, 9):  # (3-1)*3 - 2 + 2 + 1 = 7 up to 7 + stride - 1 = 9
        call = dict(output_size=[size] * n)
        got = _grads(ours, x, **call)
        assert got["output"].shape == (2, 6, *[size] * n)
        assert_matches_autograd(got, _grads(ref, x, **call), DT, f"output_size={size}")
    with pytest.raises(ValueError, match="requested an output size"):
        ours(x, output_size=[10] * n)


@pytest.mark.parametrize("key", list(TORCH_CONV), ids=str)
def test_state_dict_interchangeable_and_same_init(key: tuple[int, int]) -> None:
    torch.manual_seed(7)
    ref = TORCH_CONV[key](4, 6, 3, groups=2)
    torch.manual_seed(7)
    ours = CG_CONV[key](4, 6, 3, groups=2, backend="fwdconv")
    assert isinstance(ours, TORCH_CONV[key])
    for a, b in zip(ref.state_dict().values(), ours.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    other = TORCH_CONV[key](4, 6, 3, groups=2)
    assert str(other.load_state_dict(ours.state_dict())) == "<All keys matched successfully>"
    assert str(ours.load_state_dict(TORCH_CONV[key](4, 6, 3, groups=2).state_dict())) == (
        "<All keys matched successfully>")
    assert list(ours.state_dict()) == list(ref.state_dict())


def test_extra_repr_shows_backend_only_when_not_auto() -> None:
    assert "backend" not in repr(cg.nn.Conv2d(1, 2, 3))
    assert repr(cg.nn.Conv2d(1, 2, 3, stride=2, padding="same", backend="fwdconv")) == (
        "Conv2d(1, 2, kernel_size=(3, 3), stride=(2, 2), padding=same, backend='fwdconv')")


def test_constructor_and_forward_errors() -> None:
    with pytest.raises(ValueError, match=r"Conv2d: backend='nope' is not registered"):
        cg.nn.Conv2d(1, 2, 3, backend="nope")
    with pytest.raises(ValueError, match=r"ConvTranspose1d: padding='same' is not defined"):
        cg.nn.ConvTranspose1d(1, 2, 3, padding="same")
    with pytest.raises(ValueError, match="padding='same' is not supported for strided"):
        nn.Conv2d(1, 2, 3, stride=2, padding="same")  # torch refuses what cg.nn accepts
    with pytest.raises(TypeError, match=r"Conv1d.forward: output_size is only for transposed"):
        cg.nn.Conv1d(1, 2, 3)(torch.randn(1, 1, 5), output_size=[3])
    m = cg.nn.ConvTranspose1d(1, 2, 3)
    m.padding_mode = "reflect"
    with pytest.raises(ValueError, match=r"ConvTranspose1d: padding_mode='reflect'; a transposed"):
        m(torch.randn(1, 1, 5))


def _module_kinds(key: tuple[int, int]) -> dict[str, nn.Module]:
    """One module of the kind ``key`` (dims, transposed) built each way a user gets one."""
    torch_cls, ours_cls = TORCH_CONV[key], CG_CONV[key]
    user_cls = type(f"My{torch_cls.__name__}", (torch_cls,), {})
    return {"cg.nn": ours_cls(2, 3, 3), "patched": cg.patch(torch_cls(2, 3, 3)),
            "patched subclass": cg.patch(user_cls(2, 3, 3)),
            "patched weight_norm": cg.patch(parametrizations.weight_norm(torch_cls(2, 3, 3)))}


@pytest.mark.parametrize("key", list(TORCH_CONV), ids=str)
def test_forward_errors_are_named_after_the_module(key: tuple[int, int]) -> None:
    """``Conv2d: ...``, not the ``conv: ...`` of the function the module calls; a patched torch module is named
    after its own class, never after the generated ``Patched...`` one."""
    n = key[0]
    for how, module in _module_kinds(key).items():
        name = type(module).__name__ if how == "cg.nn" else TORCH_CONV[key].__name__
        if how == "patched subclass":
            name = f"My{name}"
        with pytest.raises(ValueError, match=rf"^{name}: weight.shape=.* but input has 5 channels$"):
            module(torch.randn(1, 5, *(7,) * n))  # the wrong number of channels
        with pytest.raises(TypeError, match=rf"^{name}: weight.dtype=torch.float32 does not match "
                                            rf"input.dtype=torch.float64$"):
            module(torch.randn(1, 2, *(7,) * n, dtype=DT))
        with pytest.raises(ValueError, match=rf"^{name}: input.shape=\(1, 2, .*\) must have {n + 2} dims"):
            module(torch.randn(1, 2, *(4,) * (n + 1)))  # one dim too many


def test_module_errors_at_backward_time_are_named_after_the_module() -> None:
    m = cg.patch(nn.Conv2d(2, 3, 3), backend="numpy")
    with pytest.raises(ValueError, match=r"^Conv2d: backend='numpy' does not support torch.func transforms"):
        torch.func.grad(lambda x: m(x).sum())(torch.randn(1, 2, 5, 5))
    m.padding_mode = "reflect"  # the explicit-padding path names the module too
    with pytest.raises(ValueError, match=r"^Conv2d: weight.shape=.* but input has 4 channels$"):
        m(torch.randn(1, 4, 5, 5))


# ---- patch / unpatch ------------------------------------------------------------------------------------------

class _DoubledConv(nn.Conv1d):
    """A user subclass with its own forward, which patch must keep."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return 2 * super().forward(input)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, groups=2, dilation=2, padding=2, padding_mode="reflect"),
        nn.Tanh(),
        nn.ConvTranspose2d(4, 3, 3, stride=2, output_padding=1),
        nn.Flatten(2),
        _DoubledConv(3, 2, 4, padding="same"),
    ).to(DT)


def _param_grads(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(x).square().sum().backward()
    return {f"grad_{name}": p.grad for name, p in model.named_parameters()}


X = torch.randn(2, 2, 9, 9, dtype=DT, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("backend", BACKENDS)
def test_patched_model_gradients_equal_unpatched(backend: str) -> None:
    model = _model()
    expected = _param_grads(copy.deepcopy(model), X)
    cg.patch(model, backend=backend)
    assert all(m.backend == backend for m in model if isinstance(m, nn.modules.conv._ConvNd))
    got = _param_grads(model, X)
    assert_matches_autograd(got, expected, DT, f"patched {backend}")
    assert "ConvFunctionBackward" in graph_node_names(model(X))


def test_patch_keeps_modules_parameters_hooks_and_optimizer() -> None:
    model, twin = _model(), _model()
    modules, params = list(model.modules()), list(model.parameters())
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    calls: list[str] = []
    model[0].register_forward_hook(lambda *_: calls.append("forward"))
    model[0].weight.register_hook(lambda g: calls.append("weight") or g)
    assert cg.patch(model, backend="fwdconv") is model
    assert all(a is b for a, b in zip(model.modules(), modules, strict=True))
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert isinstance(model[0], nn.Conv2d) and type(model[0]) is not nn.Conv2d
    assert isinstance(model[6], _DoubledConv)  # the user's forward (the factor 2) still runs first
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        m(X).square().sum().backward()
        o.step()
    assert calls == ["forward", "weight"]
    assert_matches_autograd(dict(model.named_parameters()), dict(twin.named_parameters()), DT, "after one step")
    assert "ConvFunctionBackward" in graph_node_names(model(X))


def test_unpatch_restores_classes() -> None:
    model = _model()
    classes = [type(m) for m in model.modules()]
    cg.unpatch(cg.patch(cg.patch(model, backend="fwdconv"), backend="native"))
    assert [type(m) for m in model.modules()] == classes
    assert not any("backend" in vars(m) for m in model.modules())
    assert "ConvFunctionBackward" not in graph_node_names(model(X))


def test_patch_sets_backend_of_convgrad_modules_and_unpatch_leaves_them() -> None:
    m = cg.nn.Conv2d(1, 1, 3)
    assert type(cg.patch(m, backend="gemm")) is cg.nn.Conv2d and m.backend == "gemm"
    assert type(cg.unpatch(m)) is cg.nn.Conv2d


def test_patch_errors() -> None:
    with pytest.raises(ValueError, match=r"patch: backend='nope' is not registered"):
        cg.patch(_model(), backend="nope")
    with pytest.raises(ValueError, match=r"patch: module '0' is an uninitialised lazy module"):
        cg.patch(nn.Sequential(nn.LazyConv2d(3, 3)))


@pytest.mark.parametrize("norm", [parametrizations.weight_norm, parametrizations.spectral_norm])
@pytest.mark.parametrize("patch_first", [False, True])
def test_patch_with_parametrizations(norm: Any, patch_first: bool) -> None:
    model = _model()
    for m in (model[0], model[4]):
        if patch_first:
            cg.patch(m, backend="fwdconv")
        norm(m)
        if not patch_first:
            cg.patch(m, backend="fwdconv")
    twin = cg.unpatch(copy.deepcopy(model))
    assert type(twin[0]).__name__ == "ParametrizedConv2d" and type(twin[0]).__bases__[0] is nn.Conv2d
    expected = _param_grads(twin, X)
    got = _param_grads(model, X)
    assert_matches_autograd(got, expected, DT, f"{norm.__name__} patch_first={patch_first}")
    assert "ConvFunctionBackward" in graph_node_names(model(X))
    parametrize.remove_parametrizations(model[0], "weight")  # restores the class below it: still patched
    assert isinstance(model[0], cg.nn.Conv2d) and not parametrize.is_parametrized(model[0])
    assert type(cg.unpatch(model)[0]) is nn.Conv2d


def test_patch_with_old_style_weight_norm_hooks() -> None:
    model, twin = _model(), _model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
        for m in (model, twin):
            nn.utils.weight_norm(m[0])
    cg.patch(model, backend="fwdconv")
    assert_matches_autograd(_param_grads(model, X), _param_grads(twin, X), DT, "old weight_norm")


def test_patched_model_pickles_and_deepcopies() -> None:
    model = cg.patch(_model(), backend="fwdconv")
    for clone in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert [type(m) for m in clone.modules()] == [type(m) for m in model.modules()]
        assert clone[0].backend == "fwdconv"
        torch.testing.assert_close(clone(X), model(X), rtol=0, atol=0)
        assert type(cg.unpatch(clone)[0]) is nn.Conv2d
