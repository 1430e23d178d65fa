"""`convgrad demo | check | bench | explain`: one argparse front end, one module per command.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``. Whatever a
user can cause ends here as one line on stderr and exit status 2, never a traceback: a
``ConvgradError`` from the library or the commands (``convgrad.errors``), a path that cannot be written
(OSError), a ``--device`` this machine does not have, sizes too large for its memory. Any other exception is a
bug: its traceback is printed, with a line asking for a report on the issue tracker, and the status is 1.
A closed pipe (``convgrad ... | head``) ends
quietly, as the Python documentation advises for SIGPIPE, with status 141 (128 + SIGPIPE): what a shell reports for
a program that a closed pipe stops (``yes | head``), so ``set -o pipefail`` sees it as such and never as 1, which
``convgrad check`` and ``convgrad demo`` return for a gradient out of tolerance.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import os
import re
import sys
import traceback
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

from convgrad.errors import ConvgradError, ConvgradValueError

CLOSED_PIPE = 141  # 128 + SIGPIPE (13): the status a shell gives a program that a closed pipe ends

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("convgrad.cli.demo", "train a small CNN on real digits with convgrad's backward, twin-checked"),
    "check": ("convgrad.cli.check", "verify every backend's gradients for a configuration or a model"),
    "bench": ("convgrad.cli.bench", "time every backend against native on a suite of real layers"),
    "explain": ("convgrad.cli.explain", "show how a backward is built and which native kernel runs"),
}


def parse_ints(text: str) -> tuple[int, ...] | int:
    """'3' -> 3, '1,2' -> (1, 2)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be an int or comma-separated ints") from None
    return values[0] if len(values) == 1 and "," not in text else values


def parse_shape(text: str) -> tuple[int, ...]:
    """'1,3,5' -> (1, 3, 5); a single int is a 1-tuple."""
    value = parse_ints(text)
    return (value,) if isinstance(value, int) else value


PADDING_FORMS = "an int (1), a comma list (1,2), 'same', 'valid' or per-side lo:hi pairs (1:2,0:1)"


def parse_padding(text: str) -> Any:
    """'1', '1,2', 'same', 'valid', or per-side pairs '1:2,0:1' (one pair stands for every dim)."""
    if text in ("same", "valid"):
        return text
    try:
        if ":" not in text:
            return parse_ints(text)
        pairs = []
        for part in text.split(","):
            lo, sep, hi = part.partition(":")
            if not sep:
                raise ValueError(part)
            pairs.append((int(lo), int(hi)))
        return tuple(pairs)
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{text!r} must be {PADDING_FORMS}") from None


def add_conv_arguments(parser: argparse.ArgumentParser) -> None:
    """The convolution hyperparameters shared by `convgrad explain` and `convgrad check`, in torch's names."""
    parser.add_argument("--stride", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--padding", type=parse_padding, default=0,
                        help=f"{PADDING_FORMS} (default 0)")
    parser.add_argument("--dilation", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--groups", type=int, default=1, help="groups (default 1)")
    parser.add_argument("--transposed", action="store_true", help="a transposed convolution")
    parser.add_argument("--output-padding", type=parse_ints, default=0, help="transposed only (default 0)")


_SPATIAL = {1: ("L",), 2: ("H", "W"), 3: ("D", "H", "W")}


def read_as(input_size: Sequence[int], weight_size: Sequence[int], option: str = "--input") -> str:
    """How an input size typed on the command line is read against the weight, entry by entry:
    "--input 3,9,9 is read as unbatched (C_in, H, W): C_in=3 is its entry 1" ("" when the dims cannot match)."""
    n = len(weight_size) - 2
    if n not in _SPATIAL or len(input_size) not in (n + 1, n + 2):
        return ""
    unbatched = len(input_size) == n + 1
    names = ("C_in", *_SPATIAL[n]) if unbatched else ("N", "C_in", *_SPATIAL[n])
    where = names.index("C_in")
    return (f"{option} {','.join(map(str, input_size))} is read as {'unbatched ' if unbatched else ''}"
            f"({', '.join(names)}): C_in={input_size[where]} is its entry {where + 1}")


@contextlib.contextmanager
def shapes_as_typed(input_size: Sequence[int], weight_size: Sequence[int], option: str = "--input",
                    fn: str = "") -> Iterator[None]:
    """Add to a ValueError about the shapes how the input size was read (which entry is C_in), einops's habit of
    re-raising with the context the user knows. An input one size short of a batched one is read as unbatched,
    the likelier slip then being a missing size: the message starts with that reading, not with what it broke
    (``--input 1,1,5 --weight 1,1,3,3`` blamed the kernel's height for the input's H=1)."""
    try:
        yield
    except ConvgradValueError as err:
        context = read_as(input_size, weight_size, option)
        if not context:
            raise
        message = " ".join(str(err).split())
        n = len(weight_size) - 2
        if len(input_size) == n + 1:
            batched = ", ".join(("N", "C_in", *_SPATIAL[n]))
            raise ConvgradValueError(
                f"{option} {','.join(map(str, input_size))} has {n + 1} sizes and --weight "
                f"{','.join(map(str, weight_size))} is a {n}d convolution's, so the input is read as unbatched "
                f"({', '.join(('C_in', *_SPATIAL[n]))}) = ({', '.join(map(str, input_size))}); a batched input "
                f"takes {n + 2} sizes ({batched}). Read so: {message.removeprefix(f'{fn}: ')}") from None
        raise ConvgradValueError(f"{message} ({context})") from None


class _Parser(argparse.ArgumentParser):
    """argparse, with a bad argument reported as every other user error: one line on stderr, exit 2 (argparse
    would print the whole usage first; ``--help`` still shows it). The commands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.argv: list[str] = []  # what was typed, for error()
        self.commands: dict[str, argparse.ArgumentParser] = {}  # the top level's: each command's parser

    def parse_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:  # reported by the command's parser, whose --help lists what it takes
            self.commands.get(getattr(parsed, "command", None) or "", self).error(
                f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def parse_known_args(  # type: ignore[override]
            self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        self.argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        unknown = [a for a in self.argv if a.startswith("-") and a.split("=")[0] not in self._option_string_actions]
        if message.startswith("the following arguments are required: COMMAND") and unknown:
            # argparse names the missing command, not the option it could not place: `convgrad --nonsense`
            message = (f"unrecognized argument{'s' if len(unknown) > 1 else ''} {' '.join(unknown)}; a command "
                       f"comes first: {', '.join(COMMANDS)}")
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from convgrad import __version__

    parser = _Parser(prog="convgrad", description="The backward pass of convolution, explicit.")
    parser.add_argument("--version", action="version", version=f"convgrad {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as err:
            if err.name != module:
                raise
            continue
        p = sub.add_parser(name, help=help_, description=help_)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    parser.commands = dict(sub.choices)
    return parser


def _check_device(value: str | None) -> None:
    """Refuse a ``--device`` torch does not know, or one this machine does not have, before any work starts."""
    if value in (None, "auto"):
        return
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise ConvgradValueError(f"--device={value} is not a device (cpu, cuda, cuda:1, mps, ...)") from None
    try:
        torch.empty(0, device=device)
    except (AssertionError, RuntimeError) as err:  # "Torch not compiled with CUDA enabled", a missing ordinal...
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConvgradValueError(f"--device={value} is not available here ({reason})") from None


def _one_line(command: str, err: BaseException) -> str:
    """The message of a user error, on one line, without a prefix that repeats the command's name."""
    if isinstance(err, OSError) and err.filename is not None:  # "x/y.png: No such file or directory"
        message = f"{err.filename}: {err.strerror or err}"
    else:
        message = " ".join(str(err).split()) or type(err).__name__
    for prefix in (f"convgrad {command}: ", f"{command}: ", "convgrad: "):
        message = message.removeprefix(prefix)
    return f"convgrad {command}: error: {message}"


@functools.cache
def _console_class() -> type:
    from rich.console import Console

    class PipeConsole(Console):
        """rich's Console, except that a closed pipe reaches main() as BrokenPipeError: rich's own handler exits
        with status 1, which check and demo return for a gradient out of tolerance."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return PipeConsole


def console(**kwargs: Any) -> Any:
    """The rich Console of every command (needs the demo extras)."""
    return _console_class()(**kwargs)


def demo_extras_missing(command: str, module: str) -> bool:
    """Whether the demo extras are missing (``module`` does not import); if so, says so on stderr for ``convgrad
    command``, which then returns 2."""
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as err:
        print(f"convgrad {command}: needs the demo extras ({err.name} is missing): pip install 'convgrad[demo]'",
              file=sys.stderr)
        return True
    return False


def _quiet_stdout() -> None:
    """After a closed pipe: point stdout at devnull, so that the flush at exit does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # stdout replaced by an object without a file descriptor
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the command, return its exit status."""
    args = build_parser().parse_args(argv)
    try:
        _check_device(getattr(args, "device", None))
        code = int(args._run(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, inside the handler, not at interpreter exit
        return code
    except BrokenPipeError:
        _quiet_stdout()
        return CLOSED_PIPE
    except KeyboardInterrupt:
        print(f"convgrad {args.command}: interrupted", file=sys.stderr)
        return 130
    except (ConvgradError, OSError) as err:
        print(_one_line(args.command, err), file=sys.stderr)
        return 2
    except (MemoryError, RuntimeError) as err:  # torch's allocators: sizes this machine cannot hold
        if isinstance(err, RuntimeError) and not any(s in str(err) for s in ("can't allocate memory", "out of memory")):
            return _bug(args.command)
        tried = re.search(r"tried to allocate [^.(]*[^.( ]", str(err))
        print(f"convgrad {args.command}: error: not enough memory for these sizes"
              f"{f' ({tried.group(0)})' if tried else ''}", file=sys.stderr)
        return 2
    except Exception:  # not an error a user can cause (those are ConvgradError): a bug, shown whole
        return _bug(args.command)


def _bug(command: str) -> int:
    """Print the exception being handled with its traceback, say it is a bug to report, return 1."""
    traceback.print_exc()
    print(f"convgrad {command}: internal error: this is a bug in convgrad, not in your arguments; please report it "
          f"on the issue tracker with the command line and the traceback above", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
