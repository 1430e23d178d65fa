"""`convgrad explain`: print how a configuration's backward is built, and which native kernel runs.

Example::

    convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2
    convgrad explain --input 2,4,9 --weight 4,2,3 --groups 2 --padding 1:2 --code
    convgrad explain --input 1,8,4,4 --weight 8,4,4,4 --transposed --stride 2 --output-padding 1 --plot t.png
    convgrad explain --input 1,1,5,5 --weight 1,1,3,3 --stride 2 --method zero_insert --animate zeros.gif
    convgrad explain --input 1,1,3,3 --weight 1,1,3,3 --transposed --stride 2 --html transposed.html
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from convgrad.cli import add_conv_arguments, parse_shape, shapes_as_typed
from convgrad.errors import ConvgradValueError
from convgrad.explain import fft_view
from convgrad.explain.frames import GRADIENTS
from convgrad.explain.methods import EXPLAIN_INPUT_METHODS, EXPLAIN_WEIGHT_METHODS, METHODS, resolve_methods

__all__ = ["add_arguments", "check_outputs", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `convgrad explain`."""
    parser.add_argument("--input", type=parse_shape, required=True, metavar="N,C,...",
                        help="input size (N, C_in, *spatial) or unbatched (C_in, *spatial)")
    parser.add_argument("--weight", type=parse_shape, required=True, metavar="C,C,...",
                        help="weight size (C_out, C_in/groups, *k); (C_in, C_out/groups, *k) with --transposed")
    add_conv_arguments(parser)
    parser.add_argument("--dtype", default="float32", help="dtype for the native kernel choice (default float32)")
    parser.add_argument("--device", default="cpu", help="device for the native kernel choice (default cpu)")
    parser.add_argument("--code", action="store_true", help="print the standalone PyTorch script instead")
    parser.add_argument("--plot", metavar="PATH", help="save the recipe's figure (PNG, SVG, PDF...)")
    parser.add_argument("--animate", metavar="PATH",
                        help="save a step-through animation: .gif or .webp, .mp4 (needs ffmpeg), or .html")
    parser.add_argument("--html", metavar="PATH", help="save a self-contained page: frames with a slider, the "
                                                        "recipe and its PyTorch script")
    parser.add_argument("--max-frames", type=int, default=120,
                        help=f"frames in --animate/--html, at least {len(GRADIENTS)} (default 120)")
    parser.add_argument("--text", action="store_true",
                        help="print the recipe too when --plot, --animate or --html is given (they print only the "
                             "files they wrote)")
    methods = ", ".join(METHODS)
    parser.add_argument("--method", help=f"a formulation to show, for whichever gradient has it ({methods})")
    parser.add_argument("--input-method", choices=EXPLAIN_INPUT_METHODS,
                        help="the formulation of x from y: grad_input, or a transposed conv's own forward")
    parser.add_argument("--weight-method", choices=EXPLAIN_WEIGHT_METHODS, help="the formulation of grad_weight")


def _dtype(name: str) -> Any:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ConvgradValueError(f"explain: --dtype {name!r} is not a torch dtype (e.g. float32, float64, bfloat16)")
    if not (dtype.is_floating_point or dtype.is_complex):
        raise ConvgradValueError(
            f"explain: --dtype {name!r} must be a floating or complex dtype (e.g. float32, float64, "
            "bfloat16)")
    return dtype


def _pairs(padding: Any, n: int) -> Any:
    """One lo:hi pair given for a multi-dim conv stands for every dim."""
    if isinstance(padding, tuple) and len(padding) == 1 and isinstance(padding[0], tuple):
        return padding * n
    return padding


def _suffixes(option: str) -> tuple[str, ...]:
    """The file types each output option writes, by suffix."""
    if option == "plot":
        from matplotlib.backends.backend_agg import FigureCanvasAgg

        known = [f".{ext}" for ext in FigureCanvasAgg.get_supported_filetypes()]
        first = (".png", ".svg", ".pdf")
        return (*first, *sorted(ext for ext in known if ext not in first))
    if option == "animate":
        from convgrad.explain.animation import SUFFIXES

        return SUFFIXES
    return (".html", ".htm")


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, before anything is computed or printed, an output path that would not be written as given: one with
    no extension or an unknown one (matplotlib would add .png to the first), a folder, a folder that does not exist,
    a place this user cannot write, and an .mp4 without ffmpeg; and a --max-frames below one frame per computation
    (the frames of forward, grad_input and grad_weight are drawn)."""
    if args.max_frames < len(GRADIENTS):
        raise ConvgradValueError(f"--max-frames={args.max_frames} must be at least {len(GRADIENTS)}: one frame for "
                                 f"each of {', '.join(GRADIENTS)}")
    for option in ("plot", "animate", "html"):
        value = getattr(args, option)
        if value is None:
            continue
        path, suffixes = Path(value), _suffixes(option)
        if path.is_dir():
            example = path / f"recipe{suffixes[0]}"
            raise ConvgradValueError(f"--{option}={value} is a folder; give a file in it, e.g. {example}")
        if path.suffix.lower() not in suffixes:
            what = f"has the extension {path.suffix!r}, which it cannot write" if path.suffix else "has no extension"
            raise ConvgradValueError(f"--{option}={value} {what}; end it in one of {', '.join(suffixes)}")
        if option == "animate" and path.suffix.lower() == ".mp4":
            from matplotlib import animation

            if not animation.writers.is_available("ffmpeg"):
                raise ConvgradValueError(
                    f"--animate={value} needs ffmpeg, which is not installed; write a .gif, .webp or "
                    ".html instead")
        existed = path.exists()
        with open(path, "ab"):  # OSError with the path: a missing folder, a file in the way, no permission
            pass
        if not existed:
            path.unlink()


def run(args: argparse.Namespace) -> int:
    """Print the recipe and the native choice (or the script with --code); save the figure with --plot, the
    animation with --animate, the page with --html, which print instead one line per file written (the recipe too
    with --text)."""
    import convgrad

    dtype = _dtype(args.dtype)  # a bad --dtype or output path is refused before anything is printed or written
    check_outputs(args)
    padding = _pairs(args.padding, len(args.weight) - 2)
    hyper = dict(stride=args.stride, padding=padding, dilation=args.dilation, transposed=args.transposed,
                 output_padding=args.output_padding, groups=args.groups)
    # the method names first: how --input was read explains a shape error, not a misspelt method
    resolve_methods(args.method, args.input_method, args.weight_method)
    with shapes_as_typed(args.input, args.weight, fn="explain"):
        recipe = convgrad.explain(args.input, args.weight, **hyper, method=args.method,
                                  input_method=args.input_method, weight_method=args.weight_method)
    if args.animate or args.html:  # frames of an fft plan: refused before anything is printed, like a bad path
        for gradient, plan in {**recipe.plans, "forward": recipe.forward_plan}.items():
            if fft_view.is_fft(plan):
                raise fft_view.frames_refused(f"explain --{'animate' if args.animate else 'html'}", gradient)
    if args.code:
        print(recipe.to_python(), end="")
    elif args.text or not (args.plot or args.animate or args.html):  # a picture command says only what it wrote
        print(recipe)
        print()
        print(convgrad.native_backend(args.input, args.weight, **hyper, dtype=dtype, device=args.device))
    if args.plot:
        recipe.plot(args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.animate:
        print(f"wrote {recipe.animate(args.animate, max_frames=args.max_frames)}", file=sys.stderr)
    if args.html:
        print(f"wrote {recipe.to_html(args.html, max_frames=args.max_frames)}", file=sys.stderr)
    return 0
