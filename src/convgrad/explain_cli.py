"""`convgrad explain`: print how a configuration's backward is built, and which native kernel runs.

Example::

    convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2
    convgrad explain --input 2,4,9 --weight 4,2,3 --groups 2 --padding 1:2 --code
    convgrad explain --input 1,8,4,4 --weight 8,4,4,4 --transposed --stride 2 --output-padding 1 --plot t.png
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["add_arguments", "parse_ints", "parse_padding", "run"]


def parse_ints(text: str) -> tuple[int, ...] | int:
    """'3' -> 3, '1,2' -> (1, 2)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be an int or comma-separated ints") from None
    return values[0] if len(values) == 1 and "," not in text else values


def _shape(text: str) -> tuple[int, ...]:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `convgrad explain`."""
    parser.add_argument("--input", type=_shape, required=True, metavar="N,C,...",
                        help="input size (N, C_in, *spatial) or unbatched (C_in, *spatial)")
    parser.add_argument("--weight", type=_shape, required=True, metavar="C,C,...",
                        help="weight size (C_out, C_in/groups, *k); (C_in, C_out/groups, *k) with --transposed")
    parser.add_argument("--stride", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--padding", type=parse_padding, default=0,
                        help="int, comma list, 'same', 'valid' or per-side pairs like 1:2,0:1 (default 0)")
    parser.add_argument("--dilation", type=parse_ints, default=1, help="int or comma list (default 1)")
    parser.add_argument("--groups", type=int, default=1, help="groups (default 1)")
    parser.add_argument("--transposed", action="store_true", help="explain a transposed convolution")
    parser.add_argument("--output-padding", type=parse_ints, default=0, help="transposed only (default 0)")
    parser.add_argument("--dtype", default="float32", help="dtype for the native kernel choice (default float32)")
    parser.add_argument("--device", default="cpu", help="device for the native kernel choice (default cpu)")
    parser.add_argument("--code", action="store_true", help="print the standalone PyTorch script instead")
    parser.add_argument("--plot", metavar="PATH", help="save the recipe's figure (PNG, SVG, PDF...)")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"explain: --dtype {name!r} is not a torch dtype (e.g. float32, float64, bfloat16)")
    return dtype


def _pairs(padding: Any, n: int) -> Any:
    """One lo:hi pair given for a multi-dim conv stands for every dim."""
    if isinstance(padding, tuple) and len(padding) == 1 and isinstance(padding[0], tuple):
        return padding * n
    return padding


def run(args: argparse.Namespace) -> int:
    """Print the recipe and the native choice (or the script with --code); save the figure with --plot."""
    import convgrad

    padding = _pairs(args.padding, len(args.weight) - 2)
    hyper = dict(stride=args.stride, padding=padding, dilation=args.dilation, transposed=args.transposed,
                 output_padding=args.output_padding, groups=args.groups)
    recipe = convgrad.explain(args.input, args.weight, **hyper)
    if args.code:
        print(recipe.to_python(), end="")
    else:
        print(recipe)
        print()
        print(convgrad.native_backend(args.input, args.weight, **hyper, dtype=_dtype(args.dtype), device=args.device))
    if args.plot:
        recipe.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
