"""The frames of explain's pictures: for every cell a plan produces, the products it sums there.

A ``Scene`` is one computation (the forward pass, grad_input or grad_weight) seen through the plan that
computes it. Its geometry is read from the plan's own steps, one spatial dim at a time (each step's
``rows`` / ``reads``, backends/fwdconv/geometry.py): what is drawn is what runs. The N-d products of a
result cell are the products of its per-dim ones. Channels pair up by the groups of the spec: result
channel c of group G sums the data channels of group G, with the kernel's (out, in) channel pair.

A ``Frame`` is one result cell: its products (data cell x kernel cell, per dim), the channel pairs they
run over, its polyphase phase, and the data and kernel rows the contraction read for it. The renderers
(picture.py, animation.py) draw frames and nothing else, and tests/test_explain_frames.py compares the
frames with the Jacobian torch.autograd computes.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from convgrad.backends import fwdconv
from convgrad.backends.fwdconv.geometry import Axis, Cell, Family, Out, operand, union_axis
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec, Shape

__all__ = ["GRADIENTS", "Frame", "Scene", "SceneOf", "plan_of", "scene"]

GRADIENTS = ("forward", "grad_input", "grad_weight")
Index = tuple[int, ...]


@dataclass(frozen=True)
class Frame:
    """One result cell of a scene and everything summed into it.

    Attributes:
        gradient: ``"forward"``, ``"grad_input"`` or ``"grad_weight"``.
        channel: the result's channel: ``(c,)``, or ``(c_out, c_in/g)`` for grad_weight (a weight entry).
        cell: the result cell, one index per spatial dim.
        phase: the polyphase phase rho that computes the cell, or None.
        links: the spatial products: per product, the data cell and the kernel cell of every dim.
        channels: the (data channel, kernel channel index) pairs each spatial product runs over.
        views: per dim, the data and kernel rows the contraction read for this cell.
    """

    gradient: str
    channel: Index
    cell: Index
    phase: Index | None
    links: tuple[tuple[tuple[Cell, ...], tuple[Cell, ...]], ...]
    channels: tuple[tuple[int, Index], ...]
    views: tuple[tuple[Axis, Axis] | None, ...]

    @staticmethod
    def real(cells: tuple[Cell, ...]) -> bool:
        """Whether these per-dim cells are an entry of the operand (not padding, an inserted zero or a zero tap)."""
        return all(c.kind == "row" for c in cells)

    @property
    def reached(self) -> bool:
        """Whether any product multiplies two entries: False for the cells no tap reaches (zero in every sum)."""
        return bool(self.channels) and any(self.real(d) and self.real(k) for d, k in self.links)

    def claims(self) -> set[tuple[Index, Index]]:
        """Every (data entry, kernel entry) product of this cell: ``((c, *x), (*kernel channel, *t))``."""
        spatial = [(tuple(c.source for c in d), tuple(c.source for c in k)) for d, k in self.links
                   if self.real(d) and self.real(k)]
        return {((c, *x), (*kc, *t)) for c, kc in self.channels for x, t in spatial}


@dataclass(frozen=True, eq=False)
class Scene:
    """One computation of a configuration, read from its plan.

    Attributes:
        gradient: ``"forward"``, ``"grad_input"`` or ``"grad_weight"``.
        spec: the configuration (with batch 1 when the configuration has batch 0: the geometry of one sample).
        plan: the fwdconv plan that computes it (for ``"forward"``, fwdconv.plan_forward).
        data, kernel, result: the names of the tensors: data convolved with kernel gives result.
        axes: per spatial dim, the result's rows (``Out`` cells with their products).
    """

    gradient: str
    spec: ConvSpec
    plan: Any
    data: str
    kernel: str
    result: str
    axes: tuple[Axis, ...]

    @property
    def flips(self) -> bool:
        """Whether the plan flips the kernel before the contraction."""
        return any(isinstance(s, fwdconv.Flip) for s in self.plan.kernel_steps)

    @property
    def result_shape(self) -> Shape:
        return tuple(self.plan.shape)

    @property
    def direction(self) -> str:
        """Which way the contraction runs: ``"y"`` (the small side from x), ``"x"`` (x from y) or ``"w"``."""
        if self.gradient == "grad_weight":
            return "w"
        return "y" if (self.data == "input") != self.spec.transposed else "x"

    def result_channels(self) -> list[Index]:
        """Every channel of the result: ``(c,)``, or ``(c_y, c_x/g)`` for grad_weight."""
        shape = self.result_shape
        if self.direction == "w":
            return list(itertools.product(range(shape[0]), range(shape[1])))
        return [(c,) for c in range(shape[1])]

    def group_of(self, channel: Index) -> int:
        """The group a result channel belongs to."""
        s = self.spec
        if self.direction == "w" or self.direction == "y":
            return channel[0] // s.y_group_channels
        return channel[0] // s.x_group_channels

    def channel_pairs(self, channel: Index) -> tuple[tuple[int, Index], ...]:
        """The (data channel, kernel channel index) pairs summed into this result channel."""
        s = self.spec
        cxg, cyg = s.x_group_channels, s.y_group_channels
        group = self.group_of(channel)
        if self.direction == "w":  # grad_weight[c_y, c_x/g]: x channel group*C_x/g + c_x/g times y channel c_y
            return ((group * cxg + channel[1], (channel[0],)),)
        if self.direction == "y":  # y[c_y] sums x[group*C_x/g + j] * w[c_y, j]
            return tuple((group * cxg + j, (channel[0], j)) for j in range(cxg))
        return tuple((group * cyg + j, (group * cyg + j, channel[0] % cxg)) for j in range(cyg))  # x from y

    def frame(self, channel: Index, cell: Index) -> Frame:
        """The frame of one result cell of one channel."""
        outs: list[Out] = [axis.cells[u] for axis, u in zip(self.axes, cell, strict=True)]  # type: ignore[misc]
        links = tuple((tuple(d for d, _ in combo), tuple(k for _, k in combo))
                      for combo in itertools.product(*(o.links for o in outs)))
        phase = tuple(o.phase for o in outs) if all(o.phase >= 0 for o in outs) else None
        return Frame(self.gradient, channel, tuple(cell), phase, links, self.channel_pairs(channel),
                     tuple(o.view for o in outs))

    def cells(self) -> list[Index]:
        """Every result cell, row-major."""
        return list(itertools.product(*(range(len(a.cells)) for a in self.axes)))

    def frames(self, channels: list[Index] | None = None) -> list[Frame]:
        """The frames of every cell of these channels (default: all), channel by channel."""
        return [self.frame(c, u) for c in (self.result_channels() if channels is None else channels)
                for u in self.cells()]

    @cached_property
    def canvases(self) -> tuple[tuple[tuple[Cell, ...], ...], tuple[tuple[Cell, ...], ...]]:
        """Per dim, every data cell and every kernel cell any result row reads or sees, in key order.

        Dropped cells (cropped, skipped) come last in precedence: a key some row reads is drawn as read.
        """
        data, kernel = [], []
        for axis in self.axes:
            views = [o.view for o in axis.cells if o.view is not None]  # type: ignore[union-attr]
            linked = [Axis(tuple(d for d, _ in o.links)) for o in axis.cells]  # type: ignore[union-attr]
            tapped = [Axis(tuple(k for _, k in o.links)) for o in axis.cells]  # type: ignore[union-attr]
            data.append(_canvas([*(v[0] for v in views), *linked]))
            kernel.append(_canvas([*(v[1] for v in views), *tapped]))
        return tuple(data), tuple(kernel)

    def never_read(self, dim: int) -> set[int]:
        """The entries of the data (their source rows) that no result row of this dim reads."""
        read = {d.source for o in self.axes[dim].cells for d, _ in o.links if d.kind == "row"}  # type: ignore[union-attr]
        return {c.source for c in self.canvases[0][dim] if c.source >= 0} - read


def _canvas(axes: list[Axis]) -> tuple[Cell, ...]:
    u = union_axis(axes)
    return tuple(sorted((*u.cells, *u.dropped), key=lambda c: c.key))  # type: ignore[arg-type]


SceneOf = Callable[[str], "Scene"]  # a computation's name -> its scene (Recipe.scene): what the pictures draw


def plan_of(spec: ConvSpec, gradient: str, input_method: str | None = None, weight_method: str | None = None) -> Any:
    """The plan of one computation; input_method forces the x-from-y formulation, whichever computation that is
    (grad_input of a forward conv, the forward pass of a transposed one), weight_method grad_weight's."""
    if gradient == "forward":
        method = input_method if spec.transposed else None
        return fwdconv.plan_forward(spec) if method is None else fwdconv.plan_forward(spec, method)
    if gradient == "grad_input":
        method = None if spec.transposed else input_method
        return fwdconv.plan_input_grad(spec) if method is None else fwdconv.plan_input_grad(spec, method)
    return fwdconv.plan_weight_grad(spec) if weight_method is None else fwdconv.plan_weight_grad(spec, weight_method)


def scene(spec: ConvSpec, gradient: str, plan: Any | None = None, input_method: str | None = None,
          weight_method: str | None = None) -> Scene:
    """The scene of one computation, read from ``plan`` (default: the plan fwdconv builds for it).

    A batch-0 configuration is drawn with one sample (its plans compute empty sums).
    """
    if gradient not in GRADIENTS:
        raise ConvgradValueError(f"explain: gradient={gradient!r} must be one of {GRADIENTS}")
    if spec.batch == 0:
        spec = dataclasses.replace(spec, batch=1)
    if plan is None or plan.conv is None:
        plan = plan_of(spec, gradient, input_method, weight_method)
    shapes = {"input": spec.input_shape, "weight": spec.weight_shape, "grad_output": spec.output_shape}
    names = {"forward": "output", "grad_input": "grad_input", "grad_weight": "grad_weight"}
    axes = tuple(_result_axis(plan, j, shapes) for j in range(spec.n))
    return Scene(gradient, spec, plan, plan.data, plan.kernel, names[gradient], axes)


def _steps_rows(steps: tuple[Any, ...], dim: int, geometry: Axis | Family) -> Axis | Family:
    for step in steps:
        rows = getattr(step, "rows", None)
        if rows is None:
            raise NotImplementedError(f"explain: plan step kind {type(step).__name__!r} ({step.describe()}) has no "
                                      f"rows(dim, axis) geometry to draw")
        geometry = rows(dim, geometry)
    return geometry


def _result_axis(plan: Any, dim: int, shapes: dict[str, Shape]) -> Axis:
    """The rows of the plan's result along one dim, from its steps' geometry."""
    data = _steps_rows(plan.data_steps, dim, operand(shapes[plan.data][2 + dim]))
    kernel = _steps_rows(plan.kernel_steps, dim, operand(shapes[plan.kernel][2 + dim]))
    reads = getattr(plan.conv, "reads", None)
    if reads is None:
        raise NotImplementedError(f"explain: contraction {type(plan.conv).__name__!r} has no reads(dim, data, "
                                  f"kernel) geometry to draw")
    result = _steps_rows(plan.post_steps, dim, reads(dim, data, kernel))
    if not isinstance(result, Axis):
        raise NotImplementedError(f"explain: the {plan.gradient} plan leaves its {type(result).__name__} of results "
                                  f"unassembled in dim {dim}")
    return result
