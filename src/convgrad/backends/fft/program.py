"""The fft backend's plan as data: the step, the loop, the plan, and the views of them (text, code).

A plan is its kind (``plans.KINDS``: which side is computed from which), the polyphase split of every dim
(``sizing.phases``), its chunks (groups, samples, and the kernel rows of one group a dense layer's spectra are split
into) as loops, and a list of steps. A step is one operation of ``ops`` with the registers it reads and writes, its
keyword arguments, the shape it declares, and its depth (the loops it runs in). ``execute.run`` interprets the list,
the step's ``describe()`` and ``code()`` say and write the same operation and arguments, and ``explain`` shows them:
what is explained is what runs.

Registers: the inputs (``x``, ``y``, ``w``), ``real`` (whether the data is real), and the loops' ranges ``g``, ``n``,
``r`` (each ``(start, stop)``; outside its loop the whole range). A register dies after its last reader (``drops``),
or after the loop that holds that reader: a chunk's spectra never outlive their term into the next chunk's transforms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from convgrad.backends.fft.ops import OPS
from convgrad.backends.fft.sizing import FftDim
from convgrad.spec import ConvSpec, Pair, pad_to_rows

__all__ = ["FftPlan", "FftStep", "Loop"]

Shape = tuple[int, ...]
Range = tuple[int, int]


@dataclass(frozen=True)
class FftStep:
    """One step of an fft plan: ``writes = ops.<op>(*reads, **args)``, inside the plan's first ``depth`` loops.

    ``name`` is what the step is in a word (taps, result, start, transform, product, sum, inverse, phases, write,
    collect, conj, reverse), ``shape`` the shape it declares for what it writes (of the first chunk, for real data).
    """

    name: str
    op: str
    reads: tuple[str, ...]
    writes: str
    args: tuple[tuple[str, Any], ...]
    shape: Shape
    depth: int = 0

    @property
    def kwargs(self) -> dict[str, Any]:
        return dict(self.args)

    def describe(self) -> str:
        """What the step does, from its operation's sentence and arguments: ``name: sentence -> shape``."""
        return f"{self.name}: {OPS[self.op].say(**self.kwargs)} -> {self.shape}"

    def code(self, names: dict[Any, str] | None = None) -> list[str]:
        """The step as a line of Python: the same call ``execute.run`` makes (``names``: values written as a name)."""
        names = names or {}
        args = [*self.reads, *(f"{k}={names.get(v, repr(v))}" for k, v in self.args)]
        return [f"{self.writes} = ops.{self.op}({', '.join(args)})  # {self.shape}"]


@dataclass(frozen=True)
class Loop:
    """The chunks of one dim of the work: ``var`` takes each of ``ranges`` in turn (``whole`` outside the loop)."""

    name: str  # groups, samples or kernel rows
    var: str  # g, n or r
    whole: Range
    ranges: tuple[Range, ...]


@dataclass(frozen=True)
class FftPlan:
    """The plan of one result (``gradient``: grad_input, grad_weight or output), or of both gradients in one pass
    (``backward``, ``parts`` the two plans it runs), by the convolution theorem."""

    gradient: str
    spec: ConvSpec
    kind: str  # one of plans.KINDS, or of plans.FUSED_KINDS
    dims: tuple[FftDim, ...]
    chunks: tuple[int, int]  # (groups, samples) per chunk
    steps: tuple[FftStep, ...]
    phase_count: int  # P, the live phases: sizing.phase_count, held because the steps read it per chunk
    method: str = "fft"
    rows: int = 0  # kernel rows (y channels of one group) whose spectra are held at once; 0: all of them
    loops: tuple[Loop, ...] = ()  # loops[d] is entered from depth d: its steps have depth > d
    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ("out",)
    parts: tuple[FftPlan, ...] = ()
    # the registers each step frees after it, and each loop (by its first step and depth) after its last chunk:
    # derived from the steps (``_liveness``), so a plan changed with ``dataclasses.replace`` frees what it reads
    drops: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)
    loop_drops: dict[tuple[int, int], tuple[str, ...]] = field(init=False, repr=False, compare=False)
    loop_ends: dict[tuple[int, int], int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        drops, loop_drops, ends = _liveness(self)
        object.__setattr__(self, "drops", drops)  # frozen: as dataclasses' own __init__ sets fields
        object.__setattr__(self, "loop_drops", loop_drops)
        object.__setattr__(self, "loop_ends", ends)

    @property
    def whole(self) -> dict[str, Range]:
        """The ranges ``g``, ``n`` and ``r`` take outside their loops: all the groups, samples, kernel rows."""
        return {"g": (0, self.spec.groups), "n": (0, self.spec.batch), "r": (0, self.spec.y_group_channels)}

    @property
    def row_chunk(self) -> int:
        """The kernel rows per chunk: ``rows``, or all C_y/g when 0. Fewer than all only with one group per chunk."""
        return self.rows or self.spec.y_group_channels

    @property
    def sizes(self) -> Shape:
        return tuple(d.size for d in self.dims)

    def bins(self, real: bool) -> Shape:
        """The frequency bins of a transform of ``sizes``: the last dim halved (+1) for real data (rfftn)."""
        return (*self.sizes[:-1], self.sizes[-1] // 2 + 1) if real else self.sizes

    @property
    def phase_zeros(self) -> tuple[Pair, ...]:
        """Per dim the zero rows (c, e) around each phase's data rows in its L rows (``FftDim.phase_pads``): the pads
        of the phases' transform, and the cuts of x's inverse before the phases are interleaved. A plain property:
        Dynamo cannot trace the lock of a ``functools.cached_property`` (the fft backward under torch.compile)."""
        return tuple(d.phase_pads(s)[1] for d, s in zip(self.dims, self.spec.stride))

    def cuts_to(self, rows: Shape) -> tuple[Pair, ...]:
        """The rows (0, L - r) cut off each dim's L rows to keep its first ``rows``: the inverse's cuts."""
        return tuple(pad_to_rows((0, 0), r, n) for r, n in zip(rows, self.sizes))

    @property
    def group_channels(self) -> tuple[int, int, int]:
        """(A, B0, B): y channels per group, x channels per group, and x channels per group times the live phases."""
        b0 = self.spec.x_group_channels
        return self.spec.y_group_channels, b0, b0 * self.phase_count

    def lines(self) -> list[tuple[int | None, int, str]]:
        """The plan as text, one (step number or None for a loop's head, depth, text) per line, in order."""
        out: list[tuple[int | None, int, str]] = []
        depth = 0
        for j, step in enumerate(self.steps, 1):
            while depth < step.depth:
                loop = self.loops[depth]
                size = loop.ranges[0][1] - loop.ranges[0][0] if loop.ranges else 0
                count = len(loop.ranges)
                out.append((None, depth, f"for each chunk {loop.var} of the {loop.whole[1]} {loop.name} "
                                         f"({count} chunk{'' if count == 1 else 's'} of {size}):"))
                depth += 1
            depth = step.depth
            out.append((j, depth, step.describe()))
        return out

    def describe(self) -> str:
        return "\n".join(f"{'' if j is None else f'{j}. '}{'  ' * d}{text}" for j, d, text in self.lines())

    def code(self) -> list[str]:
        """A runnable script of the plan, chunks and all: the calls ``execute.run`` makes, the loops it runs them in
        and the registers it frees. It reads the inputs (``x`` and ``w``, ``y`` and ``w``, or ``x`` and ``y``) and
        ``real``, and leaves the outputs (``out``; ``grad_input`` and ``grad_weight`` for a fused plan)."""
        names = {self.dims: "dims"}
        lines = ["from convgrad.backends.fft import ops", "from convgrad.backends.fft.sizing import FftDim",
                 f"dims = {self.dims!r}", "g, n, r = {g}, {n}, {r}  # all the groups, samples, kernel rows".format(
                     **self.whole)]
        opened: list[int] = []  # the first step of each loop the steps are in
        for j, step in enumerate((*self.steps, None)):
            depth = 0 if step is None else step.depth
            while len(opened) > depth:  # the loops that end here: what they free, their range whole again
                d = len(opened) - 1
                loop = self.loops[d]
                lines += [*_freed(self.loop_drops.get((opened.pop(), d), ()), d),
                          f"{'    ' * d}{loop.var} = {loop.whole}"]
            while len(opened) < depth:
                loop = self.loops[len(opened)]
                lines.append(f"{'    ' * len(opened)}for {loop.var} in {loop.ranges}:  # the {loop.name}, chunk by "
                             "chunk")
                opened.append(j)
            if step is not None:
                lines += [f"{'    ' * depth}{line}" for line in [*step.code(names), *_freed(self.drops[j], 0)]]
        return lines


def _freed(names: tuple[str, ...], depth: int) -> list[str]:
    return [f"{'    ' * depth}del {', '.join(names)}"] if names else []


def _liveness(p: FftPlan) -> tuple[tuple[tuple[str, ...], ...], dict[tuple[int, int], tuple[str, ...]],
                                   dict[tuple[int, int], int]]:
    """What each step frees after it, what each loop frees after its last chunk, and where each loop ends.

    A register's scope is the shallowest depth that reads or writes it; it dies after its last reader when that
    reader runs at the scope's depth, else after the loop (entered at that depth) that holds the reader. The inputs,
    the outputs, ``real`` and the loops' ranges live throughout. Loops are keyed by (first step, depth entered from).
    """
    steps = p.steps
    ends: dict[tuple[int, int], int] = {}
    for i, step in enumerate(steps):
        for d in range(steps[i - 1].depth if i else 0, step.depth):  # the loops that begin at step i
            ends[(i, d)] = next((j for j in range(i + 1, len(steps)) if steps[j].depth <= d), len(steps))
    keep = {*p.inputs, *p.outputs, "real", "g", "n", "r"}
    drops: list[list[str]] = [[] for _ in steps]
    loop_drops: dict[tuple[int, int], list[str]] = {}
    registers = dict.fromkeys(r for s in steps for r in (*s.reads, s.writes) if r not in keep)
    for name in registers:  # plain loops: Dynamo traces this where torch.compile builds a plan (no max(default=))
        scope, last = len(p.loops), -1
        for i, s in enumerate(steps):
            if name in s.reads or s.writes == name:
                scope = min(scope, s.depth)
            if name in s.reads:
                last = i
        if last < 0:
            continue
        if steps[last].depth == scope:
            drops[last].append(name)
        else:  # the loop entered at the scope's depth that holds the last reader: from its first step
            start = last
            while start > 0 and steps[start - 1].depth > scope:
                start -= 1
            loop_drops.setdefault((start, scope), []).append(name)
    return (tuple(tuple(d) for d in drops), {k: tuple(v) for k, v in loop_drops.items()}, ends)
