"""The fwdconv plan: the protocols every step follows, the Plan that lists the steps, and ``execute``.

A plan is data: a short list of frozen steps that depends on shapes only. ``execute`` runs it on tensors;
``convgrad.explain`` renders the very same objects, so what is explained is what runs. Every step (steps.py,
and the format-specific ones of grad_input.py and grad_weight.py) and every contraction (contractions.py)
carries all its views itself: calling it computes, ``describe()`` says it in a sentence, ``label()`` in the
short phrase a picture's subtitle shows, ``code()`` writes it as script lines, and ``rows``/``reads`` tell
where it moves the rows of one spatial dim (geometry.py). A new kind of step needs no change elsewhere.

A step that is a chain of tensor operations (``Chain``) lists them as data, ``ops(shape)``: a ``TensorOp`` each
(a Tensor method, or ``pad``, ``index``, ``windows``, with its arguments and the shape comment of its line); calling
the step runs that list (``run_ops``) and ``code()`` writes the same list (``ops_code``), so the two cannot drift.
The helpers at the end write the script text that ``code()`` methods share.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import torch

from convgrad.backends.fwdconv import geometry as geo
from convgrad.spec import ConvSpec, Pair, Shape, pad_then_crop
from convgrad.tensor_ops import pad, pad_flat, sliced, windows

__all__ = ["Chain", "Contraction", "Plan", "Spatially", "Step", "TensorOp", "commas", "execute", "index_text",
           "ops_code", "pad_code", "run_ops"]



class Step(Protocol):
    """One plain tensor operation of a plan, applied to one tensor (the data, the kernel or the result)."""

    @property
    def shape(self) -> Shape: ...  # the tensor's shape after this step (read-only: steps are frozen)

    def __call__(self, t: torch.Tensor, /) -> torch.Tensor: ...

    def describe(self) -> str:
        """What the step does, in one line of prose (the recipe's text)."""
        ...

    def label(self) -> str:
        """The short phrase a picture shows for it; empty when it moves channels or samples only (no rows)."""
        ...

    def code(self, v: str, shape: Shape) -> list[str]:
        """Script lines that apply the step to the variable ``v``, whose shape before it is ``shape``."""
        ...

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Where the rows of one spatial dim go (geometry.py)."""
        ...


class Contraction(Protocol):
    """The one multiply-accumulate of a plan: called with (data, kernel)."""

    @property
    def shape(self) -> Shape: ...  # read-only: contractions are frozen

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor, /) -> torch.Tensor: ...

    def describe(self) -> str: ...

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        """Script lines that compute ``out`` from the variables ``data`` and ``kernel``."""
        ...

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Along one spatial dim: the (data, kernel) products summed into each result row (geometry.py)."""
        ...


class Spatially:
    """A step that moves channels or samples only: every spatial row stays where it is, and pictures skip it."""

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        return axis

    def label(self) -> str:
        return ""


@dataclass(frozen=True)
class Plan:
    """The steps that compute one gradient: data path, kernel path, one contraction, then post steps.

    ``conv`` is None when the gradient is an empty sum (batch 0): the result is zeros. ``method`` names the
    formulation and ``reason`` says why the plan builder chose it.
    """

    gradient: str
    spec: ConvSpec
    data: str
    kernel: str
    data_steps: tuple[Step, ...]
    kernel_steps: tuple[Step, ...]
    conv: Contraction | None
    post_steps: tuple[Step, ...]
    shape: Shape
    method: str = "direct"
    reason: str = ""


def execute(plan: Plan, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    """Run a plan on tensors; every op is differentiable."""
    if plan.conv is None:
        return data.new_zeros(plan.shape)
    for step in plan.data_steps:
        data = step(data)
    for step in plan.kernel_steps:
        kernel = step(kernel)
    out = plan.conv(data, kernel)
    for step in plan.post_steps:
        out = step(out)
    return out


# ---- steps as chains of tensor operations: one list, run and written -----------------------------------------------

class TensorOp(NamedTuple):
    """One tensor operation of a step: ``name`` is a Tensor method (reshape, permute, transpose, movedim, flip, sum)
    or one of ``pad`` (``tensor_ops.pad``: a negative amount crops), ``index`` (slices of the trailing dims,
    ``tensor_ops.sliced``) and ``windows`` (``tensor_ops.windows``: im2col as a view); ``args`` its arguments after
    the tensor; ``note`` the shape comment of its line of code."""

    name: str
    args: tuple[Any, ...]
    note: str = ""


# the operations that are functions of the tensor, not its methods
_FUNCTIONS: dict[str, Callable[..., torch.Tensor]] = {"pad": pad, "index": sliced, "windows": windows}


def run_ops(ops: Sequence[TensorOp], t: torch.Tensor) -> torch.Tensor:
    """Apply the operations in order (a method call each: no Python frame of its own)."""
    for name, args, _ in ops:
        function = _FUNCTIONS.get(name)
        t = function(t, *args) if function is not None else getattr(t, name)(*args)
    return t


def index_text(index: Sequence[slice]) -> str:
    """Slices as written in an index, ``start:stop:step`` each with the defaults left out."""
    def one(s: slice) -> str:
        step = "" if s.step in (None, 1) else f":{s.step}"
        return f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}{step}"

    return ", ".join(one(s) for s in index)


def ops_code(ops: Sequence[TensorOp], v: str) -> list[str]:
    """The operations as script lines that update the variable ``v``: torch calls only (F.pad, slices, unfold)."""
    lines = []
    for name, args, note in ops:
        comment = f"  # {note}" if note else ""
        if name == "pad":
            lines += pad_code(v, v, args[0], note)
        elif name == "index":
            lines.append(f"{v} = {v}[..., {index_text(args[0])}]{comment}")
        elif name == "windows":  # tensor_ops.windows: unfold every dim, then every d-th row of each window
            kernel, stride, dilation = args
            lines += [f"{v} = {v}.unfold({2 + j}, {d * (k - 1) + 1}, {s})  # windows of dim {j}"
                      for j, (k, s, d) in enumerate(zip(kernel, stride, dilation))]
            lines.append(f"{v} = {v}[..., {', '.join(f'::{d}' for d in dilation)}]{comment}")
        else:
            given = ", ".join(commas(a) if isinstance(a, tuple) else repr(a) for a in args)
            lines.append(f"{v} = {v}.{name}({given}){comment}")
    return lines


class Chain:
    """A step that is a chain of tensor operations, listed by ``ops(shape)`` for an input of that shape: calling it
    runs the list, ``code()`` writes it."""

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        raise NotImplementedError(f"{type(self).__name__}.ops")

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        # the list for the last input shape is kept on the step (a plan runs on one shape): building it costs more
        # than running it on a small layer. Not while torch.compile traces: its plans are built afresh per trace
        shape = t.shape
        kept = self.__dict__.get("_ops")
        if kept is not None and kept[0] == shape:
            return run_ops(kept[1], t)
        ops = self.ops(tuple(shape))
        if not torch.compiler.is_compiling():
            self.__dict__["_ops"] = (shape, ops)  # not a field: equality, hash and replace() ignore it
        return run_ops(ops, t)

    def code(self, v: str, shape: Shape) -> list[str]:
        return ops_code(self.ops(shape), v)


# ---- script text shared by the code() methods ---------------------------------------------------------------------

def commas(values: object) -> str:
    """Integers as a comma-separated argument list: ``(2, 3)`` -> ``"2, 3"``."""
    return ", ".join(str(v) for v in values)  # type: ignore[attr-defined]


def pad_code(out: str, src: str, pads: tuple[Pair, ...], note: str) -> list[str]:
    """The script lines of ``tensor_ops.pad``: F.pad, but a crop (negative amount) after the pads, as a slice.

    F.pad crops before it pads, so a crop that only the other side's padding makes room for fails there
    ("narrow(): length must be non-negative"); a slice past the end is merely empty, as the crop is.
    """
    amounts = pad_flat(pads)
    if all(v >= 0 for v in amounts):
        return [f"{out} = F.pad({src}, {amounts})  # pads {tuple(pads)}: {note}"]
    grow, cut = pad_then_crop(pads)
    lines = [f"{out} = F.pad({src}, {pad_flat(grow)})  # pads {grow}, then the crops"] if any(map(any, grow)) else []
    crop = ", ".join(f"{lo or ''}:{-hi if hi else ''}" for lo, hi in cut)
    return [*lines, f"{out} = {out if lines else src}[..., {crop}]  # crops {tuple(pads)}: {note}"]
