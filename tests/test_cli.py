"""The command line as a user meets it: one line on stderr and exit 2 for a user error, quiet on a closed pipe.

The commands run in-process (``cli.main(argv)`` with its streams captured); two smoke tests start real
processes: ``python -m convgrad`` and the ``convgrad`` console script (a shell pipeline into ``head`` is in
the slow tier).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import pytest
import torch

from convgrad import cli
from convgrad.errors import ConvgradValueError, MethodRefused

CONFIG = ["--input", "2,4,9,9", "--weight", "6,2,3,3", "--stride", "2", "--groups", "2"]
TINY = ["--input", "1,1,5", "--weight", "1,1,3"]  # its picture draws in a fraction of CONFIG's time
ABSENT_CUDA = "cuda:99" if torch.cuda.is_available() else "cuda"  # a device this machine does not have


def _process(*args: str, cwd: Path | None = None,
             program: tuple[str, ...] = (sys.executable, "-m", "convgrad")) -> subprocess.CompletedProcess[str]:
    """A real process, for the smoke tests. GNU readline, which pytest loads, exports COLUMNS=80 to children; a
    user's pipe has no COLUMNS."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return subprocess.run([*program, *args], capture_output=True, text=True, cwd=cwd, timeout=600, env=env)


@dataclass
class Ran:
    """What ``cli.main(argv)`` left: its exit status and what it wrote (a CompletedProcess's fields)."""

    returncode: int
    stdout: str
    stderr: str


@contextlib.contextmanager
def _cwd(path: Path | None) -> Iterator[None]:
    """In ``path``, as a process started there would be, with its modules imported afresh and forgotten after."""
    before, modules = os.getcwd(), set(sys.modules)
    os.chdir(path or before)
    try:
        yield
    finally:
        os.chdir(before)
        for name in set(sys.modules) - modules:
            if name == "mymodels":
                del sys.modules[name]


def _convgrad(*args: str, cwd: Path | None = None, stdout: TextIO | None = None) -> Ran:
    """``convgrad ARGS`` in-process: cli.main with stdout (or the given stream) and stderr captured."""
    out, err = io.StringIO(), io.StringIO()
    with _cwd(cwd), contextlib.redirect_stdout(stdout or out), contextlib.redirect_stderr(err):
        try:
            code: Any = cli.main(list(args))
        except SystemExit as exit_:
            code = exit_.code
    return Ran(int(code or 0), out.getvalue(), err.getvalue())


def _assert_one_line_error(proc: Ran, command: str, message: str) -> None:
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"convgrad {command}: error: ") and message in err, err
    assert f"error: {command}:" not in err and f"error: convgrad {command}:" not in err  # one prefix


def test_help_lists_the_commands() -> None:
    proc = _convgrad("--help")
    assert proc.returncode == 0 and proc.stderr == ""
    for command in ("demo", "check", "bench", "explain"):
        assert command in proc.stdout


def test_python_m_convgrad_runs_the_commands() -> None:
    """Smoke test: a real ``python -m convgrad`` process (one: each costs an interpreter and torch's import)."""
    proc = _process("check", *CONFIG, "--backend", "fwdconv", "--dtype", "float16")
    assert proc.returncode == 0 and "every gradient within its error bound" in proc.stdout, proc.stdout + proc.stderr


MODEL = textwrap.dedent("""
    import torch

    def small_cnn():
        return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2), torch.nn.ReLU(), torch.nn.Conv2d(4, 2, 1))

    def broken():
        raise RuntimeError("no weights here")

    def no_conv():
        return torch.nn.Linear(3, 3)
""")
BENCH_MODEL = ["--model", "mymodels:small_cnn", "--input-shape", "2,3,9,9"]


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "mymodels.py").write_text(MODEL)
    return tmp_path


@pytest.mark.parametrize(("command", "argv", "message"), [
    ("check", [*CONFIG, "--device", ABSENT_CUDA], f"--device={ABSENT_CUDA} is not available here"),
    ("explain", [*CONFIG, "--device", ABSENT_CUDA], f"--device={ABSENT_CUDA} is not available here"),
    ("check", [*CONFIG, "--device", "foo"], "--device=foo is not a device"),
    ("explain", [*CONFIG, "--device", "foo"], "--device=foo is not a device"),
    ("explain", [*TINY, "--plot", "/nonexistent/dir/x.png"], "/nonexistent/dir/x.png: No such file or directory"),
    ("explain", [*TINY, "--plot", "{tmp}/mymodels.py/x.png"], "mymodels.py/x.png: Not a directory"),
    ("check", ["--model", "mymodels:small_cnn", "--input-shape", "2,5,9,9"],
     "--model='mymodels:small_cnn' fails on --input-shape=2,5,9,9 (RuntimeError: Given groups=1"),
    ("check", ["--model", "mymodels", "--input-shape", "2,3,9,9"],
     "--model='mymodels' must be module:factory or path/to/file.py:factory"),
    ("check", ["--model", "mymodels:nothing", "--input-shape", "2,3,9,9"], "mymodels has no callable 'nothing'"),
    ("check", ["--model", "missing.py:small_cnn", "--input-shape", "2,3,9,9"], "there is no file 'missing.py'"),
    ("check", ["--input", "2,4,9,9", "--weight", "6,2,3,3", "--groups", "3"], "groups=3 must divide in_channels=4"),
    ("explain", ["--input", "2,4,9", "--weight", "4,3,3", "--groups", "2"], "weight.shape=(4, 3, 3) with groups=2"),
    ("check", ["--input", "100000,100000,100000", "--weight", "1,100000,1", "--backend", "native"],
     "not enough memory for these sizes (tried to allocate 8000000000000000 bytes)"),  # 8 PB: beyond any address space
    ("demo", ["--out", "{tmp}/mymodels.py/run", "--steps", "1"], "mymodels.py/run: Not a directory"),  # before training
    # bench --model: check --model's loader, its messages naming bench
    ("bench", ["--model", "mymodels:small_cnn", "--input-shape", "2,5,9,9"],
     "--model='mymodels:small_cnn' fails on --input-shape=2,5,9,9 (RuntimeError: Given groups=1"),
    ("bench", ["--model", "mymodels:broken", "--input-shape", "2,3,9,9"],
     "--model='mymodels:broken': broken() failed (RuntimeError: no weights here)"),
    ("bench", ["--model", "no_such_module_xyz:build", "--input-shape", "2,3,9,9"],
     "cannot import 'no_such_module_xyz'"),
    ("bench", ["--model", "mymodels:nothing", "--input-shape", "2,3,9,9"], "mymodels has no callable 'nothing'"),
    ("bench", ["--model", "mymodels:no_conv", "--input-shape", "2,3"], "has no convolution"),
    ("bench", ["--model", "mymodels:small_cnn"], "--model needs --input-shape, e.g. --input-shape 8,3,224,224"),
    ("bench", [*BENCH_MODEL, "--layers", "resnet*"], "--layers applies to the suites, not to --model"),
    ("bench", ["--suite", "smoke", "--steps", "3"], "--steps applies to --model, not to the suites"),
    ("bench", [*BENCH_MODEL, "--dtype", "float32", "float64"], "--model times one --dtype, not float32 float64"),
    ("bench", [*BENCH_MODEL, "--backend", "nope"], "backend='nope' is not registered"),
    ("bench", [*BENCH_MODEL, "--steps", "0"], "--steps=0 must be at least 1"),
])
def test_user_errors_are_one_line_and_exit_2(command: str, argv: list[str], message: str, model_dir: Path) -> None:
    """Before: tracebacks (AssertionError for cuda, FileNotFoundError for --plot, the model's RuntimeError),
    doubled prefixes ("convgrad check: error: check: ...")."""
    proc = _convgrad(command, *(a.replace("{tmp}", str(model_dir)) for a in argv), cwd=model_dir)
    _assert_one_line_error(proc, command, message)


@pytest.mark.parametrize("model", ["mymodels:broken", "mymodels:nothing", "mymodels", "missing.py:f"])
def test_bench_model_errors_name_bench_not_check(model: str, model_dir: Path) -> None:
    """The loader is check's: its messages said "check: --model=..." under `convgrad bench` too."""
    proc = _convgrad("bench", "--model", model, "--input-shape", "2,3,9,9", cwd=model_dir)
    assert proc.returncode == 2 and "check" not in proc.stderr, proc.stderr


@pytest.mark.parametrize(("argv", "module"), [(["bench", "--suite", "smoke", "--list"], "rich.progress"),
                                             (["demo", "--epochs", "1"], "rich.console")])
def test_bench_and_demo_without_the_demo_extras_say_so_in_one_line_and_exit_2(argv: list[str], module: str,
                                                                             capsys: Any, monkeypatch: Any) -> None:
    """Both commands ask one helper (cli.demo_extras_missing) before they import rich. Mutant: the helper returning
    False -> the command goes on and fails on the import."""
    monkeypatch.setitem(sys.modules, module, None)  # `import rich.x` raises ModuleNotFoundError
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"convgrad {argv[0]}: needs the demo extras ({module} is missing): pip install 'convgrad[demo]'"]


def test_model_in_the_current_directory_with_the_console_script(model_dir: Path) -> None:
    """Smoke test, a real process: the `convgrad` script does not put the cwd on sys.path; `--model
    mymodels:small_cnn` must still import."""
    script = Path(sys.executable).with_name("convgrad")
    if not script.exists():
        pytest.skip("the convgrad console script is not installed next to this interpreter")
    proc = _process("check", "--model", "mymodels:small_cnn", "--input-shape", "2,3,9,9", "--dtype", "bfloat16",
                    cwd=model_dir, program=(str(script),))
    assert proc.returncode == 0, proc.stderr
    assert "every gradient within its error bound" in proc.stdout and "fwdconv" in proc.stdout


def test_model_given_as_a_file_path(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    proc = _convgrad("check", "--model", f"{model_dir / 'mymodels.py'}:small_cnn", "--input-shape", "1,3,7,7",
                     "--backend", "gemm", cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Conv2d(") == 2 and proc.stdout.count("grad_bias") == 2  # each conv named once


@pytest.mark.parametrize("command", ["check", "explain"])
def test_padding_error_names_every_accepted_form(command: str) -> None:
    proc = _convgrad(command, *CONFIG, "--padding", "foo")
    _assert_one_line_error(proc, command, "argument --padding: 'foo' must be")
    for form in ("an int", "comma list", "'same'", "'valid'", "lo:hi"):
        assert form in proc.stderr, proc.stderr


@pytest.mark.parametrize(("argv", "message"), [
    (["check", "--input", "two,4,9,9", "--weight", "6,2,3,3"], "argument --input: 'two,4,9,9' must be an int"),
    (["check", "--random", "abc"], "argument --random: invalid int value: 'abc'"),
    (["check"], "one of the arguments --input --model --random is required"),
    (["explain", "--input", "x", "--weight", "6,4,3,3"], "argument --input: 'x' must be an int"),
    (["bench", "--threads", "abc"], "argument --threads: invalid int value: 'abc'"),
    (["demo", "--epochs", "abc"], "argument --epochs: invalid int value: 'abc'"),
    (["nope"], "argument COMMAND: invalid choice: 'nope'"),
    # before: "the following arguments are required: COMMAND", the bad option unnamed
    (["--nonsense"], "unrecognized argument --nonsense; a command comes first: demo, check, bench, explain"),
    (["-x", "--y=3"], "unrecognized arguments -x --y=3; a command comes first"),
    # before: "convgrad: error: ...", pointing at the top level's --help, which does not list bench's options
    (["bench", "--nonsense"], "unrecognized arguments: --nonsense"),
])
def test_argument_errors_are_one_line_and_exit_2(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Before: argparse printed the whole usage (3 to 10 lines) above its error line."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    err = capsys.readouterr().err
    prog = "convgrad" if argv[0] not in cli.COMMANDS else f"convgrad {argv[0]}"
    assert info.value.code == 2 and err.count("\n") == 1 and err.startswith(f"{prog}: error: {message}"), err
    assert err.endswith(f"(see {prog} --help)\n"), err


@pytest.mark.parametrize("argv", [["explain", *CONFIG], ["explain", *CONFIG, "--code"], ["check", *CONFIG],
                                  ["check", "--random", "3", "--backend", "native"]])
def test_a_closed_pipe_ends_quietly(argv: list[str]) -> None:
    """`convgrad ... | head -1`: the reader is gone before the first write; no message, no traceback."""
    read, write = os.pipe()
    os.close(read)  # every write now fails with EPIPE, deterministically
    try:
        with io.TextIOWrapper(io.FileIO(write, "w", closefd=False)) as pipe:
            proc = _convgrad(*argv, stdout=pipe)
            with contextlib.suppress(BrokenPipeError):
                pipe.close()  # what the command left in the buffer cannot be written either
    finally:
        os.close(write)
    assert proc.stderr == "" and proc.returncode == cli.CLOSED_PIPE


@pytest.mark.slow
def test_head_in_a_shell_pipeline_ends_quietly() -> None:
    script = f"{sys.executable} -m convgrad check --random 40 --verbose | head -1"
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.stderr == "" and len(proc.stdout.splitlines()) == 1


def test_interrupt_is_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(args: Any) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr("convgrad.cli.check.run", interrupted)
    assert cli.main(["check", *CONFIG]) == 130
    assert capsys.readouterr().err == "convgrad check: interrupted\n"


def test_library_prefixes_are_not_repeated(capsys: pytest.CaptureFixture[str]) -> None:
    """Messages that already name the command ("check: ...", "convgrad bench: ...") keep one prefix."""
    assert cli.main(["check", "--random", "0"]) == 2
    assert capsys.readouterr().err == "convgrad check: error: --random=0 must be positive\n"
    assert cli.main(["bench", "--suite", "smoke", "--threads", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convgrad bench: error: --threads=0") and err.count("convgrad bench") == 1, err


@pytest.mark.parametrize("error", [ConvgradValueError("check: --random=0 must be positive"),
                                   MethodRefused("explain", "blocks", "needs stride 1 in every dim"),
                                   FileNotFoundError(2, "No such file or directory", "x/y.png")])
def test_a_user_error_is_one_line_with_status_2(error: Exception, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Only convgrad's typed errors (convgrad.errors) and OSError are a user's: one line, exit 2."""
    def fails(args: Any) -> int:
        raise error

    monkeypatch.setattr("convgrad.cli.check.run", fails)
    assert cli.main(["check", *CONFIG]) == 2
    err = capsys.readouterr().err
    assert err.startswith("convgrad check: error: ") and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("error", [TypeError("unsupported operand type(s) for +: 'int' and 'NoneType'"),
                                   ValueError("not enough values to unpack (expected 2, got 1)"),
                                   KeyError("grad_input"), AssertionError(), RuntimeError("shape mismatch")])
def test_any_other_exception_is_a_bug_with_its_traceback(error: Exception, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A library bug (a plain TypeError or ValueError raised by Python itself, not a ConvgradError) is not dressed
    as a user error: the traceback, a line saying it is a bug to report on the issue tracker, exit 1. Mutant: the
    old ``except (ValueError, TypeError, OSError)`` turned the first two into one line with status 2."""
    def fails(args: Any) -> int:
        raise error

    monkeypatch.setattr("convgrad.cli.check.run", fails)
    assert cli.main(["check", *CONFIG]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and f"{type(error).__name__}" in err, err
    assert err.rstrip().splitlines()[-1].startswith("convgrad check: internal error: this is a bug in convgrad"), err
    assert "report it on the issue tracker" in err
