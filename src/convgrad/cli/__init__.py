"""`convgrad demo | check | bench | explain`: one argparse front end, one module per command.

Each command module defines ``add_arguments(parser)`` and ``run(args) -> int``. A
ValueError or TypeError from the library is a user error: it is printed as one
line, without a traceback, and the exit status is 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Any

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


def parse_padding(text: str) -> Any:
    """'1', '1,2', 'same', 'valid', or per-side pairs '1:2,0:1' (one pair stands for every dim)."""
    if text in ("same", "valid"):
        return text
    if ":" not in text:
        return parse_ints(text)
    pairs = []
    for part in text.split(","):
        lo, sep, hi = part.partition(":")
        if not sep or not lo.strip().lstrip("-").isdigit() or not hi.strip().lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: per-side padding is lo:hi per dim, e.g. 1:2,0:1")
        pairs.append((int(lo), int(hi)))
    return tuple(pairs)


def add_conv_arguments(parser: argparse.ArgumentParser) -> None:
    """The convolution hyperparameters shared by `convgrad explain` and `convgrad check`, in torch's names."""
    parser.add_argument("--stride", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--padding", type=parse_padding, default=0,
                        help="int, comma list, 'same', 'valid' or per-side pairs like 1:2,0:1 (default 0)")
    parser.add_argument("--dilation", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--groups", type=int, default=1, help="groups (default 1)")
    parser.add_argument("--transposed", action="store_true", help="a transposed convolution")
    parser.add_argument("--output-padding", type=parse_ints, default=0, help="transposed only (default 0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="convgrad", description="The backward pass of convolution, explicit.")
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except (ValueError, TypeError) as err:
        print(f"convgrad {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
