"""convgrad.explain, convgrad.native_backend and `convgrad explain`.

The recipe must be the backend's own plans, its script must reproduce torch autograd with forward
ops only, and the native kernel table must agree with what torch.profiler and oneDNN's verbose
log record while the backward really runs.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import convgrad
from convgrad import cli
from convgrad.backends import fwdconv
from convgrad.cli import parse_padding
from convgrad.explain.kernel_choice import known_profiler_ops
from helpers import Case, grid_cases

GRID = grid_cases()
# Every hard case once per kind, in 1d, 2d and 3d, forward and transposed.
SCRIPT_CASES = [c for c in GRID if c.name.split("-", 1)[1] in {
    "stride2-leftover", "asym-padding", "dilation3-stride2-pad", "groups2-cin4", "same-stride2", "batch0",
    "unbatched", "stride3-op2-groups2", "dilation3-op2-ge-stride", "T-asym-padding", "mixed-per-dim",
    "T-depthwise", "depthwise-multiplier"}] + [
    Case((0, 4, 8, 8), (4, 1, 3, 3), stride=2, padding=1, groups=4, name="batch0-depthwise-s2"),  # phases as matmuls
    Case((0, 4, 8, 8), (4, 4, 3, 3), stride=2, padding=1, name="batch0-s2")]


def _recipe(case: Case) -> convgrad.Recipe:
    return convgrad.explain(case.input_shape, case.weight_shape, case.stride, case.padding, case.dilation,
                            case.transposed, case.output_padding, case.groups)


# ---- the recipe is the backend's plan -----------------------------------------------------------------------

@pytest.mark.parametrize("case", GRID, ids=str)
def test_recipe_wraps_the_plans_the_backend_executes(case: Case) -> None:
    recipe, spec = _recipe(case), case.spec()
    assert recipe.spec == spec
    assert recipe.input_plan is fwdconv.plan_input_grad(spec)
    assert recipe.weight_plan is fwdconv.plan_weight_grad(spec)
    for name, plan in recipe.plans.items():
        steps = recipe.steps(name)
        values = [getattr(plan, f.name) for f in dataclasses.fields(plan)]
        plan_objects = [s for v in values for s in (v if isinstance(v, tuple) else (v,))
                        if hasattr(s, "describe") and hasattr(s, "shape")]
        assert [st.step for st in steps] == plan_objects
        if getattr(plan, "conv", None) is not None:
            assert steps[-1].shape == tuple(plan.shape)


@pytest.mark.parametrize("case", SCRIPT_CASES[:6], ids=str)
def test_text_lists_every_step_with_its_shape(case: Case) -> None:
    recipe = _recipe(case)
    text = str(recipe)
    assert case.spec().describe() in text
    for name in ("grad_input", "grad_weight"):
        for st in recipe.steps(name):
            assert f"{st.description}  -> {st.shape}" in text
    assert "grad_bias" in text
    assert sum(line.startswith("   spatial dim ") for line in text.splitlines()) == case.spec().n


# ---- the leftover r ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("input_size", "weight_size", "kw"), [
    ((1, 1, 8, 9), (1, 1, 3, 2), dict(stride=(2, 3))),
    ((1, 1, 10), (1, 1, 3), dict(stride=3, padding=((0, 1),))),
    ((1, 1, 9, 8), (1, 1, 3, 2), dict(stride=(3, 2), padding=((1, 0), (0, 1)))),
], ids=["stride", "padded", "both-sides"])
def test_leftover_counts_the_input_rows_autograd_leaves_at_zero(input_size: Any, weight_size: Any, kw: Any) -> None:
    # With positive weights and grad_output, an input row gets zero gradient exactly when no window reads it;
    # with dilation 1 and stride <= kernel the windows tile the input, so only the trailing rows can be unread.
    recipe = convgrad.explain(input_size, weight_size, **kw)
    spec = recipe.spec
    x = torch.ones(input_size, dtype=torch.float64, requires_grad=True)
    xp = torch.nn.functional.pad(x, [v for lo, hi in reversed(spec.padding) for v in (lo, hi)])
    y = torch.ops.aten.convolution(xp, torch.ones(weight_size, dtype=torch.float64), None, spec.stride,
                                   [0] * spec.n, spec.dilation, False, [0] * spec.n, 1)
    (gx,) = torch.autograd.grad(y.sum(), x)
    for lo in recipe.leftover:
        per_row = gx.movedim(2 + lo.dim, 0).reshape(gx.shape[2 + lo.dim], -1).sum(1)  # (i,)
        zero_tail = int((per_row.flip(0).cumsum(0) == 0).sum())
        assert lo.unread_input_rows == zero_tail
        assert lo.r == spec.leftover[lo.dim]
        assert (f"remainder {lo.r}" in lo.reason) if lo.r else ("end exactly" in lo.reason)


# ---- the standalone script ---------------------------------------------------------------------------------

class OpLog(TorchDispatchMode):
    """Records every aten op with the phase it ran in; `phase` flips to 'check' when autograd_grads starts."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "recipe"
        self.ops: list[tuple[str, str, bool]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        transposed = func.overloadpacket is torch.ops.aten.convolution and bool(args[6])
        self.ops.append((self.phase, func.overloadpacket.__name__, transposed))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(("input_size", "weight_size", "kw"), [
    ((2, 4, 7, 8), (4, 2, 3, 2), dict(stride=(2, 3), padding=((1, 0), (0, 1)), groups=2)),
    ((1, 3, 5, 6, 6), (3, 1, 3, 3, 3), dict(stride=(1, 2, 2), padding=1, groups=3)),
    ((2, 2, 3, 2), (2, 1, 3, 4), dict(stride=(2, 3), transposed=True, output_padding=(1, 0))),
])
def test_script_of_the_phases_weight_plan_matches_autograd(input_size: tuple[int, ...], weight_size: tuple[int, ...],
                                                           kw: dict[str, Any], capsys: Any) -> None:
    """The phases plan's code (a pad and a reshape) is the same sum as its one-copy __call__."""
    source = convgrad.explain(input_size, weight_size, weight_method="phases", **kw).to_python()
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(source, "recipe.py", "exec"), namespace)
    namespace["main"]()  # asserts every gradient against autograd
    assert "recipe matches torch autograd" in capsys.readouterr().out


@pytest.mark.parametrize("weight_method", ["phases", "per_sample", "kernel", "taps", None])
@pytest.mark.parametrize(("input_size", "weight_size", "kw"), [
    ((1, 1, 2), (1, 1, 4), dict(stride=4, padding=((5, 0),))),  # reads only padding: the crop passes x's end
    ((1, 2, 1, 4, 4), (2, 1, 5, 3, 3), dict(stride=(5, 2, 2), padding=((6, 2), (1, 1), (1, 1)), groups=2)),
])
def test_script_crops_after_it_pads(input_size: tuple[int, ...], weight_size: tuple[int, ...], kw: dict[str, Any],
                                    weight_method: str | None, capsys: Any) -> None:
    """F.pad crops before it pads and failed ("narrow(): length must be non-negative") where only the pad on the
    other side makes room for the crop; the scripts now crop with a slice, as the plans do (found by a helper)."""
    source = convgrad.explain(input_size, weight_size, weight_method=weight_method, **kw).to_python()
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(source, "recipe.py", "exec"), namespace)
    namespace["main"]()  # asserts every gradient against autograd
    assert "recipe matches torch autograd" in capsys.readouterr().out


@pytest.mark.parametrize("case", SCRIPT_CASES, ids=str)
def test_script_matches_autograd_with_no_backward_op_before_the_check(case: Case, capsys: Any) -> None:
    source = convgrad.explain(case.input_shape, case.weight_shape, case.stride, case.padding, case.dilation,
                              case.transposed, case.output_padding, case.groups).to_python()
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(source, "recipe.py", "exec"), namespace)
    log, check = OpLog(), namespace["autograd_grads"]

    def autograd_grads(*args: Any) -> Any:
        log.phase = "check"
        return check(*args)

    namespace["autograd_grads"] = autograd_grads
    with log:
        namespace["main"]()  # asserts every gradient against autograd
    recipe_ops = [(name, tr) for phase, name, tr in log.ops if phase == "recipe"]
    # a forward conv runs, or a conv with a 1x1 (or whole-input) kernel computed as the matmul it is
    forward_ops = {("convolution", False), ("mm", False), ("bmm", False)}
    assert forward_ops & set(recipe_ops) or case.spec().batch == 0
    assert not any("backward" in name or tr for name, tr in recipe_ops), recipe_ops
    if case.spec().batch:
        assert any(name == "convolution_backward" for phase, name, _ in log.ops if phase == "check")
    assert "recipe matches torch autograd: grad_input, grad_weight, grad_bias" in capsys.readouterr().out


def test_script_runs_as_written(capsys: Any) -> None:
    source = convgrad.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).to_python()
    exec(compile(source, "recipe.py", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.startswith("recipe matches torch autograd")


@dataclasses.dataclass(frozen=True)
class MysteryStep:
    shape: tuple[int, ...]

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def describe(self) -> str:
        return "a step kind explain has never seen"


@dataclasses.dataclass(frozen=True)
class SelfCodingStep(MysteryStep):
    def code(self, var: str, shape: tuple[int, ...]) -> list[str]:
        return [f"{var} = {var} * 1  # {self.describe()}"]


def test_unknown_step_kinds_render_as_text_and_fail_loudly_as_code() -> None:
    recipe = convgrad.explain((1, 2, 6), (3, 2, 3), stride=2)
    post = recipe.input_plan.post_steps  # the phase interleave of this strided conv
    plan = dataclasses.replace(recipe.input_plan, post_steps=(*post, MysteryStep(recipe.input_plan.shape)))
    odd = convgrad.Recipe(recipe.spec, plan, recipe.weight_plan)
    assert "a step kind explain has never seen" in str(odd)
    assert odd.steps("grad_input")[-1].kind == "MysteryStep"
    with pytest.raises(NotImplementedError, match="MysteryStep"):
        odd.to_python()
    plan = dataclasses.replace(plan, post_steps=(*post, SelfCodingStep(plan.shape)))
    source = convgrad.Recipe(recipe.spec, plan, recipe.weight_plan).to_python()
    assert "grad_input = grad_input * 1  # a step kind" in source
    exec(compile(source, "recipe.py", "exec"), {"__name__": "__main__"})


def test_explain_stays_callable_after_its_module_is_imported_by_another_name() -> None:
    # Accessing convgrad.native_backend first imports convgrad.explain, binding the module to that name.
    convgrad.native_backend((1, 1, 5), (1, 1, 3))
    importlib.import_module("convgrad.explain")
    assert convgrad.explain((1, 1, 5), (1, 1, 3)).spec.output_size == (3,)


def test_steps_rejects_an_unknown_gradient() -> None:
    with pytest.raises(ValueError, match="gradient='grad_bias'"):
        convgrad.explain((1, 2, 6), (3, 2, 3)).steps("grad_bias")


# ---- the picture -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("input_size", "weight_size", "kw", "blocks"), [
    ((1, 1, 7), (1, 1, 3), dict(stride=2, dilation=2, padding=1), 3),  # polyphase: 2 phases, then grad_weight
    pytest.param((1, 1, 8, 8), (1, 1, 2, 2), dict(stride=3, padding=((0, 0), (2, 0))), 5, marks=pytest.mark.slow),
    pytest.param((1, 1, 5, 6, 4), (1, 1, 3, 2, 2), dict(stride=(2, 3, 1)), 5, marks=pytest.mark.slow),
    ((1, 1, 3, 3), (1, 1, 3, 3), dict(stride=2, padding=1, transposed=True, output_padding=1), 2),
], ids=["1d", "2d-crop", "3d", "2d-transposed"])
def test_plot_draws_a_block_per_key_frame(tmp_path: Any, input_size: Any, weight_size: Any, kw: Any,
                                         blocks: int) -> None:
    recipe = convgrad.explain(input_size, weight_size, **kw)
    fig = recipe.plot(tmp_path / "recipe.png")
    assert (tmp_path / "recipe.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(fig.axes) == blocks
    assert fig.get_size_inches()[0] * fig.dpi == 800


# ---- the native kernel -------------------------------------------------------------------------------------

NATIVE = [  # (input, weight, kwargs, dtype)
    ((4, 8, 12, 12), (8, 8, 3, 3), {}, torch.float32),
    ((4, 8, 12, 12), (8, 4, 3, 3), dict(groups=2, stride=2), torch.float32),
    ((4, 8, 12, 12), (8, 1, 3, 3), dict(groups=8, padding=1), torch.float32),
    ((4, 8, 6, 6), (8, 4, 3, 3), dict(transposed=True, stride=2, output_padding=1), torch.float32),
    ((4, 8, 20), (8, 8, 3), dict(padding=((1, 2),)), torch.float32),
    ((2, 4, 6, 6, 6), (4, 4, 3, 3, 3), {}, torch.float32),
    ((1, 2, 8, 8), (2, 2, 3, 3), {}, torch.float32),
    ((2, 4, 9, 9), (4, 4, 3, 3), {}, torch.float64),
    ((2, 4, 9, 9), (6, 2, 3, 3), dict(groups=2), torch.float64),
    ((2, 4, 9, 9), (4, 1, 3, 3), dict(groups=4, stride=2), torch.float64),
    ((2, 4, 9), (4, 4, 3), {}, torch.float64),
    ((2, 4, 9, 9), (4, 2, 3, 3), dict(groups=2, dilation=2), torch.float64),
    ((2, 4, 6, 6, 6), (4, 2, 3, 3, 3), dict(groups=2), torch.float64),
    ((2, 2, 7, 7, 7), (2, 2, 2, 2, 2), dict(dilation=2), torch.float64),
    ((2, 4, 5, 5), (4, 3, 3, 3), dict(transposed=True, groups=2, stride=2), torch.float64),
    ((2, 2, 3, 3, 3), (2, 2, 2, 2, 2), dict(transposed=True), torch.float64),
    ((0, 4, 9, 9), (4, 4, 3, 3), {}, torch.float32),
]


def _onednn_log(capfd: Any, fn: Any) -> str:
    """oneDNN's verbose lines while fn runs (they are printed by C code, so flushed through libc)."""
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        fn()
    ctypes.CDLL(None).fflush(None)
    return capfd.readouterr().out


def _backward_names(choice: convgrad.NativeChoice, case: tuple[Any, ...], capfd: Any) -> tuple[list[str], str]:
    shape, wshape, kw, dtype = case
    x, w = torch.randn(shape, dtype=dtype), torch.randn(wshape, dtype=dtype)
    spec = convgrad.ConvSpec.from_shapes(shape, wshape, **kw)
    gy = torch.randn(spec.output_shape, dtype=dtype)
    names: list[str] = []

    def run() -> None:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            convgrad.conv_backward(gy, x, w, None, **kw, output_mask=(True, True, False), backend="native")
        names.extend(e.name for e in prof.events())

    return names, _onednn_log(capfd, run)


@pytest.mark.parametrize("case", NATIVE, ids=lambda c: f"{c[3]}-{c[0]}-{c[2]}".replace(" ", "")
                         if isinstance(c, tuple) else str(c))
def test_native_choice_agrees_with_the_profiled_backward(case: tuple[Any, ...], capfd: Any) -> None:
    shape, wshape, kw, dtype = case
    choice = convgrad.native_backend(shape, wshape, **kw, dtype=dtype)
    names, onednn = _backward_names(choice, case, capfd)
    assert "aten::convolution_backward" in names
    for op in choice.profiler_ops:
        assert names.count(op) == (choice.groups if choice.loops_over_groups else 1), (op, names)
    assert not (known_profiler_ops() - set(choice.profiler_ops)) & set(names), choice
    if choice.groups > 1 and choice.backend != "Empty":
        assert ("aten::cat" in names) == choice.loops_over_groups, (choice, names)
    ran_onednn = any(k in line for line in onednn.splitlines() if ",exec," in line
                     for k in (",convolution,", ",deconvolution,"))
    assert ran_onednn == choice.onednn, (choice, onednn[-2000:])
    if choice.forward_op:
        spec = convgrad.ConvSpec.from_shapes(shape, wshape, **kw)
        x = torch.randn(spec.input_shape[:2] + tuple(i + lo + hi - 2 * min(lo, hi) for i, (lo, hi) in
                                                    zip(spec.input_size, spec.padding, strict=True)), dtype=dtype)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            torch.ops.aten.convolution(x.requires_grad_(), torch.randn(wshape, dtype=dtype), None, spec.stride,
                                       spec.symmetric_padding, spec.dilation, spec.transposed, spec.output_padding,
                                       spec.groups)
        assert choice.forward_op in [e.name for e in prof.events()], choice


def test_native_cases_cover_the_cpu_kernels() -> None:
    seen = {convgrad.native_backend(s, w, **kw, dtype=dt).backend for s, w, kw, dt in NATIVE}
    expected = {"Slow2d", "Slow3d", "SlowDilated2d", "SlowDilated3d", "SlowTranspose2d", "SlowTranspose3d", "Empty"}
    if torch.backends.mkldnn.is_available():
        expected |= {"Mkldnn", "MkldnnTranspose"}  # MkldnnTranspose prints as '???' in torch 2.13
    assert expected <= seen


def test_native_backend_takes_tensors_or_sizes() -> None:
    x, w = torch.randn(2, 4, 9, 9, dtype=torch.float64), torch.randn(4, 2, 3, 3, dtype=torch.float64)
    by_tensor = convgrad.native_backend(x, w, groups=2)
    assert by_tensor == convgrad.native_backend(x.shape, w.shape, groups=2, dtype=torch.float64, device="cpu")
    channels_last = x.to(memory_format=torch.channels_last)
    assert convgrad.native_backend(channels_last, w, groups=2).kernel == by_tensor.kernel
    assert by_tensor.kernel in str(by_tensor) and "2 kernel calls" in str(by_tensor)
    with pytest.raises(TypeError, match="native_backend: dtype and device"):
        convgrad.native_backend(x, w, groups=2, dtype=torch.float64)
    with pytest.raises(TypeError, match="both be tensors"):
        convgrad.native_backend(x, w.shape, groups=2)
    with pytest.raises(TypeError, match=r"dtype=torch\.int64"):
        convgrad.native_backend(x.shape, w.shape, groups=2, dtype=torch.int64)
    with pytest.raises(ValueError, match="native_backend: groups=3"):
        convgrad.native_backend(x.shape, (6, 2, 3, 3), groups=3)


# ---- the command -------------------------------------------------------------------------------------------

def test_cli_prints_recipe_and_native_choice(capsys: Any, tmp_path: Any) -> None:
    png = tmp_path / "r.png"
    assert cli.main(["explain", "--input", "1,1,5,5", "--weight", "1,1,3,3", "--stride", "2", "--padding", "0:1",
                     "--dtype", "float64", "--plot", str(png), "--text"]) == 0
    out = capsys.readouterr().out
    assert "conv2d input=(1, 1, 5, 5)" in out and "phase" in out and "_slow_conv2d_backward" in out
    assert png.exists()


def test_cli_code_prints_a_runnable_script(capsys: Any) -> None:
    assert cli.main(["explain", "--input", "2,4,3,3", "--weight", "4,3,3,3", "--groups", "2", "--stride", "2",
                     "--transposed", "--output-padding", "1", "--code"]) == 0
    exec(compile(capsys.readouterr().out, "recipe.py", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.startswith("recipe matches torch autograd")


@pytest.mark.parametrize(("argv", "message"), [
    (["--input", "2,4,9", "--weight", "4,3,3", "--groups", "2"], "error: weight.shape=(4, 3, 3) with groups=2"),
    (["--input", "2,4,9,9", "--weight", "4,4,3,3", "--transposed", "--padding", "same"], "not defined"),
    (["--input", "2,4,9", "--weight", "4,4,3", "--dtype", "int8"], "--dtype 'int8' must be a floating or complex"),
])
def test_cli_invalid_shapes_give_one_line_errors(argv: list[str], message: str, capsys: Any) -> None:
    assert cli.main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1


@pytest.mark.parametrize("extra", [[], ["--code"], ["--plot", "never.png"]])
@pytest.mark.parametrize("dtype", ["int8", "bool", "nonsense"])
def test_cli_bad_dtype_is_refused_before_any_output(dtype: str, extra: list[str], capsys: Any, tmp_path: Any,
                                                    monkeypatch: Any) -> None:
    """A bad --dtype used to print the whole recipe (or write nothing but still pass with --code) before failing."""
    monkeypatch.chdir(tmp_path)
    argv = ["explain", "--input", "1,1,5,5", "--weight", "1,1,3,3", "--stride", "2", "--dtype", dtype, *extra]
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "--dtype" in err and "Traceback" not in err
    assert not (tmp_path / "never.png").exists()


def test_cli_padding_forms() -> None:
    assert parse_padding("same") == "same" and parse_padding("valid") == "valid"
    assert parse_padding("3") == 3 and parse_padding("1,2") == (1, 2)
    assert parse_padding("1:2,0:1") == ((1, 2), (0, 1))
    assert cli.main(["explain", "--input", "1,1,6,6", "--weight", "1,1,3,3", "--padding", "1:2"]) == 0


@pytest.mark.parametrize(("args", "kw"), [(((0, 2, 7, 7), (3, 2, 3, 3)), {"stride": 2}),  # batch 0: zeros
                                          (((2, 2, 7, 7), (3, 2, 4, 4)), {"padding": "same"}),
                                          (((1, 2, 4, 4), (2, 3, 3, 3)), {"transposed": True, "stride": 2})])
def test_to_python_creates_every_tensor_on_the_inputs_device(args: tuple, kw: dict) -> None:
    """The meta device stands in for CUDA (no GPU needed): a tensor made on the CPU would show as 'cpu'."""
    recipe = convgrad.explain(*args, **kw)
    namespace: dict = {"__name__": "recipe"}
    exec(compile(recipe.to_python(), "recipe.py", "exec"), namespace)
    spec = recipe.spec
    operands = [torch.randn(s, dtype=torch.float64, device="meta")
                for s in (spec.input_shape, spec.weight_shape, spec.output_shape)]
    for fn in ("recipe_grads", "autograd_grads"):  # autograd_grads' bias too
        assert {k: v.device.type for k, v in namespace[fn](*operands).items()} == dict.fromkeys(
            ("grad_input", "grad_weight", "grad_bias"), "meta"), fn
    seen = []
    recipe_grads = namespace["recipe_grads"]
    namespace["recipe_grads"] = lambda *t: seen.extend(x.device.type for x in t) or recipe_grads(*t)
    namespace["DEVICE"] = "meta"  # main() makes its tensors on DEVICE (cuda when there is one)
    namespace["main"]()
    assert seen == ["meta"] * 3
