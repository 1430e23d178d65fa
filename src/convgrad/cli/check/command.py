"""The options and the tables of `convgrad check`."""

from __future__ import annotations

import argparse
import contextlib
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from convgrad.backends import get_backend
from convgrad.cli import add_conv_arguments, parse_ints, shapes_as_typed
from convgrad.cli import console as cli_console
from convgrad.cli.check.configs import check_config, check_random
from convgrad.cli.check.judge import DTYPES, GRADIENTS, Result
from convgrad.cli.check.model import LayerCheck, check_model
from convgrad.errors import ConvgradValueError

__all__ = ["add_arguments", "run"]

BOUND_LEGEND = "err / bound: the largest error over its bound (pass when at most 1)"
NATIVE_LEGEND = "err / native: the largest error over native's own on the same inputs"
CELL_LEGEND = "a backend's cell: the largest error over its bound among its gradients (pass when at most 1)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `convgrad check`."""
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--input", type=parse_ints, metavar="N,C,...", help="input size: check one configuration")
    mode.add_argument("--model", metavar="MODULE:FACTORY",
                      help="check every conv of the model that FACTORY() builds; MODULE is a module name "
                           "(the current directory is searched) or a path/to/file.py")
    mode.add_argument("--random", type=int, metavar="N", help="check N random configurations and list them")
    parser.add_argument("--weight", type=parse_ints, metavar="C,C,...", help="weight size (with --input)")
    add_conv_arguments(parser)
    parser.add_argument("--input-shape", type=parse_ints, metavar="N,C,...", help="model input size (with --model)")
    parser.add_argument("--dtype", default="float64",
                        help=f"the dtype the backends compute in: one of {', '.join(DTYPES)} (default float64)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend to check (repeatable; default every backend)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random data and configurations (default 0)")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="with --random or --model: one row per backend and gradient, with the errors")


def _as_tuple(value: Any) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _pairs(padding: Any, n: int) -> Any:
    """One lo:hi pair given for a multi-dim conv stands for every dim (as in `convgrad explain`)."""
    if isinstance(padding, tuple) and len(padding) == 1 and isinstance(padding[0], tuple):
        return padding * n
    return padding


def _console() -> Any:
    console = cli_console()
    if not console.is_terminal and "COLUMNS" not in os.environ:  # a file or a pipe: whole rows, not 80 columns
        console.width = 240
    return console


@contextlib.contextmanager
def _progress(console: Any, description: str) -> Iterator[Callable[[int, int], None]]:
    """A transient progress bar on a terminal; nothing at all in a file or a pipe."""
    if not console.is_terminal:
        yield lambda done, total: None
        return
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)
        yield lambda done, total: bar.update(task, completed=done, total=total)


def _fmt(v: float, ratio: bool = False) -> str:
    if math.isnan(v):
        return "-"
    if ratio:
        return "inf" if math.isinf(v) else f"{v:.2f}" if v < 100 else f"{v:.3g}"
    return f"{v:.2e}"


def _table(first: tuple[str, ...], rows: list[tuple[str, ...]], last: tuple[str, ...]) -> Any:
    from rich.table import Table

    legend = [BOUND_LEGEND, NATIVE_LEGEND] if "err / native" in last else [CELL_LEGEND]
    table = Table(caption="\n".join(legend), caption_justify="left")
    for col in first:
        table.add_column(col)
    for col in last[:-1]:
        table.add_column(col, justify="right")
    table.add_column(last[-1])
    for row in rows:
        style = "red" if "FAIL" in row[-1] else ("dim" if row[-1].startswith("skip") else "")
        table.add_row(*row, style=style)
    return table


ERRORS = ("max abs err", "err / bound", "err / native", "result")


def _errors(r: Result) -> tuple[str, ...]:
    return _fmt(r.max_abs), _fmt(r.of_bound, True), _fmt(r.vs_native, True), r.status


def _config_rows(results: list[Result]) -> list[tuple[str, ...]]:
    """One row per (backend, gradient); one row for a backend that refused the whole configuration."""
    rows = []
    for name in _backends(results):
        mine = [r for r in results if r.backend == name]
        if len({r.status for r in mine}) == 1 and mine[0].status.startswith("skip"):
            rows.append((name, "all", "-", "-", "-", mine[0].status))
        else:
            rows += [(name, r.gradient, *_errors(r)) for r in mine]
    return rows


def _worst(results: list[Result], backend: str) -> str:
    """One backend's cell in a summary row: the largest err / bound of its gradients, or why it was skipped."""
    mine = [r for r in results if r.backend == backend]
    judged = [r.of_bound for r in mine if not r.status.startswith("skip")]
    return _fmt(max(judged), True) if judged else ("skip" if mine else "")


def _layer_rows(layer: LayerCheck, names: list[str]) -> list[tuple[str, ...]]:
    """One row per gradient of a conv call, a cell per backend; the layer and its module on the first row only."""
    rows = []
    for g in GRADIENTS:
        mine = [r for r in layer.results if r.gradient == g]
        if mine:
            where = ("", "") if rows else (layer.name, layer.module)
            rows.append((*where, g, *(_worst(mine, b) for b in names), _verdict(mine)))
    return rows


def _verdict(results: list[Result]) -> str:
    failed = [f"{r.backend} {r.gradient}" for r in results if r.failed]
    return "FAIL: " + ", ".join(failed) if failed else "pass"


def _backends(results: list[Result]) -> list[str]:
    return list(dict.fromkeys(r.backend for r in results))


def _run_config(console: Any, args: argparse.Namespace, dtype: torch.dtype) -> list[Result]:
    if args.weight is None:
        raise ConvgradValueError("check: --input needs --weight, e.g. --input 2,4,9,9 --weight 6,2,3,3")
    for name in args.backend or ():  # a misspelt name first: how --input was read explains shape errors only
        get_backend(name, "check")
    with shapes_as_typed(_as_tuple(args.input), _as_tuple(args.weight), fn="check"):
        spec, results = check_config(_as_tuple(args.input), _as_tuple(args.weight), args.stride,
                                     _pairs(args.padding, len(_as_tuple(args.weight)) - 2), args.dilation,
                                     args.transposed, args.output_padding, args.groups, dtype, args.device,
                                     args.backend, args.seed)
    console.print(f"{spec.describe()}, {args.dtype}")
    console.print(_table(("backend", "gradient"), _config_rows(results), ERRORS))
    return results


def _run_random(console: Any, args: argparse.Namespace, dtype: torch.dtype) -> list[Result]:
    with _progress(console, f"checking {args.random} random configurations") as update:
        checked = check_random(args.random, args.seed, dtype, args.device, args.backend,
                               progress=lambda i: update(i, args.random))
    console.print(f"{len(checked)} random configurations (seed {args.seed}), {args.dtype}")
    if args.verbose:
        rows = [(str(i), spec.describe(), r.backend, r.gradient, *_errors(r))
                for i, (spec, results) in enumerate(checked) for r in results]
        console.print(_table(("#", "configuration", "backend", "gradient"), rows, ERRORS))
    else:
        names = _backends(checked[0][1])
        rows = [(str(i), spec.describe(), *(_worst(results, b) for b in names), _verdict(results))
                for i, (spec, results) in enumerate(checked)]
        console.print(_table(("#", "configuration"), rows, (*names, "result")))
    failed = [r for _, results in checked for r in results if r.failed]
    compared = sum(1 for _, results in checked for r in results if not r.status.startswith("skip"))
    console.print(f"{len(checked)} random configurations (seed {args.seed}), {compared} gradients compared, "
                  f"{len(failed)} failed")
    return [r for _, results in checked for r in results]


def _run_model(console: Any, args: argparse.Namespace, dtype: torch.dtype) -> list[Result]:
    if args.input_shape is None:
        raise ConvgradValueError("check: --model needs --input-shape, e.g. --input-shape 8,3,32,32")
    with _progress(console, f"checking the convolutions of {args.model}") as update:
        layers = check_model(args.model, _as_tuple(args.input_shape), args.backend, dtype, args.device, args.seed,
                             progress=update)
    console.print(f"{args.model}, input {_as_tuple(args.input_shape)}, {args.dtype}: every conv on the tensors it sees")
    if args.verbose:
        rows = [(layer.name, layer.module, r.backend, r.gradient, *_errors(r)) for layer in layers
                for r in layer.results]
        console.print(_table(("layer", "module", "backend", "gradient"), rows, ERRORS))
    else:
        names = _backends(layers[0].results)
        rows = [row for layer in layers for row in _layer_rows(layer, names)]
        console.print(_table(("layer", "module", "gradient"), rows, (*names, "result")))
    return [r for layer in layers for r in layer.results]


def run(args: argparse.Namespace) -> int:
    """Run the chosen check, print its table, return 1 when any gradient is out of its bound, or when every
    backend was skipped (nothing was compared, so nothing was verified)."""
    console = _console()
    if args.dtype not in DTYPES:
        raise ConvgradValueError(f"check: --dtype={args.dtype!r} must be one of {', '.join(DTYPES)}")
    dtype = DTYPES[args.dtype]
    if args.model is not None:
        results = _run_model(console, args, dtype)
    elif args.random is not None:
        results = _run_random(console, args, dtype)
    else:
        results = _run_config(console, args, dtype)
    failed = [r for r in results if r.failed]
    if not failed and all(r.status.startswith("skip") for r in results):
        console.print("[red]no gradient compared: every backend was skipped (see why in the table)[/red]")
        return 1
    console.print(f"[red]{len(failed)} gradient(s) out of their error bound[/red]" if failed
                  else "[green]every gradient within its error bound[/green]")
    return 1 if failed else 0
