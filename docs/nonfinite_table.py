"""The table of docs/numerics.md: extra non-finite gradient entries per backend over the test grid.

Run from the repository root::

    PYTHONPATH=src CONVGRAD_AUTOTUNE=fixed python docs/nonfinite_table.py

For each poisoned operand, one value in the middle of the tensor is set to NaN or Inf. The entries
of the gradient that read it (autograd on a one-hot operand with all-ones partners) must all be
non-finite (asserted); the table counts the non-finite entries outside that set.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

import convgrad as cg
from convgrad.backends.fwdconv import execute, plan_input_grad

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import Case, grid_cases, make_tensors, reference_grads

POISON = [("input", float("nan"), "grad_weight"), ("weight", float("inf"), "grad_input"),
          ("grad_output", float("nan"), "grad_input"), ("grad_output", float("inf"), "grad_weight")]
ZERO_INSERT = "fwdconv zero_insert"


def depends(case: Case, t: dict[str, torch.Tensor], source: str, pos: int, gradient: str) -> torch.Tensor:
    ones = {k: torch.ones_like(v) for k, v in t.items()}
    ones[source] = torch.zeros_like(t[source])
    ones[source].view(-1)[pos] = 1
    return reference_grads(case, ones)[gradient] != 0


def gradient_of(case: Case, t: dict[str, torch.Tensor], column: str, gradient: str) -> torch.Tensor | None:
    if column == ZERO_INSERT:  # fwdconv's grad_input forced to zero insertion
        spec = case.spec()
        if gradient != "grad_input" or spec.transposed or spec.unbatched:
            return None
        return execute(plan_input_grad(spec, "zero_insert"), t["grad_output"], t["weight"])
    grads = cg.conv_backward(t["grad_output"], t["input"], t["weight"], None, transposed=case.transposed,
                             backend=column, **{**case.kwargs(), "output_padding": case.output_padding})
    return grads[0] if gradient == "grad_input" else grads[1]


def row(source: str, value: float, gradient: str, dtype: torch.dtype, columns: list[str]) -> str:
    extra, total = dict.fromkeys(columns, 0), 0
    for case in grid_cases():
        t = make_tensors(case, dtype)
        if t[source].numel() == 0:
            continue
        pos = t[source].numel() // 2
        poisoned = dict(t, **{source: t[source].clone()})
        poisoned[source].view(-1)[pos] = value
        must = depends(case, t, source, pos, gradient)
        total += must.numel()
        for column in columns:
            g = gradient_of(case, poisoned, column, gradient)
            if g is None:
                continue
            bad = ~torch.isfinite(g)
            assert not (must & ~bad).any(), f"{column} {case}: a {value} in {source} vanished"
            extra[column] += int((bad & ~must).sum())
    cells = " | ".join(str(extra[c]) for c in columns)
    return f"| {source} = {value} | {gradient} | {str(dtype).removeprefix('torch.')} | {cells} | {total} |"


def main() -> None:
    warnings.filterwarnings("ignore", "invalid value encountered")  # numpy's 0 * Inf
    columns = [*cg.backends(), ZERO_INSERT]
    print("| poisoned | gradient | dtype | " + " | ".join(columns) + " | entries |")
    print("|" + "---|" * (len(columns) + 4))
    for source, value, gradient in POISON:
        for dtype in (torch.float64, torch.float32):
            print(row(source, value, gradient, dtype, columns))


if __name__ == "__main__":
    main()
