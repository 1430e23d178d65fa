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

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("convgrad.demo", "train a small CNN on real digits with convgrad's backward, twin-checked"),
    "check": ("convgrad.check", "verify every backend's gradients for a configuration or a model"),
    "bench": ("convgrad.bench", "time every backend against native on a suite of real layers"),
    "explain": ("convgrad.explain_cli", "show how a backward is built and which native kernel runs"),
}


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
