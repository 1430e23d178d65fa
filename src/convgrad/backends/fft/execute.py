"""The fft backend's interpreter: ``run`` executes a plan's steps (``plans``), chunk by chunk, and ``execute`` and
``execute_backward`` are the checked entry points that hand it tensors.

``run`` calls each step's operation (``ops.OPS``) on its registers, enters a loop where the steps go deeper (one pass
per chunk of groups, samples or kernel rows, its range bound to ``g``, ``n`` or ``r``), and frees each register where
the plan says (``FftPlan.drops``, ``loop_drops``), so that no chunk's spectra outlive their term. It adds no work per
element: one dict lookup and one call per step and chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from convgrad.backends.fft.ops import OPS
from convgrad.backends.fft.plans import backward_plan, fuse, shares_spectra
from convgrad.backends.fft.program import FftPlan, FftStep
from convgrad.errors import ConvgradValueError

__all__ = ["execute", "execute_backward", "run"]

Shape = tuple[int, ...]
Trace = Callable[[FftStep, Any], None]


def run(p: FftPlan, tensors: dict[str, torch.Tensor], real: bool, trace: Trace | None = None
        ) -> tuple[torch.Tensor, ...]:
    """Execute a plan: its steps in order, each loop's once per chunk; the plan's outputs.

    Args:
        p: the plan (``plan``, ``backward_plan``).
        tensors: the plan's inputs by name (``p.inputs``), checked and of one floating dtype.
        real: whether the data is real (rfftn and a conjugate for the reversed spectra) or complex.
        trace: called with every step and what it wrote (tests compare it with the declared shape); default None.

    Returns:
        The registers ``p.outputs``, in order.
    """
    env: dict[str, Any] = dict(p.whole)
    env.update(tensors, real=real)
    _block(p, 0, 0, env, trace)
    return tuple(env[name] for name in p.outputs)


def _block(p: FftPlan, start: int, depth: int, env: dict[str, Any], trace: Trace | None) -> int:
    """Run the steps from ``start`` at ``depth`` and the loops nested in them; the index of the first step after."""
    steps, i = p.steps, start
    while i < len(steps) and steps[i].depth >= depth:
        step = steps[i]
        if step.depth > depth:  # a loop: its steps once per chunk, then its range whole again
            loop = p.loops[depth]
            for chunk in loop.ranges:
                env[loop.var] = chunk
                _block(p, i, depth + 1, env, trace)
            env[loop.var] = loop.whole
            for name in p.loop_drops.get((i, depth), ()):
                env.pop(name, None)
            i = p.loop_ends[(i, depth)]
            continue
        env[step.writes] = value = OPS[step.op].run(*[env[name] for name in step.reads], **step.kwargs)
        if trace is not None:
            trace(step, value)
        for name in p.drops[i]:
            del env[name]
        i += 1
    return i


def execute(p: FftPlan, data: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Run a plan chunk by chunk: the result of ``p.kind`` (y from x, x from y, or w from x and y).

    Args:
        p: the plan, ``plan(spec, gradient)``.
        data: x ``spec.x_shape`` ``(N, C_x, *i)`` for y_from_x and w_from_xy, y ``spec.y_shape`` ``(N, C_y, *o)``
            for x_from_y; real or complex floating (half precision is computed in float32).
        other: the weight ``spec.weight_shape`` ``(C_y, C_x/g, *k)`` for y_from_x and x_from_y (conjugated by a
            gradient's caller: torch's complex convention), y ``spec.y_shape`` for w_from_xy; ``data``'s dtype.

    Returns:
        y_from_x: ``spec.y_shape``; x_from_y: ``spec.x_shape``; w_from_xy: ``spec.weight_shape``; in ``data``'s
        dtype.

    Raises:
        ValueError: ``data`` or ``other`` not of the plan's shape.

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> x, w = torch.randn(2, 4, 30, dtype=torch.float64), torch.randn(4, 1, 9, dtype=torch.float64)
        >>> spec = ConvSpec.from_shapes(x.shape, w.shape, stride=2, padding=4, groups=4)
        >>> y = execute(plan(spec, "output"), x, w)
        >>> y.shape, bool(torch.allclose(y, torch.nn.functional.conv1d(x, w, stride=2, padding=4, groups=4)))
        (torch.Size([2, 4, 15]), True)

    Source: the convolution theorem, per bin and group (the package docstring's contractions; the docs' "Derivation"
    page, "The convolution theorem").
    """
    spec = p.spec
    _check_shapes("execute", p, {"data": (data, spec.y_shape if p.kind == "x_from_y" else spec.x_shape),
                                 "other": (other, spec.y_shape if p.kind == "w_from_xy" else spec.weight_shape)})
    dtype = data.dtype
    if spec.batch == 0:  # nothing to transform: an empty result, or grad_weight's empty sum
        shapes = {"y_from_x": spec.y_shape, "x_from_y": spec.x_shape, "w_from_xy": spec.weight_shape}
        return data.new_zeros(shapes[p.kind])
    if dtype in (torch.float16, torch.bfloat16):
        data, other = data.float(), other.float()
    (out,) = run(p, dict(zip(p.inputs, (data, other))), not (data.is_complex() or other.is_complex()))
    return out.to(dtype)


def _check_shapes(fn: str, p: FftPlan, tensors: dict[str, tuple[torch.Tensor, Shape]]) -> None:
    """Each tensor has the shape the plan reads (name: (tensor, shape)): another would fail deep in a reshape."""
    for name, (t, shape) in tensors.items():
        if tuple(t.shape) != shape:
            raise ConvgradValueError(f"fft.{fn}: {name}.shape={tuple(t.shape)} does not match {shape}, its shape in "
                                     f"{p.spec.describe()}")


def execute_backward(pi: FftPlan, pw: FftPlan, grad_output: torch.Tensor, input: torch.Tensor,
                     weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad_input and grad_weight in one chunked pass, grad_output's spectrum made once per chunk for both.

    Runs the fused plan of the two (``backward_plan``, ``fuse``): per chunk of groups and samples, a forward conv's
    grad_output is y, its Y feeds X' = sum_a Y W (grad_input) and W' = sum_n ~Y X (grad_weight, ~Y a lazy conj for
    real data); a transposed conv's is x, its X feeds Y = sum_b X ~W (grad_input) and W'.

    Args:
        pi: grad_input's plan, ``plan(spec, "grad_input")``.
        pw: grad_weight's plan of the same spec, ``plan(spec, "grad_weight")``; ``shares_spectra(pi, pw)`` must
            hold.
        grad_output: ``spec.output_shape`` ``(N, C_out, *out)``, real or complex floating (half precision is
            computed in float32).
        input: ``spec.input_shape`` ``(N, C_in, *in)``, conjugated by the caller (torch's complex convention; a
            no-op for real data); grad_output's dtype.
        weight: ``spec.weight_shape`` ``(C_out, C_in/g, *k)`` (transposed: ``(C_in, C_out/g, *k)``), conjugated
            by the caller likewise; grad_output's dtype.

    Returns:
        (grad_input ``spec.input_shape``, grad_weight ``spec.weight_shape``), in grad_output's dtype.

    Raises:
        ValueError: ``pi`` not a grad_input plan, ``pw`` not a grad_weight plan of the same spec, plans that do not
            share their spectra (``shares_spectra``: run each with ``execute``), or a tensor not of the spec's
            shape.

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((2, 4, 30), (4, 1, 9), padding=4, groups=4)
        >>> pi, pw = plan(spec, "grad_input"), plan(spec, "grad_weight")
        >>> gy, x, w = torch.randn(2, 4, 30), torch.randn(2, 4, 30), torch.randn(4, 1, 9)
        >>> gi, gw = execute_backward(pi, pw, gy, x, w)
        >>> ref = torch.ops.aten.convolution_backward(gy, x, w, None, [1], [4], [1], False, [0], 4,
        ...                                           [True, True, False])
        >>> bool(torch.allclose(gi, ref[0], atol=1e-4) and torch.allclose(gw, ref[1], atol=1e-4))
        True

    Source: the package docstring's contractions; the docs' "Derivation" page, "The convolution theorem".
    """
    spec = pi.spec
    if pi.gradient != "grad_input" or pw.gradient != "grad_weight" or pw.spec != spec or not shares_spectra(pi, pw):
        raise ConvgradValueError(f"fft.execute_backward: pi={pi.gradient}'s plan of {spec.describe()} and "
                                 f"pw={pw.gradient}'s plan of {pw.spec.describe()} must be grad_input's and "
                                 "grad_weight's plans of one spec that share their spectra (shares_spectra)")
    _check_shapes("execute_backward", pi, {"grad_output": (grad_output, spec.output_shape),
                                           "input": (input, spec.input_shape), "weight": (weight, spec.weight_shape)})
    # the cached fused plan of these two plans; while torch.compile traces (``planning.planned``: no lru_cache),
    # or for plans made elsewhere, fused afresh
    both = None if torch.compiler.is_compiling() else backward_plan(spec)
    if both is None or both.parts[0] is not pi or both.parts[1] is not pw:
        both = fuse(pi, pw)
    dtype = grad_output.dtype
    if dtype in (torch.float16, torch.bfloat16):
        grad_output, input, weight = grad_output.float(), input.float(), weight.float()
    real = not (grad_output.is_complex() or input.is_complex() or weight.is_complex())
    gi, gw = run(both, dict(zip(both.inputs, (grad_output, input, weight))), real)
    return gi.to(dtype), gw.to(dtype)
