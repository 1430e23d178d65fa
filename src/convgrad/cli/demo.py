"""`convgrad demo`: train a small CNN on real handwritten digits with convgrad's backward, twin-checked.

The network (``DigitsNet``) is built from ``convgrad.nn`` modules, so every
conv's backward runs through the chosen backend (default ``fwdconv``: forward
convolutions only). A twin built from plain ``torch.nn`` modules receives the
network's current weights and the same batch at every step, so the gradients of
each conv layer are compared at identical weights: the largest norm-wise relative
difference ``||g - g_ref|| / ||g_ref||`` over all steps, of the weight gradient and of the
whole layer's (weight and bias), must stay below 1e-4 (float32).

The training loop lives in ``convgrad.cli._demo_train``; this module is the command:
arguments, progress bar, report, plot and JSON summary.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from convgrad.cli import console as cli_console
from convgrad.cli import demo_extras_missing
from convgrad.errors import ConvgradValueError

THRESHOLD = 1e-4  # float32: ~1e-7 per op, summed over a few thousand terms per gradient entry

__all__ = ["THRESHOLD", "add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (all have defaults)."""
    parser.add_argument("--backend", default="fwdconv", help="backend of every conv's backward (default: fwdconv)")
    parser.add_argument("--epochs", type=int, default=10, help="passes over the 1,437 training images (default: 10)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the init and the batches")
    parser.add_argument("--out", type=Path, default=Path("convgrad-demo"),
                        help="folder for training.png and summary.json (default: ./convgrad-demo)")
    parser.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: all epochs)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads; these layers are too small to gain from more (default: 1)")


def run(args: argparse.Namespace) -> int:
    """Train, compare, report; 0 if every layer's gradients agree within THRESHOLD, else 1."""
    if demo_extras_missing("demo", "rich.console"):
        return 2
    import torch

    from convgrad.backends import get_backend
    from convgrad.cli._demo_train import train

    get_backend(args.backend, "convgrad demo")
    for name in ("epochs", "threads"):
        if getattr(args, name) < 1:
            raise ConvgradValueError(f"convgrad demo: --{name}={getattr(args, name)} must be positive")
    if args.steps is not None and args.steps < 1:
        raise ConvgradValueError(f"convgrad demo: --steps={args.steps} must be positive")
    if args.out.exists() and not args.out.is_dir():
        raise ConvgradValueError(
            f"convgrad demo: --out={args.out} is an existing file, not a folder; --out names the folder "
            f"that gets training.png and summary.json (give a new or existing folder)")
    args.out.mkdir(parents=True, exist_ok=True)  # an unwritable --out fails now, not after the training
    console = cli_console()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        start = time.perf_counter()
        result = train(args.backend, args.epochs, args.seed, args.steps, console)
        result["wall_seconds"] = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    summary = _summary(args, result)
    _print_report(console, summary)
    _plot(result, args.out / "training.png")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.out / 'training.png'} and {args.out / 'summary.json'}")
    return 0 if summary["passed"] else 1


def _summary(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    import torch

    layers = {
        name: {**layer, "max_rel_diff": max(result["diffs"][name]), "passed": max(result["diffs"][name]) <= THRESHOLD}
        for name, layer in result["layers"].items()
    }
    return {
        # what ran, not what was asked: --steps may stop the training inside its first epoch
        "backend": args.backend, "epochs": round(result["steps"] / result["steps_per_epoch"], 3),
        "epochs_requested": args.epochs, "steps": result["steps"], "steps_requested": args.steps,
        "steps_per_epoch": result["steps_per_epoch"], "seed": args.seed,
        "threads": args.threads, "torch": torch.__version__, "dtype": "float32", "threshold": THRESHOLD,
        "train_images": result["train_images"], "test_images": result["test_images"],
        "final_loss": result["losses"][-1], "test_accuracy": result["accuracy"],
        "wall_seconds": round(result["wall_seconds"], 2), "layers": layers,
        "max_rel_diff": max(v["max_rel_diff"] for v in layers.values()),
        "passed": all(v["passed"] for v in layers.values()),
    }


def _print_report(console: Any, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"convgrad ({summary['backend']}) vs torch autograd: max over {summary['steps']} steps of "
                        f"||g - g_ref|| / ||g_ref|| (weight; weight + bias), float32",
                  caption=f"r: trailing input rows the forward never reads; red: > {THRESHOLD:g}")
    table.add_column("layer")
    table.add_column("configuration", no_wrap=True)
    table.add_column("exercises")
    table.add_column("max rel. diff", justify="right")
    for name, layer in summary["layers"].items():
        color = "green" if layer["passed"] else "red"
        table.add_row(name, layer["config"], layer["exercises"], f"[{color}]{layer['max_rel_diff']:.2e}[/{color}]")
    console.print(table)
    console.print(f"final loss {summary['final_loss']:.4f}   held-out accuracy {summary['test_accuracy']:.2%} "
                  f"({summary['test_images']} images)   {summary['wall_seconds']:.1f} s")
    if summary["passed"]:
        console.print(f"[green]agreement: every layer within {THRESHOLD:g} of torch autograd[/green]")
    else:
        console.print(f"[red]MISMATCH: max difference {summary['max_rel_diff']:.2e} > {THRESHOLD:g}[/red]")


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_diff) = plt.subplots(1, 2, figsize=(13, 4.5))
    steps = range(1, len(result["losses"]) + 1)
    ax_loss.plot(steps, result["losses"])
    ax_loss.set(xlabel="step", ylabel="training loss (cross-entropy + reconstruction)", yscale="log",
                title=f"loss; held-out accuracy {result['accuracy']:.1%}")
    tiny = 1e-12  # a difference of exactly 0 still needs a place on the log axis
    for name, diffs in result["diffs"].items():
        ax_diff.plot(steps, [max(d, tiny) for d in diffs], label=name, lw=1)
    ax_diff.axhline(THRESHOLD, color="red", ls="--", label=f"threshold {THRESHOLD:g}")
    ax_diff.set(xlabel="step", ylabel="||g - g_ref|| / ||g_ref||", yscale="log",
                title="per-layer gradient difference vs torch autograd")
    ax_diff.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
