"""Recipe.to_python: a standalone PyTorch script generated from the fwdconv plan steps.

Each step kind has a code template here, keyed by class name. A step kind may instead carry
its own ``code(var, shape) -> list[str]`` (lines that update ``var``, whose shape before the
step is ``shape``); a kind with neither raises NotImplementedError naming it. The generated
gradients use forward ops only (F.pad, F.conv*d, flip, reshape/permute); torch autograd
runs only inside ``autograd_grads``, the final check.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from convgrad.backends.fwdconv.plan import pad_code
from convgrad.spec import ConvSpec

if TYPE_CHECKING:
    from convgrad.explain.recipe import Recipe

Shape = tuple[int, ...]


def _flat(pairs: Any) -> list[int]:
    """(lo, hi) per trailing dim -> F.pad's flat list, last dim first; negative values crop."""
    return [v for lo, hi in reversed(tuple(pairs)) for v in (lo, hi)]


def _dims(values: Any) -> str:
    return ", ".join(str(v) for v in values)


def _zero_insert(step: Any, v: str, shape: Shape) -> list[str]:
    n_, c, *o = shape
    s = tuple(step.stride)
    spread = [x for oj in o for x in (oj, 1)]
    between = [p for sj in s for p in ((0, 0), (0, sj - 1))]
    return [
        f"{v} = {v}.reshape({_dims((n_, c, *spread))})  # (N, C, o1, 1, o2, 1, ...)",
        f"{v} = F.pad({v}, {_flat(between)})  # (N, C, o1, s1, ...): s-1 zeros after every entry",
        f"{v} = {v}.reshape({_dims((n_, c, *(oj * sj for oj, sj in zip(o, s, strict=True))))})  # (N, C, o1*s1, ...)",
        f"{v} = F.pad({v}, {_flat([(0, 1 - sj) for sj in s])})  # drop the zeros after the last entry: "
        f"{tuple(step.shape)}",
    ]


def _pad(step: Any, v: str, shape: Shape) -> list[str]:
    return pad_code(v, v, step.pads, f"{tuple(step.shape)}")


def _flip(step: Any, v: str, shape: Shape) -> list[str]:
    return [f"{v} = {v}.flip({list(range(2, len(shape)))})  # flip every spatial dim: {tuple(step.shape)}"]


def _swap_group_channels(step: Any, v: str, shape: Shape) -> list[str]:
    c_y, cxg, *k = shape
    g = step.groups
    return [f"{v} = {v}.reshape({_dims((g, c_y // g, cxg, *k))})  # (g, C_y/g, C_x/g, *k)",
            f"{v} = {v}.transpose(1, 2).reshape({_dims(step.shape)})  # (C_x, C_y/g, *k): in/out swapped per group"]


def _batch_into_channels(step: Any, v: str, shape: Shape) -> list[str]:
    n_, c_x, *i = shape
    g = step.groups
    perm = (2, 1, 0, *range(3, 3 + len(i)))
    return [f"{v} = {v}.reshape({_dims((n_, g, c_x // g, *i))})  # (N, g, C_x/g, *i)",
            f"{v} = {v}.permute({_dims(perm)}).reshape({_dims(step.shape)})  # (C_x/g, g*N, *i): samples as channels"]


def _swap_batch_channels(step: Any, v: str, shape: Shape) -> list[str]:
    perm = (1, 0, *range(2, len(shape)))
    return [f"{v} = {v}.permute({_dims(perm)})  # swap batch and channels: {tuple(step.shape)}"]


TEMPLATES: dict[str, Callable[[Any, str, Shape], list[str]]] = {
    "ZeroInsert": _zero_insert,
    "Pad": _pad,
    "Flip": _flip,
    "SwapGroupChannels": _swap_group_channels,
    "BatchIntoChannels": _batch_into_channels,
    "SwapBatchChannels": _swap_batch_channels,
}


def step_code(step: Any, v: str, shape: Shape) -> list[str]:
    """Lines that apply one plan step to variable `v` (shape `shape` before the step)."""
    own = getattr(step, "code", None)
    if callable(own):
        return list(own(v, shape))
    template = TEMPLATES.get(type(step).__name__)
    if template is None:
        raise NotImplementedError(f"Recipe.to_python: no code template for plan step kind {type(step).__name__!r} "
                                  f"({step.describe()}); add one to convgrad.explain.code.TEMPLATES or give the "
                                  f"step a code(var, shape) method")
    return template(step, v, shape)


def _conv_code(conv: Any, out: str, data: str, kernel: str) -> list[str]:
    own = getattr(conv, "code", None)
    if callable(own):
        return list(own(out, data, kernel))
    if type(conv).__name__ != "Conv":
        raise NotImplementedError(f"Recipe.to_python: no code template for plan step kind {type(conv).__name__!r}")
    n = len(conv.stride)
    return [f"{out} = F.conv{n}d({data}, {kernel}, None, stride={tuple(conv.stride)}, padding={tuple(conv.padding)}, "
            f"dilation={tuple(conv.dilation)}, groups={conv.groups})  # {tuple(conv.shape)}"]


_KNOWN_FIELDS = {"gradient", "spec", "data", "kernel", "data_steps", "kernel_steps", "conv", "post_steps", "shape",
                 "method", "reason"}  # method, reason: which formulation and why (text only)


def plan_code(plan: Any, out: str, shapes: dict[str, Shape]) -> list[str]:
    """The body lines computing one gradient into `out`, mirroring fwdconv.execute."""
    for f in dataclasses.fields(plan):
        if f.name not in _KNOWN_FIELDS and getattr(plan, f.name):
            raise NotImplementedError(f"Recipe.to_python: plan field {f.name!r} of {type(plan).__name__} has no "
                                      f"code template")
    lines = [f"# {plan.gradient}: conv of {plan.data} with {plan.kernel} as the kernel"]
    if plan.conv is None:
        return [*lines, f"{out} = grad_output.new_zeros({tuple(plan.shape)})  # empty sum (batch 0)"]
    names = {"data": "t", "kernel": "k"}
    for role, steps in (("data", plan.data_steps), ("kernel", plan.kernel_steps)):
        v, src = names[role], getattr(plan, role)
        lines.append(f"{v} = {src}  # {shapes[src]}")
        shape = shapes[src]
        for step in steps:
            lines += step_code(step, v, shape)
            shape = tuple(step.shape)
    lines += _conv_code(plan.conv, out, "t", "k")
    shape = tuple(plan.conv.shape)
    for step in plan.post_steps:
        lines += step_code(step, out, shape)
        shape = tuple(step.shape)
    return lines


def _reference_lines(spec: ConvSpec) -> list[str]:
    """torch's own conv for the spec, with explicit padding or cropping where torch has no argument for it."""
    n = spec.n
    if not spec.transposed:
        return [f"x_pad = F.pad(x, {_flat(spec.padding)})  # padding (lo, hi) = {spec.padding}",
                f"y = F.conv{n}d(x_pad, w, b, stride={spec.stride}, padding=0, dilation={spec.dilation}, "
                f"groups={spec.groups})"]
    crop = [(-lo, -hi) for lo, hi in spec.padding_excess]
    return [f"y = F.conv_transpose{n}d(x, w, b, stride={spec.stride}, padding={spec.symmetric_padding}, "
            f"output_padding={spec.output_padding}, groups={spec.groups}, dilation={spec.dilation})",
            f"y = F.pad(y, {_flat(crop)})  # asymmetric padding {spec.padding}: crop the excess"]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line if line else "" for line in lines]


def script(recipe: Recipe) -> str:
    """The whole standalone script for a recipe."""
    spec = recipe.spec
    shapes = recipe._start_shapes()
    body: list[str] = []
    for name, plan in recipe.plans.items():
        body += [*plan_code(plan, name, shapes), ""]
    dims = (0, *range(2, spec.n + 2))
    body += [f"grad_bias = grad_output.sum(dim={dims})  # ({spec.out_channels},)",
             'return {"grad_input": grad_input, "grad_weight": grad_weight, "grad_bias": grad_bias}']
    ref = ["x = input.detach().requires_grad_()", "w = weight.detach().requires_grad_()",
           f"b = input.new_zeros({spec.out_channels}, requires_grad=True)",
           *_reference_lines(spec),
           "gx, gw, gb = torch.autograd.grad(y, (x, w, b), grad_output)",
           'return {"grad_input": gx, "grad_weight": gw, "grad_bias": gb}']
    rand = [f"    {name} = torch.randn({_dims(shape)}, dtype=torch.float64, device=DEVICE)"
            for name, shape in shapes.items()]
    unbatched = "  (the recipe works on batched tensors; N=1 stands for unbatched)" if spec.unbatched else ""
    return "\n".join([
        f'"""Backward of {spec.describe()} with forward operations only.{unbatched}',
        "",
        "Generated by convgrad.explain(...).to_python(); needs only torch. recipe_grads uses F.pad, F.conv*d,",
        "flip and reshape/permute; torch autograd runs only in autograd_grads, the final check.",
        '"""',
        "import torch",
        "import torch.nn.functional as F",
        "",
        'DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # every tensor of main() is created on it',
        "",
        "",
        "def recipe_grads(input, weight, grad_output):",
        *_indent(body),
        "",
        "",
        "def autograd_grads(input, weight, grad_output):",
        *_indent(ref),
        "",
        "",
        "def main():",
        "    torch.manual_seed(0)",
        *rand,
        "    ours = recipe_grads(input, weight, grad_output)",
        "    expected = autograd_grads(input, weight, grad_output)",
        "    for name, value in ours.items():",
        "        torch.testing.assert_close(value, expected[name], msg=lambda m, n=name: f'{n}: {m}')",
        '    print("recipe matches torch autograd:", ", ".join(ours))',
        "",
        "",
        'if __name__ == "__main__":',
        "    main()",
        "",
    ])
