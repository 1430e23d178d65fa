"""What `convgrad bench --model` prints: the machine, the step, plain against patched, and what each conv call runs.

The per-call table is ``convgrad.report(patched, x)``'s rows (``ModelBench.calls``), drawn by rich so that its long
cells (the layer, the reason) wrap within the console's width instead of running off it.
"""

from __future__ import annotations

from typing import Any

from convgrad.cli.bench.model import ModelBench, step_time

__all__ = ["show"]

SPEEDUP_LEGEND = "plain's time ÷ patched's in the same round, median ± IQR over rounds; above 1: patched is faster"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def _header(r: ModelBench) -> str:
    m = r.machine
    step = "forward, mean-square loss, backward" + (f", {r.optimizer} step" if r.optimizer != "none" else "")
    return (f"{r.model}, input {r.input_shape}, {r.dtype}\n"
            f"{m['device_model']} ({m['device']}), {_plural(m['cores'], 'core')}, {_plural(m['threads'], 'thread')}, "
            f"torch {m['torch']}, auto mode {r.settings['auto_mode']}\n"
            f"training step: {step}; plain against convgrad.patch(copy, {r.backend!r})")


def _summary(r: ModelBench) -> Any:
    from rich.table import Table

    table = Table("", "plain", f"patched ({r.backend})")
    table.add_row("step, median ± IQR", *(f"{step_time(s.median)} ± {step_time(s.iqr)}" for s in (r.plain, r.patched)))
    table.add_row("first step", step_time(r.plain.first), step_time(r.patched.first))
    table.add_row("peak memory of a step", *(f"{s.peak_bytes / 2**20:.1f} MiB" for s in (r.plain, r.patched)))
    return table


def _verdict(r: ModelBench) -> str:
    if not r.settled:
        dropped = (f"; auto kept changing its choices ({r.dropped} rounds dropped): these figures include the "
                   "candidates it was still comparing")
    else:
        dropped = f"; {r.dropped} rounds dropped, in which auto changed a choice" if r.dropped else ""
    why = (f": auto times its candidates for each distinct layer on its first call; then "
           f"{_plural(r.settings['warmup'], 'patched step')} before the rounds, in which it compares the candidates "
           "that survived" if r.backend == "auto" else f" (backend {r.backend!r}: nothing to tune)")
    return (f"speed-up of the step: {r.speedup:.2f} ± {r.speedup_iqr:.2f} ({SPEEDUP_LEGEND}; "
            f"{_plural(len(r.speedups), 'round')}{dropped})\n"
            f"first-step cost: the patched model's first step took {step_time(r.patched.first)}, "
            f"{r.first_step_cost:.1f} plain steps{why}")


def _calls(r: ModelBench) -> Any:
    from rich.table import Table

    reached = sum(c.backend != "torch" for c in r.calls)
    table = Table("conv call", "layer", "forward", "gradients", "why",
                  title="what each conv call runs after those steps: convgrad.report(patched, x)",
                  caption=f"{reached} of {len(r.calls)} conv calls reached by convgrad", caption_justify="left")
    for c in r.calls:
        table.add_row(f"{c.module or '(model)'}\n{c.call}", c.summary, c.forward, c.gradients, c.why)
    return table


def show(console: Any, result: ModelBench) -> None:
    """Print ``result`` on a rich console: a header with the machine, the plain-against-patched table, the speed-up
    and the first-step cost, then what each conv call runs and why."""
    console.print(_header(result), soft_wrap=False, highlight=False)
    console.print(_summary(result))
    console.print(_verdict(result), highlight=False)
    console.print()
    console.print(_calls(result))
