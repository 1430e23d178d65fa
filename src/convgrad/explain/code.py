"""Recipe.to_python: a standalone PyTorch script generated from the fwdconv plan steps.

The script walks the plan: every step writes its own lines (``step.code(var, shape)``: lines that update
``var``, whose shape before the step is ``shape``; a contraction's ``code(out, data, kernel)``). A step
without ``code`` raises NotImplementedError naming it. The generated gradients use forward ops only (F.pad,
F.conv*d, flip, reshape/permute); torch autograd runs only inside ``autograd_grads``, the final check.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from convgrad.backends.fwdconv.plan import commas
from convgrad.explain import fft_view
from convgrad.spec import ConvSpec, Shape
from convgrad.tensor_ops import pad_flat


def _code(step: Any, *args: Any) -> list[str]:
    """The step's own script lines; a step kind without ``code`` fails loudly, naming itself."""
    own = getattr(step, "code", None)
    if not callable(own):
        raise NotImplementedError(f"Recipe.to_python: plan step kind {type(step).__name__!r} ({step.describe()}) "
                                  f"has no code(); give it a code(var, shape) method (plan.Step)")
    return list(own(*args))


_KNOWN_FIELDS = {"gradient", "spec", "data", "kernel", "data_steps", "kernel_steps", "conv", "post_steps", "shape",
                 "method", "reason"}  # method, reason: which formulation and why (text only)


def plan_code(plan: Any, out: str, shapes: dict[str, Shape]) -> list[str]:
    """The body lines computing one gradient into `out`, mirroring fwdconv.execute (fft.execute for fft plans)."""
    if fft_view.is_fft(plan):
        return fft_view.code_lines(plan, out)
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
            lines += _code(step, v, shape)
            shape = tuple(step.shape)
    lines += _code(plan.conv, out, "t", "k")
    shape = tuple(plan.conv.shape)
    for step in plan.post_steps:
        lines += _code(step, out, shape)
        shape = tuple(step.shape)
    return lines


def _reference_lines(spec: ConvSpec) -> list[str]:
    """torch's own conv for the spec, with explicit padding or cropping where torch has no argument for it."""
    n = spec.n
    if not spec.transposed:
        return [f"x_pad = F.pad(x, {pad_flat(spec.padding)})  # padding (lo, hi) = {spec.padding}",
                f"y = F.conv{n}d(x_pad, w, b, stride={spec.stride}, padding=0, dilation={spec.dilation}, "
                f"groups={spec.groups})"]
    crop = tuple((-lo, -hi) for lo, hi in spec.padding_excess)
    return [f"y = F.conv_transpose{n}d(x, w, b, stride={spec.stride}, padding={spec.symmetric_padding}, "
            f"output_padding={spec.output_padding}, groups={spec.groups}, dilation={spec.dilation})",
            f"y = F.pad(y, {pad_flat(crop)})  # asymmetric padding {spec.padding}: crop the excess"]


def _indent(lines: list[str]) -> list[str]:
    return ["    " + line if line else "" for line in lines]


def script(spec: ConvSpec, plans: dict[str, Any], shapes: dict[str, Shape]) -> str:
    """The whole standalone script: the gradients by these plans (``{"grad_input": plan, ...}``) from tensors of
    these shapes (``{"input": shape, ...}``), checked against torch autograd."""
    body: list[str] = []
    for name, plan in plans.items():
        body += [*plan_code(plan, name, shapes), ""]
    dims = (0, *range(2, spec.n + 2))
    body += [f"grad_bias = grad_output.sum(dim={dims})  # ({spec.out_channels},)",
             'return {"grad_input": grad_input, "grad_weight": grad_weight, "grad_bias": grad_bias}']
    ref = ["x = input.detach().requires_grad_()", "w = weight.detach().requires_grad_()",
           f"b = input.new_zeros({spec.out_channels}, requires_grad=True)",
           *_reference_lines(spec),
           "gx, gw, gb = torch.autograd.grad(y, (x, w, b), grad_output)",
           'return {"grad_input": gx, "grad_weight": gw, "grad_bias": gb}']
    rand = [f"    {name} = torch.randn({commas(shape)}, dtype=torch.float64, device=DEVICE)"
            for name, shape in shapes.items()]
    unbatched = "  (the recipe works on batched tensors; N=1 stands for unbatched)" if spec.unbatched else ""
    needs = ("needs torch and convgrad (the fft steps call convgrad.backends.fft.ops); recipe_grads "
             "uses the fft backend's pad, transforms, per-bin products and crops, and") \
        if any(fft_view.is_fft(p) for p in plans.values()) else \
        "needs only torch. recipe_grads uses F.pad, F.conv*d,\nflip and reshape/permute;"
    return "\n".join([
        f'"""Backward of {spec.describe()} with forward operations only.{unbatched}',
        "",
        f"Generated by convgrad.explain(...).to_python(); {needs}",
        "torch autograd runs only in autograd_grads, the final check.",
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
