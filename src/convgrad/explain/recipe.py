"""How each gradient of a convolution is built from forward operations, and which native kernel runs.

``explain`` returns a ``Recipe`` that wraps the very ``Plan`` objects (backends/fwdconv.py)
the fwdconv backend executes (``plan_input_grad(spec)``, ``plan_weight_grad(spec)``), so
what is explained is exactly what runs. A Recipe renders those plans as text (``str``), as a
standalone PyTorch script (``Recipe.to_python``) and as a picture (``Recipe.plot``).
Steps are read generically, through each step's ``describe()``, ``shape`` and class name, so a
new kind of step in the backend shows up here without changes.

``native_backend`` answers the other half of the seeds' first question: which kernel
``aten.convolution_backward`` dispatches to for a configuration (see ``_native_choice.py``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convgrad.backends import fwdconv
from convgrad.explain.native import NativeChoice, native_backend
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.figure import Figure

__all__ = ["Leftover", "NativeChoice", "Recipe", "RecipeStep", "explain", "native_backend"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class RecipeStep:
    """One step of a gradient's plan as the recipe shows it.

    Attributes:
        operand: the tensor the step acts on (``"grad_output"``, ``"input"``, ``"weight"``), ``"conv"``
            for the convolution itself, or ``"result"`` for steps after it.
        kind: the step's class name in the backend, e.g. ``"ZeroInsert"``.
        description: the step's own ``describe()``.
        shape: the tensor's shape after the step.
        step: the plan's step object itself.
    """

    operand: str
    kind: str
    description: str
    shape: Shape
    step: Any


@dataclass(frozen=True)
class Leftover:
    """The leftover r of one spatial dim: trailing rows of the padded big side that no output reads.

    Attributes:
        dim: the spatial dim (0-based).
        r: how many trailing rows of the padded big side are never read.
        unread_input_rows: how many of those r rows are real rows, not padding: ``max(0, r - p_hi)``.
        reason: one line saying where r comes from and what it means for the gradients.
    """

    dim: int
    r: int
    unread_input_rows: int
    reason: str


def _is_step(obj: Any) -> bool:
    return callable(getattr(obj, "describe", None)) and isinstance(getattr(obj, "shape", None), tuple)


def _operand(plan: Any, field: str) -> str:
    """Which tensor the steps of a plan field act on; unknown fields keep their own name."""
    names = {"data_steps": getattr(plan, "data", "data"), "kernel_steps": getattr(plan, "kernel", "kernel"),
             "conv": "conv", "post_steps": "result"}
    return names.get(field, field)


def plan_steps(plan: Any) -> list[RecipeStep]:
    """Every step of a plan, in field order (data path, kernel path, conv, post steps)."""
    out = []
    for f in dataclasses.fields(plan):
        value = getattr(plan, f.name)
        for item in value if isinstance(value, tuple) else (value,):
            if _is_step(item):
                out.append(RecipeStep(_operand(plan, f.name), type(item).__name__, item.describe(),
                                      tuple(item.shape), item))
    return out


def _leftover_reason(spec: ConvSpec, dim: int) -> str:
    i, o = spec.x_size[dim], spec.y_size[dim]
    k, s, d = spec.kernel_size[dim], spec.stride[dim], spec.dilation[dim]
    (lo, hi), r, real = spec.padding[dim], spec.leftover[dim], spec.unread_input_rows[dim]
    read = (o - 1) * s + d * (k - 1) + 1
    if r == 0:
        return f"the windows end exactly at the last padded row: (o-1)s + d(k-1) + 1 = {read} = i + p_lo + p_hi"
    if spec.transposed:
        return (f"r = output_padding = {spec.output_padding[dim]}: the last {r} row(s) of the uncropped output get no "
                f"kernel tap; {real} survive the crop p_hi={hi} (only the bias reaches them, their grad_output is "
                f"ignored) and {r - real} are cropped")
    return (f"i + p_lo + p_hi - d(k-1) - 1 = {i + lo + hi - d * (k - 1) - 1} leaves remainder {r} mod stride {s}: "
            f"the last {r} padded row(s) lie past the last window; {real} of them are real input rows, whose "
            f"grad_input is 0")


@dataclass(frozen=True, eq=False)
class Recipe:
    """The step-by-step construction of a convolution's backward from forward operations.

    Attributes:
        spec: the validated configuration.
        input_plan: the fwdconv backend's plan for grad_input (the same object it executes).
        weight_plan: the fwdconv backend's plan for grad_weight.
    """

    spec: ConvSpec
    input_plan: Any
    weight_plan: Any

    @property
    def plans(self) -> dict[str, Any]:
        """``{"grad_input": input_plan, "grad_weight": weight_plan}``."""
        return {"grad_input": self.input_plan, "grad_weight": self.weight_plan}

    def steps(self, gradient: str) -> list[RecipeStep]:
        """The ordered steps of ``"grad_input"`` or ``"grad_weight"``, each with the shape after it."""
        if gradient not in self.plans:
            raise ValueError(f"Recipe.steps: gradient={gradient!r} must be 'grad_input' or 'grad_weight'")
        return plan_steps(self.plans[gradient])

    @property
    def leftover(self) -> tuple[Leftover, ...]:
        """The leftover r of every spatial dim, with how many of its rows are real rows, and why."""
        return tuple(Leftover(j, r, u, _leftover_reason(self.spec, j))
                     for j, (r, u) in enumerate(zip(self.spec.leftover, self.spec.unread_input_rows, strict=True)))

    def _start_shapes(self) -> dict[str, Shape]:
        s = self.spec
        return {"input": s.input_shape, "weight": s.weight_shape, "grad_output": s.output_shape}

    def __str__(self) -> str:
        s = self.spec
        lines = [s.describe(), f"grad_output shape {s.output_shape}; every gradient below uses forward ops only "
                               "(convgrad's fwdconv backend runs exactly these steps)"]
        starts = self._start_shapes()
        for name, plan in self.plans.items():
            data, kernel = getattr(plan, "data", "data"), getattr(plan, "kernel", "kernel")
            lines += ["", f"{name} {tuple(plan.shape)} = conv of {data} with {kernel} as the kernel:"]
            steps = self.steps(name)
            if getattr(plan, "conv", True) is None:
                lines.append("   the sum is empty (batch 0): zeros")
            seen: set[str] = set()
            for n, st in enumerate(steps, 1):
                if st.operand in starts and st.operand not in seen:
                    seen.add(st.operand)
                    lines.append(f"       {st.operand:<12} {starts[st.operand]}")
                lines.append(f"   {n:>2}. {st.operand:<12} {st.description}  -> {st.shape}")
        dims = (0, *range(2, s.n + 2))
        lines += ["", f"grad_bias ({s.out_channels},) = grad_output summed over dims {dims}", "",
                  "leftover r per dim (trailing rows of the padded "
                  f"{'output' if s.transposed else 'input'} that no window reads):"]
        for lo in self.leftover:
            lines.append(f"   spatial dim {lo.dim}: r={lo.r} ({lo.unread_input_rows} real): {lo.reason}")
        return "\n".join(lines)

    def to_python(self) -> str:
        """A standalone PyTorch script: random tensors, the gradients by this recipe, checked against autograd.

        Returns:
            Python source that imports only torch, uses only forward ops (F.pad, F.conv*d, flip,
            reshape/permute) for the gradients, and asserts them against torch autograd in float64.

        Raises:
            NotImplementedError: a plan contains a step kind that has no code template.

        Examples:
            >>> import convgrad as cg
            >>> src = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).to_python()
            >>> exec(compile(src, "recipe.py", "exec"), {"__name__": "__main__"})
            recipe matches torch autograd: grad_input, grad_weight, grad_bias
        """
        from convgrad.explain.code import script

        return script(self)

    def plot(self, path: str | Path | None = None) -> Figure:
        """Draw the recipe's geometry: the padded grids each gradient convolves, with the kernel footprints.

        For 1d and 2d: grad_input's grid (for a forward conv the zero-inserted, padded grad_output, with
        inserted zeros, padding, cropped and original entries coloured apart, and the flipped kernel's
        footprint) and grad_weight's view (the padded big side, its unread leftover rows, and
        grad_output's taps as the kernel). For 3d: the same as one strip per dim.

        Args:
            path: where to save the figure (any format matplotlib knows from the suffix); None to only return it.

        Returns:
            The matplotlib Figure (Agg canvas, no display needed).

        Examples:
            >>> import convgrad as cg
            >>> fig = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).plot()
            >>> len(fig.axes) >= 2
            True
        """
        from convgrad.explain.picture import plot

        return plot(self, path)


def explain(
    input_size: Sequence[int],
    weight_size: Sequence[int],
    stride: IntOrTuple = 1,
    padding: PaddingArg = 0,
    dilation: IntOrTuple = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
) -> Recipe:
    """The recipe of a convolution's backward: each gradient as steps of forward operations.

    Args:
        input_size: ``(N, C_in, *spatial)`` or unbatched ``(C_in, *spatial)``.
        weight_size: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple, N-tuple of ``(lo, hi)`` pairs, ``'same'`` or ``'valid'`` (default 0).
        transposed: explain a transposed convolution (default False).
        output_padding: int or N-tuple, transposed only (default 0).
        groups: int dividing both channel counts (default 1).

    Returns:
        Recipe: wraps the fwdconv backend's own plans; ``str(recipe)`` is readable text.

    Raises:
        TypeError, ValueError: invalid hyperparameters or shapes, as ``convgrad.ConvSpec``.

    Source: docs/derivation.md.

    Examples:
        >>> import convgrad as cg
        >>> recipe = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2)
        >>> recipe.steps("grad_input")[-1].shape   # every step carries the shape after it
        (1, 1, 5, 5)
        >>> recipe.leftover[0].r
        0
    """
    spec = ConvSpec.from_shapes(input_size, weight_size, stride, padding, dilation, transposed, output_padding,
                                groups, fn="explain")
    return Recipe(spec, fwdconv.plan_input_grad(spec), fwdconv.plan_weight_grad(spec))
