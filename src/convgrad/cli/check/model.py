"""`convgrad check --model`: every convolution of a user's model, judged on the tensors it really sees.

One float64 pass of the model records, for every call of every convolution, its input and the gradient that
arrives at its output. Each call is then an ordinary configuration for the judge (judge.py): the tensors are
rounded to the checked dtype and every backend is compared with float64 autograd on them, with the same bound as
``--input`` and ``--random``. Errors do not propagate from layer to layer, so each row is one convolution's own.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from convgrad.cli.check.judge import Result, check_gradients
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec

__all__ = ["LayerCheck", "build_model", "check_model", "example_model", "load_factory", "model_fails",
           "output_tensors"]


@dataclass(frozen=True)
class LayerCheck:
    """One call of one convolution of a model: its name, its module in short, its configuration, its Results."""

    name: str
    module: str
    spec: ConvSpec
    results: list[Result]


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


@contextlib.contextmanager
def _on_path(folder: str) -> Iterator[None]:
    """``folder`` first on sys.path while the user's code imports (a console script does not put the cwd there)."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _import(target: str, where: str, command: str) -> Any:
    is_file = where.endswith(".py") or "/" in where or os.sep in where
    if not is_file:
        return importlib.import_module(where)
    path = Path(where)
    if not path.is_file():
        raise ConvgradValueError(f"{command}: --model={target!r}: there is no file {where!r}")
    name = f"_convgrad_model_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConvgradValueError(f"{command}: --model={target!r}: {where!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up there
    spec.loader.exec_module(module)
    return module


def load_factory(target: str, command: str = "check") -> Callable[[], Any]:
    """``"module:factory"`` or ``"path/to/file.py:factory"`` -> the factory, imported with the cwd on sys.path.

    Args:
        target: a module importable from the current directory or sys.path, or a file, then ``:`` and the name of
            a callable that takes no arguments.
        command: the command whose ``--model`` it is, for the messages (default "check").

    Returns:
        The callable; calling it runs the user's code with the file's folder (or the cwd) on sys.path.

    Raises:
        ValueError: a malformed target, a missing file, a module that fails to import, no such callable.

    Examples:
        >>> load_factory("convgrad.cli.check:example_model").__name__
        'example_model'
    """
    where, sep, attr = target.rpartition(":")
    if not sep or not where or not attr.isidentifier():
        raise ConvgradValueError(f"{command}: --model={target!r} must be module:factory or path/to/file.py:factory")
    folder = str(Path(where).resolve().parent) if where.endswith(".py") else os.getcwd()
    try:
        with _on_path(folder):
            module = _import(target, where, command)
    except ValueError:
        raise
    except Exception as err:  # the user's code: any failure to import it is theirs to fix
        raise ConvgradValueError(f"{command}: --model={target!r}: cannot import {where!r} ({_first_line(err)})"
                                 ) from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConvgradValueError(f"{command}: --model={target!r}: {where} has no callable {attr!r}")

    def build() -> Any:
        try:
            with _on_path(folder):
                return factory()
        except Exception as err:
            raise ConvgradValueError(f"{command}: --model={target!r}: {attr}() failed ({_first_line(err)})") from None

    build.__name__ = attr
    return build


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


def build_model(target: str, command: str = "check") -> torch.nn.Module:
    """``load_factory(target, command)()``, refused unless it is a torch.nn.Module.

    Raises:
        ValueError: as ``load_factory``. TypeError: the factory returns something else.

    Examples:
        >>> type(build_model("convgrad.cli.check:example_model")).__name__
        'Sequential'
    """
    model = load_factory(target, command)()
    if not isinstance(model, torch.nn.Module):
        raise ConvgradTypeError(f"{command}: --model={target!r} returned {type(model).__name__}, not a "
                                "torch.nn.Module")
    return model


@contextlib.contextmanager
def model_fails(command: str, target: str, input_shape: tuple[int, ...]) -> Iterator[None]:
    """Any failure of the user's model inside, re-raised as one ValueError naming the model and the input size (a
    wrong input shape, a dtype it cannot run in, ...).

    Examples:
        >>> try:
        ...     with model_fails("check", "m:f", (1, 2)):
        ...         {}["x"]
        ... except ValueError as err:
        ...     print(err)
        check: --model='m:f' fails on --input-shape=1,2 (KeyError: 'x')
    """
    try:
        yield
    except Exception as err:
        raise ConvgradValueError(f"{command}: --model={target!r} fails on --input-shape="
                                 f"{','.join(map(str, input_shape))} ({_first_line(err)})") from None


def output_tensors(out: Any) -> list[torch.Tensor]:
    """Every tensor of a model's output (a tensor, or a tuple/list/dict of them).

    Examples:
        >>> [tuple(t.shape) for t in output_tensors({"a": torch.ones(2), "b": (torch.ones(1, 3), "text")})]
        [(2,), (1, 3)]
    """
    if isinstance(out, torch.Tensor):
        return [out]
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else []
    return [t for v in values for t in output_tensors(v)]


Call = tuple[str, torch.nn.modules.conv._ConvNd, torch.Tensor, list[torch.Tensor]]


def _record(model: torch.nn.Module, x: torch.Tensor, seed: int) -> list[Call]:
    """Run the model forward and backward once; return each conv call's (name, module, input, [grad_output])."""
    calls: list[Call] = []

    def hook(name: str) -> Callable[..., Any]:
        def record(module: Any, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
            grads: list[torch.Tensor] = []
            calls.append((name, module, args[0].detach(), grads))
            if output.requires_grad:
                output.register_hook(lambda g: grads.append(g.detach()))
            return output.clone()  # an in-place op after the conv (ReLU(inplace=True)) then leaves `output` alone
        return record

    convs = [(n or "(model)", m) for n, m in model.named_modules() if isinstance(m, torch.nn.modules.conv._ConvNd)]
    handles = [m.register_forward_hook(hook(n)) for n, m in convs]
    try:
        g = torch.Generator().manual_seed(seed + 1)
        outputs = [out for out in output_tensors(model(x)) if out.requires_grad]
        loss = sum((out * torch.randn(out.shape, generator=g, dtype=out.dtype).to(out.device)).real.sum()
                   for out in outputs)
        if isinstance(loss, torch.Tensor):
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    return calls


def _short(module: torch.nn.modules.conv._ConvNd) -> str:
    """``Conv2d(3, 8, k=3, s=2, p=1)``: the arguments that differ from their defaults, one number per equal tuple."""
    def one(v: Any) -> str:
        return str(v) if isinstance(v, str) else str(v[0]) if len(set(v)) == 1 else "x".join(map(str, v))

    parts = [str(module.in_channels), str(module.out_channels), f"k={one(module.kernel_size)}"]
    for key, value, default in (("s", module.stride, 1), ("p", module.padding, 0), ("d", module.dilation, 1),
                                ("op", module.output_padding, 0)):
        if one(value) != str(default):
            parts.append(f"{key}={one(value)}")
    parts += [f"g={module.groups}"] * (module.groups != 1) + ["bias=False"] * (module.bias is None)
    parts += [f"padding_mode={module.padding_mode}"] * (module.padding_mode != "zeros")
    return f"{type(module).__name__}({', '.join(parts)})"


def _layer(call: Call, fn: str) -> tuple[ConvSpec, torch.Tensor, torch.Tensor]:
    """One recorded call as a configuration and its batched input and grad_output."""
    _, module, x, (gy, *_) = call
    padding: Any = module.padding
    if module.padding_mode != "zeros":  # torch pads the input itself, then convolves with padding 0
        x, padding = F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode), 0
    args = (tuple(x.shape), tuple(module.weight.shape), module.stride, padding, module.dilation, module.transposed)
    output_padding = module.output_padding if module.transposed else 0
    spec = ConvSpec.from_shapes(*args, output_padding, module.groups, fn=fn)
    if spec.transposed and tuple(gy.shape[-spec.n:]) != spec.output_size:  # called with output_size=...
        output_padding = tuple(p + a - b for p, a, b in zip(output_padding, gy.shape[-spec.n:], spec.output_size))
        spec = ConvSpec.from_shapes(*args, output_padding, module.groups, fn=fn)
    return spec, x.reshape(spec.input_shape), gy.reshape(spec.output_shape)


def check_model(target: str, input_shape: tuple[int, ...], backends: list[str] | None = None,
                dtype: torch.dtype = torch.float64, device: torch.device | str | None = None, seed: int = 0,
                progress: Callable[[int, int], None] | None = None) -> list[LayerCheck]:
    """Build ``module:factory()``, record every conv call on random data, judge every backend on each.

    Args:
        target: ``"module:factory"`` or ``"path/to/file.py:factory"``; ``factory()`` returns a torch.nn.Module.
        input_shape: the model's input size, e.g. ``(8, 3, 32, 32)``.
        backends: names to check (default all of ``convgrad.backends()``).
        dtype: the dtype every backend computes in (default float64); the model itself runs in float64.
        device: default CUDA when available, else the CPU.
        seed: seed of the input and of the output's random weighting (default 0).
        progress: called as ``progress(done, total)`` after each conv call is judged (default None).

    Returns:
        One ``LayerCheck`` per conv call in the order they ran; grad_bias only
        for convolutions with a bias.

    Raises:
        ValueError: a malformed target, a module that does not import, a model that fails on ``input_shape``, a
            model without convolutions. TypeError: the factory does not return a torch.nn.Module.

    Source: convgrad/cli/check/judge.py (the reference and the error bound).

    Examples:
        >>> from convgrad.cli.check import check_model
        >>> layers = check_model("convgrad.cli.check:example_model", (2, 3, 16, 16), ["fwdconv"], torch.float16)
        >>> [layer.name for layer in layers], all(r.status == "pass" for c in layers for r in c.results)
        (['0', '3', '5', '7'], True)
    """
    import convgrad
    from convgrad.backends import get_backend
    from convgrad.cli.check.configs import default_device

    fn = "check"
    names = [get_backend(name, fn).name for name in backends or convgrad.backends()]
    model = build_model(target, fn)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    device = default_device(device)
    x = torch.randn(input_shape, generator=torch.Generator().manual_seed(seed), dtype=wide).to(device)
    with model_fails(fn, target, input_shape):
        calls = _record(model.to(device=device, dtype=wide), x.requires_grad_(), seed)
    calls = [call for call in calls if call[3]]  # a conv whose output reaches no loss has no gradient to check
    if not calls:
        raise ConvgradValueError(f"check: --model={target!r} has no convolution layers to check")
    counts, seen = Counter(call[0] for call in calls), Counter[str]()
    layers = []
    for i, call in enumerate(calls):
        name, module = call[0], call[1]
        seen[name] += 1
        spec, x_, gy = _layer(call, fn)
        results = [r for r in check_gradients(spec, x_, module.weight, gy, dtype, names, fn)
                   if r.gradient != "grad_bias" or module.bias is not None]
        layers.append(LayerCheck(name if counts[name] == 1 else f"{name} (call {seen[name]})", _short(module), spec,
                                 results))
        if progress is not None:
            progress(i + 1, len(calls))
    return layers
