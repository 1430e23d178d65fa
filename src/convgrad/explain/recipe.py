"""How each gradient of a convolution is built from forward operations, and which native kernel runs.

``explain`` returns a ``Recipe`` that wraps the very ``Plan`` objects (backends/fwdconv/plan.py)
the fwdconv backend executes (``plan_input_grad(spec)``, ``plan_weight_grad(spec)``), so
what is explained is exactly what runs. A Recipe renders those plans as text (``str``), as a
standalone PyTorch script (``Recipe.to_python``), as pictures and animations drawn from each
step's own geometry (``Recipe.plot``, ``Recipe.animate``) and as a page (``Recipe.to_html``).
Steps are read generically, through each step's ``describe()``, ``shape``, ``code()``, ``label()`` and
``rows``/``reads`` geometry (the protocols of backends/fwdconv/plan.py), so a new kind of step in the
backend shows up here without changes.

``native_backend`` answers the other half of the seeds' first question: which kernel
``aten.convolution_backward`` dispatches to for a configuration (explain/kernel_choice.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from convgrad.backends import fft, fwdconv
from convgrad.checks import check_size
from convgrad.errors import ConvgradValueError
from convgrad.explain import fft_view
from convgrad.explain.kernel_choice import NativeChoice, native_backend
from convgrad.explain.methods import plan_of, resolve_methods
from convgrad.explain.symbols import used_symbols
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg, Shape

if TYPE_CHECKING:
    from collections.abc import Sequence

    from matplotlib.figure import Figure

    from convgrad.explain.frames import Scene

__all__ = ["Leftover", "NativeChoice", "Recipe", "RecipeStep", "explain", "native_backend"]

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
        forward_plan: the plan the pictures draw the forward pass with (``fwdconv.plan_forward``; torch runs
            the forward itself); None: built from the spec.
        input_method, weight_method: the formulations forced with ``explain(..., input_method=, weight_method=)``,
            or None where the backend's rules chose.
    """

    spec: ConvSpec
    input_plan: Any
    weight_plan: Any
    forward_plan: Any = None
    input_method: str | None = None
    weight_method: str | None = None

    @property
    def plans(self) -> dict[str, Any]:
        """``{"grad_input": input_plan, "grad_weight": weight_plan}``."""
        return {"grad_input": self.input_plan, "grad_weight": self.weight_plan}

    def scene(self, gradient: str) -> Scene:
        """The pictures' view of ``"forward"``, ``"grad_input"`` or ``"grad_weight"``: its plan's geometry, by frame.

        Raises:
            ValueError: an unknown gradient.
        """
        from convgrad.explain.frames import scene

        plans = {**self.plans, "forward": self.forward_plan}
        if gradient not in plans:
            raise ConvgradValueError(
                f"Recipe.scene: gradient={gradient!r} must be 'forward', 'grad_input' or 'grad_weight'")
        if fft_view.is_fft(plans[gradient]):
            raise fft_view.frames_refused("Recipe.scene", gradient)
        return scene(self.spec, gradient, plans[gradient], self.input_method, self.weight_method)

    def steps(self, gradient: str) -> list[RecipeStep]:
        """The ordered steps of ``"grad_input"`` or ``"grad_weight"``, each with the shape after it."""
        if gradient not in self.plans:
            raise ConvgradValueError(f"Recipe.steps: gradient={gradient!r} must be 'grad_input' or 'grad_weight'")
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
        shown = f"{s.output_shape[1:]} (unbatched; the steps below run it as a batch of 1)" if s.unbatched \
            else f"{s.output_shape}"
        how = "the fwdconv backend's forward ops or the fft backend's steps" if self._fft() else "forward ops only"
        lines = [s.describe(), f"grad_output shape {shown}; every gradient below uses {how} "
                               "(convgrad's backend runs exactly these steps)", *fft_view.shared_pass(self.plans)]
        starts = self._start_shapes()
        for name, plan in self.plans.items():
            lines += ["", *self._plan_lines(name, plan, starts)]
        dims = (0, *range(2, s.n + 2))
        lines += ["", f"grad_bias ({s.out_channels},) = grad_output summed over dims {dims}", "",
                  "leftover r per dim (trailing rows of the padded "
                  f"{'output' if s.transposed else 'input'} that no window reads):"]
        for lo in self.leftover:
            lines.append(f"   spatial dim {lo.dim}: r={lo.r} ({lo.unread_input_rows} real): {lo.reason}")
        if s.transposed and self.forward_plan is not None:
            lines += ["", "the transposed conv's own forward (torch runs it; the pictures draw it as this plan):",
                      *self._plan_lines("output", self.forward_plan, starts)]
        text = "\n".join(lines)
        symbols = used_symbols(text)
        return "\n".join([text, "", "symbols:", *(f"   {name:<15} {definition}" for name, definition in symbols)])

    def _fft(self) -> list[str]:
        """The computations planned by the fft backend."""
        plans = {**self.plans, "forward": self.forward_plan}
        return [g for g, p in plans.items() if fft_view.is_fft(p)]

    def _plan_lines(self, name: str, plan: Any, starts: dict[str, Shape]) -> list[str]:
        if fft_view.is_fft(plan):
            return fft_view.plan_lines(name, plan, starts)
        data, kernel = getattr(plan, "data", "data"), getattr(plan, "kernel", "kernel")
        method = getattr(plan, "method", "")
        why = f" [{method}: {plan.reason}]" if getattr(plan, "reason", "") else f" [{method}]" if method else ""
        lines = [f"{name} {tuple(plan.shape)} = conv of {data} with {kernel} as the kernel{why}:"]
        if getattr(plan, "conv", True) is None:
            lines.append("   the sum is empty (batch 0): zeros")
        seen: set[str] = set()
        for n, st in enumerate(plan_steps(plan), 1):
            if st.operand in starts and st.operand not in seen:
                seen.add(st.operand)
                lines.append(f"       {st.operand:<12} {starts[st.operand]}")
            lines.append(f"   {n:>2}. {st.operand:<12} {st.description}  -> {st.shape}")
        return lines

    def to_python(self) -> str:
        """A standalone PyTorch script: random tensors, the gradients by this recipe, checked against autograd.

        Returns:
            Python source that imports only torch, uses only forward ops (F.pad, F.conv*d, flip,
            reshape/permute) for the gradients, and asserts them against torch autograd in float64.

        Raises:
            NotImplementedError: a plan contains a step kind that has no ``code()``.

        Examples:
            >>> import convgrad as cg
            >>> src = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).to_python()
            >>> exec(compile(src, "recipe.py", "exec"), {"__name__": "__main__"})
            recipe matches torch autograd: grad_input, grad_weight, grad_bias
        """
        from convgrad.explain.code import script

        return script(self.spec, self.plans, self._start_shapes())

    def plot(self, path: str | Path | None = None,
             gradients: Sequence[str] = ("grad_input", "grad_weight")) -> Figure:
        """Draw the recipe's key frames: for grad_input and grad_weight, the grid each plan convolves with its kernel.

        Drawn from the plans' own steps: zero-insertion draws the inserted zeros, polyphase and sub-pixel one
        row per phase (which rows of the result it fills, with which taps of the flipped kernel), and every
        frame the padding, cropped and never-read cells. 1d and 2d are grids; 3d a row of depth slices.

        Args:
            path: where to save the figure (any format matplotlib knows from the suffix); None to only return it.
            gradients: the computations drawn, a selection of ``("grad_input", "grad_weight")`` (default both).

        Returns:
            The matplotlib Figure (Agg canvas, no display needed), 800 px wide.

        Raises:
            ValueError: an empty or unknown selection of gradients; a ``path`` in a folder that does not exist.

        Examples:
            >>> import convgrad as cg
            >>> fig = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2).plot()
            >>> round(fig.get_size_inches()[0] * fig.dpi)  # pixels wide
            800
        """
        if path is not None:
            from convgrad.explain.raster import check_path

            check_path(Path(path), "Recipe.plot")  # as animate and to_html: one line, not PIL's FileNotFoundError
        if any(g in self._fft() for g in gradients):
            return fft_view.plot(self.spec, self.plans, tuple(gradients), path)
        from convgrad.explain.picture import plot

        return plot(self.scene, path, tuple(gradients))

    def animate(self, path: str | Path, gradients: Sequence[str] = ("forward", "grad_input", "grad_weight"),
                max_frames: int = 120, fps: float = 1.5) -> Path:
        """Write a step-through animation: every cell each computation produces, with the products it sums.

        Each frame shows the data grid (padding, inserted zeros, cropped and never-read cells) with the kernel's
        footprint at its position, the kernel (flipped where the plan flips it) and the result with the cell
        being produced; small sizes print their numbers; groups are coloured channel blocks. Large layers are
        bounded: a corner of the result (and fewer channels) is shown, and the caption says so.

        Args:
            path: ``.gif`` or ``.webp`` (Pillow), ``.mp4`` (needs ffmpeg) or ``.html`` (as ``to_html``).
            gradients: which computations to animate, in order (default all three: the conv's own forward,
                grad_input, grad_weight).
            max_frames: the most frames in the file (default 120), shared among the gradients.
            fps: frames per second (default 1.5).

        Returns:
            The path written.

        Raises:
            ValueError: an unknown suffix or gradient, or ``.mp4`` without ffmpeg.

        Examples:
            >>> import convgrad as cg, tempfile, pathlib
            >>> out = pathlib.Path(tempfile.mkdtemp()) / "conv.gif"
            >>> cg.explain((1, 1, 4), (1, 1, 3)).animate(out, max_frames=4).stat().st_size > 0
            True
        """
        if Path(path).suffix.lower() == ".html":
            return self.to_html(path, gradients, max_frames)
        self._refuse_frames("Recipe.animate", gradients)
        from convgrad.explain.animation import animate

        return animate(self.scene, Path(path), tuple(gradients), max_frames, fps)

    def to_html(self, path: str | Path, gradients: Sequence[str] = ("forward", "grad_input", "grad_weight"),
                max_frames: int = 120) -> Path:
        """Write a self-contained page: the frames with a slider to scrub them, the recipe text and its script.

        No server and no network: the frames are embedded PNGs, the player a few lines of local script.

        Args:
            path: the ``.html`` file to write.
            gradients: which computations to show (default all three).
            max_frames: the most frames on the page (default 120).

        Returns:
            The path written.

        Raises:
            ValueError: an unknown gradient.

        Examples:
            >>> import convgrad as cg, tempfile, pathlib
            >>> out = pathlib.Path(tempfile.mkdtemp()) / "conv.html"
            >>> "http" in cg.explain((1, 1, 4), (1, 1, 3)).to_html(out, max_frames=3).read_text()
            False
        """
        self._refuse_frames("Recipe.to_html", gradients)
        from convgrad.explain.html import to_html

        return to_html(self.scene, Path(path), tuple(gradients), max_frames, self.spec.describe(), str(self),
                       self.to_python())


    def _refuse_frames(self, fn: str, gradients: Sequence[str]) -> None:
        for gradient in gradients:
            if gradient in self._fft():
                raise fft_view.frames_refused(fn, gradient)


def explain(
    input_size: Sequence[int],
    weight_size: Sequence[int],
    stride: IntOrTuple = 1,
    padding: PaddingArg = 0,
    dilation: IntOrTuple = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    method: str | None = None,
    *,
    input_method: str | None = None,
    weight_method: str | None = None,
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
        method: a formulation to show instead of the one the backend's rules choose, applied to whichever
            computation has it: one of ``fwdconv.INPUT_METHODS`` (``zero_insert``, the textbook form,
            ``polyphase``, ``subpixel``) or ``fwdconv.WEIGHT_METHODS`` (``kernel``, ``per_sample``, ``taps``,
            ``blocks``, ``phases``), or ``fft`` (the fft backend's plans, for both gradients). Default None.
        input_method: the formulation of x from y (grad_input of a forward conv; the forward pass of a
            transposed one, as the pictures draw it), one of ``INPUT_METHODS`` or ``fft``. Default None.
        weight_method: the formulation of grad_weight, one of ``WEIGHT_METHODS`` or ``fft``. Default None.

    Returns:
        Recipe: wraps the fwdconv backend's own plans (the fft backend's where ``fft`` is asked for: text,
        script and ``plot`` show them; ``animate``, ``to_html`` and ``scene`` raise MethodRefused, an fft
        computation has no per-cell frames); ``str(recipe)`` is readable text.

    Raises:
        TypeError, ValueError: invalid hyperparameters or shapes, as ``convgrad.ConvSpec``; an unknown method,
            or one that cannot serve the configuration (sub-pixel needs the dilation to divide the stride,
            blocks needs stride 1, phases dilation 1).

    Source: the docs' "Derivation" page.

    Examples:
        >>> import convgrad as cg
        >>> recipe = cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2)
        >>> recipe.steps("grad_input")[-1].shape   # every step carries the shape after it
        (1, 1, 5, 5)
        >>> recipe.leftover[0].r
        0
        >>> cg.explain((1, 1, 5, 5), (1, 1, 3, 3), stride=2, method="zero_insert").steps("grad_input")[0].kind
        'ZeroInsert'
    """
    input_size, weight_size = check_size("explain", "input_size", input_size), check_size("explain", "weight_size",
                                                                                            weight_size)
    spec = ConvSpec.from_shapes(input_size, weight_size, stride, padding, dilation, transposed, output_padding,
                                groups, fn="explain")
    input_method, weight_method = resolve_methods(method, input_method, weight_method)
    x_from_y = fwdconv.plan_forward if spec.transposed else fwdconv.plan_input_grad
    x_plan = plan_of(x_from_y, spec, input_method, "input_method")
    input_plan = (fft.plan(spec, "grad_input") if input_method == fft_view.METHOD else
                  fwdconv.plan_input_grad(spec)) if spec.transposed else x_plan
    forward_plan = x_plan if spec.transposed else fwdconv.plan_forward(spec)
    weight_plan = plan_of(fwdconv.plan_weight_grad, spec, weight_method, "weight_method")
    return Recipe(spec, input_plan, weight_plan, forward_plan, input_method, weight_method)
