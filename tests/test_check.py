"""`convgrad check`: the library's own verification, as users run it."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import convgrad as cg
from convgrad import backends as registry
from convgrad.backends import Backend
from convgrad.cli import main
from convgrad.cli.check import GRADIENTS, check_config, check_model, check_random
from convgrad.spec import ConvSpec
from helpers import TOL, Case, make_tensors, reference_grads


class _Broken(Backend):
    """A backend with a classic bug: grad_input loses its first column (an off-by-one in p_lo)."""

    name = "broken"

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        gi = registry.get_backend("native").input_grad(spec, weight, grad_output).clone()
        gi[..., 0] = 0
        return gi

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return registry.get_backend("native").weight_grad(spec, input, grad_output)


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch) -> str:
    registry.backend_names()  # load the built-in backends first
    monkeypatch.setitem(registry._REGISTRY, "broken", _Broken())
    return "broken"


CONFIGS = [
    dict(input_size=(2, 4, 9, 9), weight_size=(6, 2, 3, 3), stride=2, groups=2),
    dict(input_size=(3, 7), weight_size=(4, 3, 2), stride=3, padding=((2, 1),), dilation=2),  # unbatched
    dict(input_size=(2, 4, 3, 3, 2), weight_size=(4, 3, 2, 2, 2), stride=2, output_padding=1, groups=2,
         transposed=True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=["grouped-strided", "unbatched-asym", "transposed-3d"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex64])
def test_check_config_passes_every_backend(config: dict, dtype: torch.dtype, device: torch.device) -> None:
    _, results = check_config(**config, dtype=dtype, device=device)
    assert {(r.backend, r.gradient) for r in results} == {(b, g) for b in cg.backends() for g in GRADIENTS}
    assert not [r for r in results if r.failed], results
    compared = [r for r in results if r.status == "pass"]
    assert len(compared) >= 3 * (2 if dtype.is_complex else len(cg.backends()) - 1)


def test_check_config_skips_what_a_backend_refuses_by_design(device: torch.device) -> None:
    _, results = check_config((1, 2, 6, 6), (2, 2, 3, 3), dtype=torch.bfloat16, device=device)
    statuses = {r.backend: r.status for r in results}
    assert statuses["native"] == statuses["fwdconv"] == "pass"
    if "numpy" in statuses:
        assert statuses["numpy"].startswith("skip:")


def test_reference_agrees_with_the_test_suite_reference() -> None:
    """check.py's reference and tests/helpers.py's are two codings of one thing: they must agree."""
    from convgrad.cli.check import reference_grads as check_reference

    case = Case((2, 3, 8, 7), (4, 3, 3, 2), stride=(2, 3), padding=((0, 2), (1, 0)), dilation=(1, 2))
    t = make_tensors(case, bias=True)
    ours = check_reference(case.spec(), t["input"], t["weight"], t["grad_output"])
    ref = reference_grads(case, t)
    for name in GRADIENTS:
        torch.testing.assert_close(ours[name], ref[name], **TOL[torch.float64])


def test_check_config_catches_a_wrong_gradient(broken: str) -> None:
    _, results = check_config((1, 2, 8, 8), (3, 2, 3, 3), stride=2, backends=[broken])
    status = {r.gradient: r for r in results}
    assert status["grad_input"].failed and status["grad_input"].max_abs > 0
    assert status["grad_weight"].status == status["grad_bias"].status == "pass"


def test_cli_config_prints_a_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--input", "2,4,9,9", "--weight", "6,2,3,3", "--stride", "2", "--groups", "2",
                 "--padding", "1:2,0:1", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert code == 0
    for word in ("backend", "max abs err", "max rel err", *cg.backends(), *GRADIENTS, "pass"):
        assert word in out
    assert "FAIL" not in out


def test_cli_exits_1_on_a_failure(broken: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--input", "1,2,8,8", "--weight", "3,2,3,3", "--stride", "2", "--backend", broken])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL" in out and "1 gradient(s) out of tolerance" in out


def test_cli_transposed(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["check", "--input", "1,4,5,5", "--weight", "4,3,3,3", "--transposed", "--stride", "2",
                 "--output-padding", "1", "--backend", "fwdconv", "--backend", "native"])
    assert code == 0 and "conv_transpose2d" in capsys.readouterr().out


def _write_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "tiny_check_net.py").write_text(textwrap.dedent("""
        import torch

        def build():
            return torch.nn.Sequential(
                torch.nn.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                torch.nn.Conv2d(8, 8, 3, groups=8, padding=1, bias=False), torch.nn.Dropout(0.3),
                torch.nn.ConvTranspose2d(8, 4, 2, stride=2))

        def not_a_model():
            return 3
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "tiny_check_net"


def test_check_model_twin_checks_every_conv_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  device: torch.device) -> None:
    module = _write_model(tmp_path, monkeypatch)
    rows = check_model(f"{module}:build", (4, 3, 16, 16), backend="fwdconv", dtype=torch.float32, device=device)
    assert [(layer, r.gradient) for layer, r in rows] == [
        ("input", "grad_input"), ("0", "grad_weight"), ("0", "grad_bias"), ("3", "grad_weight"),
        ("5", "grad_weight"), ("5", "grad_bias")]
    assert all(r.status == "pass" for _, r in rows)


def test_check_model_catches_a_wrong_gradient(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    module = _write_model(tmp_path, monkeypatch)
    rows = dict((layer, r) for layer, r in check_model(f"{module}:build", (2, 3, 16, 16), backend=broken)
                if r.gradient != "grad_weight")
    assert rows["input"].failed  # the first conv's grad_input is the model's grad_input


def test_cli_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    module = _write_model(tmp_path, monkeypatch)
    assert main(["check", "--model", f"{module}:build", "--input-shape", "2,3,8,8", "--backend", "gemm"]) == 0
    out = capsys.readouterr().out
    assert "layer" in out and "grad_weight" in out and "within tolerance" in out


def test_cli_random(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--random", "4", "--seed", "3", "--backend", "fwdconv"]) == 0
    assert "4 random configurations (seed 3), 12 gradients compared, 0 failed" in capsys.readouterr().out


def test_check_random_is_seeded_and_covers_both_kinds() -> None:
    first = [spec for spec, _ in check_random(12, seed=5, backends=["native"])]
    again = [spec for spec, _ in check_random(12, seed=5, backends=["native"])]
    assert first == again
    assert {s.transposed for s in first} == {False, True}


@pytest.mark.parametrize(("argv", "message"), [
    (["--input", "2,4,9,9", "--weight", "6,2,3,3", "--groups", "3"], "check: groups=3 must divide in_channels=4"),
    (["--input", "2,4,9,9"], "check: --input needs --weight"),
    (["--input", "2,4,9,9", "--weight", "6,4,3,3", "--dtype", "int32"], "check: --dtype='int32' must be one of"),
    (["--input", "2,4,9,9", "--weight", "6,4,3,3", "--backend", "cudnn"], "check: backend='cudnn' is not registered"),
    (["--input", "2,4,9,9", "--weight", "6,4,3,3", "--padding", "same", "--transposed"],
     "check: padding='same' is not defined for a transposed convolution"),
    (["--random", "0"], "check: --random=0 must be positive"),
    (["--model", "tiny_check_net"], "check: --model needs --input-shape"),
    (["--model", "tiny_check_net", "--input-shape", "1,3,8,8"], "check: --model='tiny_check_net' must be "
                                                              "package.module:factory"),
    (["--model", "no_such_module_xyz:build", "--input-shape", "1,3,8,8"], "cannot import 'no_such_module_xyz'"),
    (["--model", "tiny_check_net:missing", "--input-shape", "1,3,8,8"], "has no callable 'missing'"),
    (["--model", "tiny_check_net:not_a_model", "--input-shape", "1,3,8,8"], "returned int, not a torch.nn.Module"),
])
def test_cli_bad_arguments_give_one_line_errors(argv: list[str], message: str, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    _write_model(tmp_path, monkeypatch)
    assert main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convgrad check: error: ") and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_cli_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["check", "--input", "2,4,9,9", "--weight", "6,2,3,3", "--stride", "x"])
    assert info.value.code == 2 and "--stride: 'x' must be an int" in capsys.readouterr().err
