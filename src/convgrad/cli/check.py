"""`convgrad check`: verify every backend's gradients against torch autograd, for users.

Three modes::

    convgrad check --input 2,4,9,9 --weight 6,2,3,3 --stride 2 --groups 2 [--padding 1:2,0:1] [--dtype float32]
    convgrad check --model convgrad.cli.check:example_model --input-shape 8,3,32,32 [--backend fwdconv]
    convgrad check --model torchvision.models:resnet18 --input-shape 8,3,224,224
    convgrad check --random 200 --seed 0

The reference is torch autograd through torch's own convolution, in float64 (complex128 for complex
dtypes), on the explicitly padded problem when torch cannot express the padding. The exit status is
1 when any gradient is out of tolerance, 2 on a bad argument (cli.py), 0 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import math
import random
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from convgrad.cli import add_conv_arguments, parse_ints
from convgrad.spec import ConvSpec

__all__ = ["TOLERANCE", "Result", "add_arguments", "check_config", "check_model", "check_random", "example_model",
           "random_config", "reference_grads", "run"]

# (rtol, atol) of each dtype against the float64 reference; the same values as the test suite's TOL
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-9), torch.float32: (2e-4, 2e-5), torch.complex128: (1e-7, 1e-9),
    torch.complex64: (2e-4, 2e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (2e-3, 2e-3),
}
DTYPES = {str(d).removeprefix("torch."): d for d in TOLERANCE}
GRADIENTS = ("grad_input", "grad_weight", "grad_bias")
_F_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_F_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class Result:
    """One compared gradient: who computed it, how far it is from torch autograd, and the verdict."""

    backend: str
    gradient: str
    max_abs: float
    max_rel: float
    status: str  # "pass", "FAIL" or "skip: <why>"

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def compare(backend: str, gradient: str, ours: torch.Tensor, ref: torch.Tensor) -> Result:
    """Max abs error, max relative error (to the reference's largest entry, floored at atol so that a
    gradient of ~0 does not divide by ~0) and pass/fail by TOLERANCE[ours.dtype], element-wise."""
    rtol, atol = TOLERANCE[ours.dtype]
    ref = ref.to(ours.device)
    if ours.shape != ref.shape:
        return Result(backend, gradient, math.inf, math.inf, "FAIL")
    diff = (ours.to(ref.dtype) - ref).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    close = bool(torch.isclose(ours, ref.to(ours.dtype), rtol=rtol, atol=atol, equal_nan=True).all())
    return Result(backend, gradient, max_abs, max_abs / max(scale, atol), "pass" if close else "FAIL")


# ---- one configuration -------------------------------------------------------------------------------------------

def reference_grads(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                    ) -> dict[str, torch.Tensor]:
    """grad_input, grad_weight, grad_bias by torch autograd through F.conv*/F.conv_transpose*, batched tensors."""
    x, w = input.detach().requires_grad_(), weight.detach().requires_grad_()
    b = torch.zeros(spec.out_channels, dtype=x.dtype, device=x.device, requires_grad=True)
    if spec.transposed:  # torch's transposed conv with padding 0, then crop (lo, hi) per dim
        full = _F_CONV_T[spec.n](x, w, b, spec.stride, 0, spec.output_padding, spec.groups, spec.dilation)
        y = full[(..., *(slice(lo, full.shape[2 + j] - hi) for j, (lo, hi) in enumerate(spec.padding)))]
    else:  # F.pad takes the last dim first
        padded = F.pad(x, [v for lo, hi in reversed(spec.padding) for v in (lo, hi)])
        y = _F_CONV[spec.n](padded, w, b, spec.stride, 0, spec.dilation, spec.groups)
    return dict(zip(GRADIENTS, torch.autograd.grad(y, [x, w, b], grad_output)))


def _refusal(backend: str, dtype: torch.dtype) -> str | None:
    from convgrad.backends import get_backend

    if dtype.is_complex and not get_backend(backend).supports_complex:
        return "skip: no complex support"
    return None


def check_config(input_size: Any, weight_size: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                 transposed: bool = False, output_padding: Any = 0, groups: int = 1, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None, backends: list[str] | None = None,
                 seed: int = 0) -> tuple[ConvSpec, list[Result]]:
    """Every gradient of one configuration, by every backend, against torch autograd.

    Args:
        input_size: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``.
        weight_size: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        stride, padding, dilation, transposed, output_padding, groups: as in
            [`convgrad.conv_backward`][convgrad.functional.conv_backward].
        dtype: a dtype of TOLERANCE (default float64).
        device: default CUDA when available, else the CPU.
        backends: names to check (default all of ``convgrad.backends()``).
        seed: seed of the random tensors (default 0).

    Returns:
        The validated ConvSpec and one Result per (backend, gradient).

    Raises:
        ValueError, TypeError: invalid arguments, as
            [`convgrad.conv_backward`][convgrad.functional.conv_backward] raises them.

    Source: tests/helpers.py uses the same reference; docs/numerics.md lists the tolerances.

    Examples:
        >>> from convgrad.cli.check import check_config
        >>> spec, results = check_config((2, 4, 9, 9), (6, 2, 3, 3), stride=2, groups=2, backends=["fwdconv"])
        >>> [(r.gradient, r.status) for r in results]
        [('grad_input', 'pass'), ('grad_weight', 'pass'), ('grad_bias', 'pass')]
    """
    import convgrad
    from convgrad.backends import get_backend

    fn = "check"
    if dtype not in TOLERANCE:
        raise TypeError(f"{fn}: dtype={dtype} must be one of {sorted(DTYPES)}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = ConvSpec.from_shapes(input_size, weight_size, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    g = torch.Generator().manual_seed(seed)
    x, w, gy = (torch.randn(s, generator=g, dtype=wide).to(device) for s in (spec.input_shape, spec.weight_shape,
                                                                              spec.output_shape))
    ref = reference_grads(spec, x, w, gy)
    if spec.unbatched:  # what the user passes: no batch dim
        x, gy, ref["grad_input"] = x[0], gy[0], ref["grad_input"][0]
    names = [get_backend(name, fn).name for name in backends or convgrad.backends()]
    results = []
    for name in names:
        refusal = _refusal(name, dtype)
        if refusal is None:
            try:
                grads = convgrad.conv_backward(gy.to(dtype), x.to(dtype), w.to(dtype), [spec.out_channels],
                                               spec.stride, spec.padding, spec.dilation, spec.transposed,
                                               spec.output_padding, spec.groups, backend=name)
            except (TypeError, ValueError) as err:
                if f"backend={name!r}" not in str(err):  # not a refusal by design (numpy: CPU, float32/64 only)
                    raise
                refusal = "skip: " + str(err).split(": ", 1)[-1].split(";")[0]
        if refusal is not None:
            results += [Result(name, gradient, math.nan, math.nan, refusal) for gradient in GRADIENTS]
            continue
        results += [compare(name, gradient, ours, ref[gradient]) for gradient, ours in zip(GRADIENTS, grads)]
    return spec, results


# ---- random configurations ---------------------------------------------------------------------------------------

def random_config(rng: random.Random) -> dict[str, Any]:
    """One random valid configuration (dims 1-3, forward or transposed, asymmetric/'same' padding, groups)."""
    while True:
        n, transposed = rng.choice((1, 2, 3)), rng.random() < 0.4
        g = rng.choice((1, 1, 2, 3))
        cin, cout = g * rng.randint(1, 3), g * rng.randint(1, 3)
        kernel = tuple(rng.randint(1, 4) for _ in range(n))
        stride, dilation = (tuple(rng.randint(1, 3) for _ in range(n)) for _ in range(2))
        size = tuple(rng.randint(1, 9 if n < 3 else 5) for _ in range(n))
        batch = (rng.randint(0, 3),) if rng.random() < 0.9 else ()
        config: dict[str, Any] = dict(stride=stride, dilation=dilation, groups=g, transposed=transposed)
        if transposed:
            config.update(input_size=(*batch, cin, *size), weight_size=(cin, cout // g, *kernel),
                          padding=tuple(rng.randint(0, 2) for _ in range(n)),
                          output_padding=tuple(rng.randint(0, max(s, d) - 1) for s, d in zip(stride, dilation)))
        else:
            config.update(input_size=(*batch, cin, *size), weight_size=(cout, cin // g, *kernel),
                          padding=rng.choice([tuple((rng.randint(0, 3), rng.randint(0, 3)) for _ in range(n)),
                                              "same", tuple(rng.randint(0, 3) for _ in range(n))]))
        try:
            ConvSpec.from_shapes(config["input_size"], config["weight_size"], stride, config["padding"], dilation,
                                 transposed, config.get("output_padding", 0), g)
        except ValueError:
            continue
        return config


def check_random(count: int, seed: int = 0, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None, backends: list[str] | None = None,
                 progress: Any = None) -> list[tuple[ConvSpec, list[Result]]]:
    """``check_config`` on ``count`` seeded random configurations (``random_config``).

    Args:
        count: number of configurations, >= 1.
        seed: seed of the configurations and of their tensors (default 0).
        dtype, device, backends: as ``check_config``.
        progress: called as ``progress(i)`` after the i-th configuration (default None).

    Returns:
        One ``(spec, results)`` per configuration, in order.

    Raises:
        ValueError: ``count < 1``; TypeError, ValueError: as ``check_config``.

    Source: the property tests in tests/test_fuzz.py sample the same space more widely.

    Examples:
        >>> from convgrad.cli.check import check_random
        >>> checked = check_random(3, seed=1, backends=["fwdconv"])
        >>> len(checked), any(r.failed for _, results in checked for r in results)
        (3, False)
    """
    if count < 1:
        raise ValueError(f"check: --random={count} must be positive")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append(check_config(**random_config(rng), dtype=dtype, device=device, backends=backends, seed=seed + i))
        if progress is not None:
            progress(i + 1)
    return out


# ---- a model -----------------------------------------------------------------------------------------------------

def _load_factory(target: str) -> Any:
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"check: --model={target!r} must be package.module:factory")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"check: --model={target!r}: cannot import {module_name!r} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ValueError(f"check: --model={target!r}: {module_name} has no callable {attr!r}")
    return factory


def example_model() -> torch.nn.Module:
    """A small CNN with the hard cases, for ``convgrad check --model convgrad.cli.check:example_model``.

    Returns:
        ``Sequential`` of a strided conv with a leftover row (r = 1 for odd H, W), a dilated conv, a
        depthwise conv, dropout and a transposed conv; input ``(N, 3, H, W)``.

    Examples:
        >>> from convgrad.cli.check import example_model
        >>> example_model()(torch.randn(2, 3, 16, 16)).shape
        torch.Size([2, 4, 16, 16])
    """
    nn = torch.nn
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=2, dilation=2, bias=False), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Dropout(0.2),
                         nn.ConvTranspose2d(8, 4, 3, stride=2, padding=1, output_padding=1))


def _tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of a model's output (a tensor, or a tuple/list/dict of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [t for v in values for t in _tensors(v)]


def check_model(target: str, input_shape: tuple[int, ...], backend: str = "auto", dtype: torch.dtype = torch.float64,
                device: torch.device | str | None = None, seed: int = 0) -> list[tuple[str, Result]]:
    """Build ``package.module:factory()``, patch a copy, run both on the same data, compare every conv layer.

    Both twins compute in ``dtype`` with the same random input, grad_output and dropout masks, so any
    difference comes from the patched convolutions' backward.

    Args:
        target: ``"package.module:factory"``; ``factory()`` returns a ``torch.nn.Module``.
        input_shape: the model's input size, e.g. ``(8, 3, 32, 32)``.
        backend: the backend the patched twin uses (default ``"auto"``).
        dtype: the dtype of both twins (default float64); device: default CUDA when available, else the CPU.
        seed: seed of the input, grad_output and dropout masks (default 0).

    Returns:
        ``("input", Result)`` for grad_input, then one ``(layer name, Result)`` per conv parameter gradient.

    Raises:
        ValueError: a malformed target, a module that does not import, a model without convolutions.
        TypeError: the factory does not return a torch.nn.Module.

    Source: [`convgrad.patch`][convgrad.nn.patch] (DESIGN.md, "Public API").

    Examples:
        >>> from convgrad.cli.check import check_model
        >>> rows = check_model("convgrad.cli.check:example_model", (2, 3, 16, 16), backend="fwdconv")
        >>> [layer for layer, r in rows if r.gradient == "grad_weight"], all(r.status == "pass" for _, r in rows)
        (['0', '3', '5', '7'], True)
    """
    import convgrad

    model = _load_factory(target)()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check: --model={target!r} returned {type(model).__name__}, not a torch.nn.Module")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reference = model.to(device, dtype)
    patched = convgrad.patch(copy.deepcopy(reference), backend)
    convs = [name for name, m in patched.named_modules() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    if not convs:
        raise ValueError(f"check: --model={target!r} has no convolution layers to check")
    x = torch.randn(input_shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(device)
    grads = []
    for net in (reference, patched):
        inp = x.clone().requires_grad_()
        torch.manual_seed(seed)  # the same dropout masks in both twins
        g = torch.Generator().manual_seed(seed + 1)
        loss = sum((out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(device)).real.sum()
                   for out in _tensors(net(inp)))
        loss.backward()  # type: ignore[union-attr]
        grads.append({"input": inp.grad, **{n: p.grad for n, p in net.named_parameters() if p.grad is not None}})
    ref, ours = grads
    rows = [("input", compare(backend, "grad_input", ours["input"], ref["input"]))]
    for layer in convs:
        for param in ("weight", "bias"):
            key = f"{layer}.{param}" if layer else param
            if key in ours:
                rows.append((layer, compare(backend, f"grad_{param}", ours[key], ref[key])))
    return rows


# ---- the command -------------------------------------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `convgrad check`."""
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--input", type=parse_ints, metavar="N,C,...", help="input size: check one configuration")
    mode.add_argument("--model", metavar="MODULE:FACTORY", help="check every conv of the model a factory builds")
    mode.add_argument("--random", type=int, metavar="N", help="check N random configurations")
    parser.add_argument("--weight", type=parse_ints, metavar="C,C,...", help="weight size (with --input)")
    add_conv_arguments(parser)
    parser.add_argument("--input-shape", type=parse_ints, metavar="N,C,...", help="model input size (with --model)")
    parser.add_argument("--dtype", default="float64", help=f"one of {', '.join(DTYPES)} (default float64)")
    parser.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="backend to check (repeatable; default every backend; 'auto' for --model)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random data and configurations (default 0)")


def _as_tuple(value: Any) -> tuple[int, ...]:
    return (value,) if isinstance(value, int) else tuple(value)


def _fmt(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.2e}"


def _table(title: str, rows: list[tuple[str, ...]], first: tuple[str, ...]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for col in (*first, "max abs err", "max rel err", "result"):
        table.add_column(col, justify="right" if "err" in col else "left")
    for row in rows:
        style = "red" if row[-1] == "FAIL" else ("dim" if row[-1].startswith("skip") else "")
        table.add_row(*row, style=style)
    return table


def _result_row(r: Result) -> tuple[str, str, str]:
    return _fmt(r.max_abs), _fmt(r.max_rel), r.status


def run(args: argparse.Namespace) -> int:
    """Run the chosen check, print its table, return 1 when any gradient failed."""
    from rich.console import Console

    console = Console()
    if args.dtype not in DTYPES:
        raise ValueError(f"check: --dtype={args.dtype!r} must be one of {', '.join(DTYPES)}")
    dtype, common = DTYPES[args.dtype], dict(device=args.device)
    if args.model is not None:
        if args.input_shape is None:
            raise ValueError("check: --model needs --input-shape, e.g. --input-shape 8,3,32,32")
        backend = (args.backend or ["auto"])[-1]
        rows = check_model(args.model, _as_tuple(args.input_shape), backend, dtype, seed=args.seed, **common)
        console.print(_table(f"{args.model} with backend={backend!r}, {args.dtype}, vs the unpatched model",
                             [(layer, r.gradient, *_result_row(r)) for layer, r in rows], ("layer", "gradient")))
        failed = [r for _, r in rows if r.failed]
    elif args.random is not None:
        failed = _run_random(console, args, dtype)
    else:
        if args.weight is None:
            raise ValueError("check: --input needs --weight, e.g. --input 2,4,9,9 --weight 6,2,3,3")
        spec, results = check_config(_as_tuple(args.input), _as_tuple(args.weight), args.stride,
                                     _pairs(args.padding, len(_as_tuple(args.weight)) - 2), args.dilation,
                                     args.transposed, args.output_padding, args.groups, dtype,
                                     backends=args.backend, seed=args.seed, **common)
        console.print(_table(f"{spec.describe()} {args.dtype}", [(r.backend, r.gradient, *_result_row(r))
                                                                 for r in results], ("backend", "gradient")))
        failed = [r for r in results if r.failed]
    console.print(f"[red]{len(failed)} gradient(s) out of tolerance[/red]" if failed
                  else "[green]every gradient within tolerance[/green]")
    return 1 if failed else 0


def _pairs(padding: Any, n: int) -> Any:
    """One lo:hi pair given for a multi-dim conv stands for every dim (as in `convgrad explain`)."""
    if isinstance(padding, tuple) and len(padding) == 1 and isinstance(padding[0], tuple):
        return padding * n
    return padding


def _run_random(console: Any, args: argparse.Namespace, dtype: torch.dtype) -> list[Result]:
    from rich.progress import Progress

    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(f"checking {args.random} random configurations", total=args.random)
        checked = check_random(args.random, args.seed, dtype, args.device, args.backend,
                               progress=lambda i: bar.update(task, completed=i))
    failures = [(spec, r) for spec, results in checked for r in results if r.failed]
    compared = sum(1 for _, results in checked for r in results if not r.status.startswith("skip"))
    console.print(f"{len(checked)} random configurations (seed {args.seed}), {compared} gradients compared, "
                  f"{len(failures)} failed")
    if failures:
        console.print(_table("failures", [(spec.describe(), r.backend, r.gradient, *_result_row(r))
                                          for spec, r in failures[:20]], ("configuration", "backend", "gradient")))
    return [r for _, r in failures]
