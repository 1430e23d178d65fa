"""`convgrad check --input ...` and `--random N`: configurations with seeded random tensors, judged by judge.py."""

from __future__ import annotations

import random
from typing import Any

import torch

from convgrad.cli.check.judge import DTYPES, Result, check_gradients
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec

__all__ = ["check_config", "check_random", "random_config"]


def default_device(device: torch.device | str | None) -> torch.device:
    """The device to check on: the one given, else CUDA when available, else the CPU."""
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def check_config(input_size: Any, weight_size: Any, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
                 transposed: bool = False, output_padding: Any = 0, groups: int = 1, dtype: torch.dtype = torch.float64,
                 device: torch.device | str | None = None, backends: list[str] | None = None,
                 seed: int = 0) -> tuple[ConvSpec, list[Result]]:
    """Every gradient of one configuration, by every backend, against float64 autograd on the same rounded inputs.

    Args:
        input_size: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``.
        weight_size: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        stride, padding, dilation, transposed, output_padding, groups: as in
            ``convgrad.conv_backward``.
        dtype: one of float64 (default), float32, float16, bfloat16, complex128, complex64.
        device: default CUDA when available, else the CPU.
        backends: names to check (default all of ``convgrad.backends()``).
        seed: seed of the random tensors, standard normal (default 0).

    Returns:
        The validated ConvSpec and one Result per (backend, gradient), judged by
        ``check_gradients``.

    Raises:
        ValueError, TypeError: invalid arguments, as
            ``convgrad.conv_backward`` raises them.

    Source: convgrad/cli/check/judge.py (the reference and the error bound).

    Examples:
        >>> from convgrad.cli.check import check_config
        >>> spec, results = check_config((2, 4, 9, 9), (6, 2, 3, 3), stride=2, groups=2, dtype=torch.float16,
        ...                              backends=["fwdconv"])
        >>> [(r.gradient, r.status) for r in results]
        [('grad_input', 'pass'), ('grad_weight', 'pass'), ('grad_bias', 'pass')]
    """
    import convgrad
    from convgrad.backends import get_backend

    fn = "check"
    if dtype not in DTYPES.values():
        raise ConvgradTypeError(f"{fn}: dtype={dtype} must be one of {', '.join(DTYPES)}")
    spec = ConvSpec.from_shapes(input_size, weight_size, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    names = [get_backend(name, fn).name for name in backends or convgrad.backends()]
    wide = torch.complex128 if dtype.is_complex else torch.float64
    g = torch.Generator().manual_seed(seed)
    device = default_device(device)
    x, w, gy = (torch.randn(s, generator=g, dtype=wide).to(device) for s in (spec.input_shape, spec.weight_shape,
                                                                              spec.output_shape))
    return spec, check_gradients(spec, x, w, gy, dtype, names, fn)


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
        raise ConvgradValueError(f"check: --random={count} must be positive")
    rng = random.Random(seed)
    out = []
    for i in range(count):
        out.append(check_config(**random_config(rng), dtype=dtype, device=device, backends=backends, seed=seed + i))
        if progress is not None:
            progress(i + 1)
    return out
