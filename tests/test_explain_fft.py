"""explain --method fft: the fft backend's plans as text, a runnable script and a picture; frames refused."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad import cli
from convgrad.errors import ConvgradValueError, MethodRefused
from convgrad.explain import fft_view

# (input, weight, hyperparameters): 1d, 2d strided, grouped (1 < g < C_in, uneven pads, dilation), transposed
# with output_padding, batch 0
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "1d": ((2, 3, 23), (4, 3, 9), dict(padding=4)),
    "2d_strided": ((2, 2, 11, 9), (3, 2, 4, 3), dict(stride=(2, 3), padding=1)),
    "grouped": ((1, 6, 10, 9), (6, 2, 3, 5), dict(groups=3, padding=((2, 0), (1, 3)), dilation=(2, 1))),
    "transposed": ((2, 4, 5, 6), (4, 3, 3, 4), dict(transposed=True, stride=2, padding=1, output_padding=1,
                                                    groups=2)),
}


def _recipe(case: str, **methods: str) -> cg.Recipe:
    x, w, kw = CASES[case]
    return cg.explain(x, w, **kw, **methods)


def test_method_fft_plans_both_gradients_and_weight_method_only_grad_weight() -> None:
    both = _recipe("2d_strided", method="fft")
    assert fft_view.is_fft(both.input_plan) and fft_view.is_fft(both.weight_plan)
    weight = _recipe("2d_strided", weight_method="fft")
    assert not fft_view.is_fft(weight.input_plan) and fft_view.is_fft(weight.weight_plan)
    tr = _recipe("transposed", input_method="fft")
    assert fft_view.is_fft(tr.input_plan) and fft_view.is_fft(tr.forward_plan)
    assert (tr.input_plan.gradient, tr.forward_plan.gradient) == ("grad_input", "output")
    with pytest.raises(ConvgradValueError, match="method='fft' and input_method='polyphase' disagree"):
        _recipe("2d_strided", method="fft", input_method="polyphase")
    with pytest.raises(ConvgradValueError, match="'fft'"):  # the list of methods names fft
        _recipe("1d", weight_method="fast")


@pytest.mark.parametrize("case", sorted(CASES))
def test_fft_text_names_each_step_of_both_plans(case: str) -> None:
    recipe = _recipe(case, method="fft")
    text = str(recipe)
    for plan in recipe.plans.values():
        assert f"transform length L = {plan.sizes}" in text
        for n, step in enumerate(plan.steps, 1):  # numbered, indented by the loops it runs in
            assert f"{n:>2}. {'  ' * step.depth}{step.describe()}" in text, step.name
        for loop in plan.loops:
            assert f"for each chunk {loop.var} of the {loop.whole[1]} {loop.name}" in text, loop
    assert [s.description for s in recipe.steps("grad_weight")] == [s.describe() for s in recipe.weight_plan.steps]
    names = {s.name for p in recipe.plans.values() for s in p.steps}
    assert {"transform", "product", "inverse"} <= names


def _run_script(recipe: cg.Recipe) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "recipe"}
    exec(compile(recipe.to_python(), "recipe.py", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("methods", [dict(method="fft"), dict(weight_method="fft"), dict(input_method="fft")])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fft_script_equals_conv_backward_in_float64(case: str, methods: dict[str, str]) -> None:
    x_size, w_size, kw = CASES[case]
    recipe = _recipe(case, **methods)
    torch.manual_seed(0)
    x = torch.randn(x_size, dtype=torch.float64)
    w = torch.randn(w_size, dtype=torch.float64)
    gy = torch.randn(recipe.spec.output_shape, dtype=torch.float64)
    ours = _run_script(recipe)["recipe_grads"](x, w, gy)
    ref = cg.conv_backward(gy, x, w, [w_size[1] * kw.get("groups", 1) if kw.get("transposed") else w_size[0]],
                           **kw, backend="native")
    for name, expected in zip(("grad_input", "grad_weight", "grad_bias"), ref, strict=True):
        assert torch.allclose(ours[name], expected, rtol=0, atol=1e-10), (case, name)


def test_fft_script_of_batch_zero_gives_zeros() -> None:
    recipe = cg.explain((0, 2, 7), (2, 2, 3), method="fft")
    out = _run_script(recipe)["recipe_grads"](torch.randn(0, 2, 7, dtype=torch.float64),
                                              torch.randn(2, 2, 3, dtype=torch.float64),
                                              torch.randn(0, 2, 5, dtype=torch.float64))
    assert out["grad_input"].shape == (0, 2, 7) and not out["grad_weight"].any()


def test_fft_script_runs_as_written_and_checks_itself(capsys: pytest.CaptureFixture[str]) -> None:
    source = _recipe("transposed", method="fft").to_python()
    exec(compile(source, "recipe.py", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.startswith("recipe matches torch autograd")


@pytest.mark.slow  # a fresh interpreter; the script's run as written is checked in-process above
def test_fft_script_runs_standalone_and_checks_itself(tmp_path: Path) -> None:
    path = tmp_path / "recipe.py"
    path.write_text(_recipe("transposed", method="fft").to_python())
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True)
    assert "recipe matches torch autograd" in done.stdout


@pytest.mark.parametrize("case", sorted(CASES))
def test_fft_picture_rows_come_from_the_plan(case: str) -> None:
    """Per dim of the first phase: the data rows, the kernel's slots and the rows the crop keeps."""
    recipe = _recipe(case, method="fft")
    spec = recipe.spec
    for plan in recipe.plans.values():
        for j, d in enumerate(plan.dims):
            data, kernel, result = fft_view._dim_rows(plan, j)
            assert len(data) == len(kernel) == len(result) == d.size
            kept = result.count(fft_view.KEPT)
            s, phi = spec.stride[j], d.phases[0]
            x_rows = len([r for r in range(spec.x_size[j] + sum(d.transform_pads)) if r % s == phi
                          and d.transform_pads[0] <= r < d.transform_pads[0] + spec.x_size[j]])
            expected = {"y_from_x": spec.y_size[j], "x_from_y": x_rows, "w_from_xy": d.taps}[plan.kind]
            assert kept == expected, (plan.kind, j)
            held = kernel if plan.kind != "w_from_xy" else data
            assert 0 < held.count(fft_view.DATA) <= d.size


@pytest.mark.parametrize("case", ["1d", "transposed"])
def test_fft_picture_is_drawn(case: str, tmp_path: Path) -> None:
    from PIL import Image

    path = tmp_path / "fft.png"
    fig = _recipe(case, method="fft").plot(path)
    with Image.open(path) as image:
        pixels = image.convert("RGB")
        colours = {c for _, c in pixels.getcolors(1 << 20) or []}
        assert image.size[0] == 800
    assert (0x54, 0xA2, 0x4B) in colours  # the crop's kept colour (also the legend's)
    assert len(fig.axes) == 6  # data, kernel, result for each gradient
    recipe = _recipe(case, method="fft")
    big = "grad_output" if recipe.spec.transposed else "input"  # the backend's x named as the recipe's tensor
    assert fig.axes[3].get_title().startswith(f"x = {big} ")
    for row, plan in enumerate(recipe.plans.values()):  # the result panel draws the kept cells of the plan's rows
        kept = math.prod(fft_view._dim_rows(plan, j)[2].count(fft_view.KEPT)
                         for j in range(recipe.spec.n)[-2:])
        drawn = fig.axes[3 * row + 2].images[0].get_array()
        assert int((drawn == fft_view.KEPT).sum()) == kept > 0


def test_fft_picture_of_one_gradient_says_the_other_is_not_fft() -> None:
    fig = _recipe("2d_strided", weight_method="fft").plot()
    assert len(fig.axes) == 3 and "grad_input not fft" in fig.texts[0].get_text() + fig._suptitle.get_text()


def test_fft_picture_of_a_3d_layer_says_which_dims_it_draws() -> None:
    """Before (review6): a 3d layer's panels drew its last two dims under "L = (8, 6, 6)" with no word of which two,
    so a (4, 4, 3) grad_output looked like a (4, 3) one; a 2d layer's label names no dims."""
    fig = cg.explain((1, 4, 10, 9, 8), (4, 1, 7, 7, 7), stride=2, padding=((3, 1), (2, 2), (0, 3)), groups=4,
                     method="fft").plot()
    labels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert len(labels) == 2 and all("the last two spatial dims" in label for label in labels), labels
    flat = _recipe("2d_strided", method="fft").plot()
    assert not any("spatial dims" in ax.get_ylabel() for ax in flat.axes)


@pytest.mark.parametrize("how", ["animate", "to_html", "scene"])
def test_fft_frames_are_refused_with_a_typed_error(how: str, tmp_path: Path) -> None:
    recipe = _recipe("1d", weight_method="fft")
    calls = {"animate": lambda: recipe.animate(tmp_path / "a.gif"),
             "to_html": lambda: recipe.to_html(tmp_path / "a.html"), "scene": lambda: recipe.scene("grad_weight")}
    with pytest.raises(MethodRefused) as err:
        calls[how]()
    fn = {"animate": "Recipe.animate", "to_html": "Recipe.to_html", "scene": "Recipe.scene"}[how]
    assert (err.value.fn, err.value.method) == (fn, "fft") and "no frames for grad_weight" in str(err.value)
    recipe.animate(tmp_path / "input.gif", gradients=("grad_input",), max_frames=2)  # the fwdconv side still animates
    assert not (tmp_path / "a.gif").exists()


def test_cli_explain_method_fft_prints_the_steps_and_refuses_animate(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # in-process (issue 26: the CLI's own tests call main(argv); test_cli.py keeps the two subprocess smoke tests)
    argv = ["explain", "--input", "1,2,9", "--weight", "2,2,4", "--stride", "2"]
    assert cli.main([*argv, "--method", "fft", "--plot", str(tmp_path / "f.png"), "--text"]) == 0
    assert "by the convolution theorem" in capsys.readouterr().out and (tmp_path / "f.png").stat().st_size > 0
    assert cli.main([*argv, "--weight-method", "fft", "--animate", str(tmp_path / "f.gif")]) == 2
    out, err = capsys.readouterr()
    assert "explain --animate: method='fft' has no frames for grad_weight" in err
    assert out == "" and not (tmp_path / "f.gif").exists()  # refused before the text is printed


def test_fft_text_says_when_both_gradients_run_as_one_pass() -> None:
    """The header says the two plans run as one pass exactly where the backend's backward fuses them
    (``shares_spectra``): both gradients by fft on a layer whose kernel rows are one chunk; not with one gradient
    by fft, nor on a dense layer sliced by kernel rows."""
    line = "runs their two plans below as one pass"
    assert line in str(_recipe("grouped", method="fft"))
    assert line not in str(_recipe("grouped", weight_method="fft"))
    from convgrad.backends.fft import plan, shares_spectra
    from convgrad.spec import ConvSpec
    dense = ConvSpec.from_shapes((2, 768, 500), (768, 48, 128), padding=64, groups=16)  # wav2vec 2.0: row slices
    assert not shares_spectra(plan(dense, "grad_input"), plan(dense, "grad_weight"))
    assert line not in str(cg.explain((2, 768, 500), (768, 48, 128), padding=64, groups=16, method="fft"))
