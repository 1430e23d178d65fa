"""The explicit convolution gradients: conv_backward and the torch.nn.grad-compatible helpers.

Each function validates its arguments into a ``ConvSpec``,
checks the tensors against it (dtype, device, shapes) and hands both to a
backend. Every result is built from differentiable ops (except backend="numpy"),
so gradients of any order follow from autograd. The derivations are in
the docs' "Derivation" page.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from convgrad.backends import Backend, backend_names, get_backend
from convgrad.checks import check_grad_output, check_size, check_tensor, check_tensors
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg, check_bias_sizes, check_output_mask
from convgrad.tensor_ops import bias_grad

__all__ = [
    "conv1d_input",
    "conv1d_weight",
    "conv2d_input",
    "conv2d_weight",
    "conv3d_input",
    "conv3d_weight",
    "conv_backward",
    "conv_bias_grad",
    "conv_input_grad",
    "conv_transpose_input_grad",
    "conv_transpose_weight_grad",
    "conv_weight_grad",
]

Grads = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]

# Register every built-in backend now, at import, not on the first lookup: torch.compile traces that lookup, and
# Dynamo cannot trace the imports it would run (a fresh process's first compiled conv failed on __import__).
backend_names()


def _run(spec: ConvSpec, backend: Backend, grad_output: torch.Tensor, input: torch.Tensor | None,
         weight: torch.Tensor | None, mask: tuple[bool, bool, bool]) -> Grads:
    """Batch the tensors, call the backend for the requested gradients, unbatch the results."""
    if spec.unbatched:
        grad_output = grad_output.unsqueeze(0)  # (1, C_out, *o)
        input = None if input is None else input.unsqueeze(0)  # (1, C_in, *i)
    gi = gw = None
    if mask[0] or mask[1]:
        gi, gw = backend.gradients(spec, grad_output, input, weight, mask[0], mask[1])
    gb = bias_grad(grad_output) if mask[2] else None
    if spec.unbatched and gi is not None:
        gi = gi.squeeze(0)  # (C_in, *i)
    return gi, gw, gb


def conv_backward(
    grad_output: torch.Tensor,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias_sizes: Sequence[int] | None = None,
    stride: IntOrTuple = 1,
    padding: PaddingArg = 0,
    dilation: IntOrTuple = 1,
    transposed: bool = False,
    output_padding: IntOrTuple = 0,
    groups: int = 1,
    output_mask: Sequence[bool] = (True, True, True),
    backend: str = "auto",
) -> Grads:
    """All three gradients of a (transposed) convolution, in the argument order of aten.convolution_backward.

    Args:
        grad_output: ``(N, C_out, *out_spatial)`` or unbatched ``(C_out, *out_spatial)``; floating dtype.
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``, same dtype and device.
        weight: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        bias_sizes: None or ``[C_out]`` (default None); as in aten, grad_bias is returned whenever
            ``output_mask[2]`` is True.
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple, N-tuple of ``(lo, hi)`` pairs, ``'same'`` or ``'valid'`` (default 0).
        transposed: the convolution is transposed (default False).
        output_padding: int or N-tuple, transposed only, each < max(stride, dilation) (default 0).
        groups: int dividing both channel counts (default 1).
        output_mask: three bools (default all True); a masked gradient is None and not computed.
        backend: one of ``convgrad.backends()`` (default ``"auto"``).

    Returns:
        ``(grad_input, grad_weight, grad_bias)`` of shapes ``input.shape``, ``weight.shape`` and ``(C_out,)``.

    Raises:
        TypeError: a non-tensor, a non-floating dtype, mismatched dtypes, a dtype the backend does not compute
            in (complex on most; anything but float32/float64 on ``"numpy"``).
        ValueError: invalid hyperparameters, shapes that do not fit, mismatched devices, an unknown backend;
            with ``"numpy"``: a non-CPU device, tensors that require grad (the results would be detached) or
            that come from a torch.func transform.

    Source: the docs' "Derivation" page (grad_input is a transposed convolution, grad_weight a correlation).

    Examples:
        >>> import torch, convgrad as cg
        >>> x, w = torch.randn(2, 4, 9, 9), torch.randn(6, 2, 3, 3)
        >>> gy = torch.randn(2, 6, 4, 4)
        >>> gi, gw, gb = cg.conv_backward(gy, x, w, [6], stride=2, groups=2, backend="fwdconv")
        >>> gi.shape, gw.shape, gb.shape
        (torch.Size([2, 4, 9, 9]), torch.Size([6, 2, 3, 3]), torch.Size([6]))
    """
    fn = "conv_backward"
    b = get_backend(backend, fn)
    check_tensors(fn, b, grad_output=grad_output, input=input, weight=weight)
    spec = ConvSpec.from_shapes(input.shape, weight.shape, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    check_grad_output(fn, spec, grad_output)
    check_bias_sizes(fn, bias_sizes, spec.out_channels)
    mask = check_output_mask(fn, output_mask)
    return _run(spec, b, grad_output, input, weight, mask)


def conv_input_grad(input_size: Sequence[int], weight: torch.Tensor, grad_output: torch.Tensor,
                    stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1,
                    backend: str = "auto") -> torch.Tensor:
    """grad_input of a forward convolution (N-d generalisation of torch.nn.grad.conv2d_input).

    Args:
        input_size: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; the shape of the conv's input.
        weight: ``(C_out, C_in/groups, *k)``; floating dtype.
        grad_output: ``(N, C_out, *out_spatial)``, same dtype and device as weight.
        stride, padding, dilation, groups, backend: as in ``conv_backward`` (defaults 1, 0, 1, 1, ``"auto"``).

    Returns:
        grad_input of shape ``input_size``.

    Raises:
        TypeError, ValueError: as ``conv_backward``; a ValueError also where ``input_size`` is not an input
            shape that ``weight`` maps to grad_output's shape.

    Source: the docs' "Derivation" page, "grad_input": zero-insert by s, pad by (d(k-1)-p_lo, d(k-1)-p_hi+r),
    convolve with the flipped, channel-swapped kernel.

    Examples:
        >>> import torch, convgrad as cg
        >>> w, gy = torch.randn(4, 3, 3, 3), torch.randn(1, 4, 2, 2)
        >>> cg.conv_input_grad((1, 3, 6, 6), w, gy, stride=2).shape   # r = 1: the last row is never read
        torch.Size([1, 3, 6, 6])
    """
    fn = "conv_input_grad"
    b = get_backend(backend, fn)
    check_tensors(fn, b, weight=weight, grad_output=grad_output)
    spec = ConvSpec.from_shapes(check_size(fn, "input_size", input_size), weight.shape, stride, padding, dilation,
                                False, 0, groups, fn=fn)
    check_grad_output(fn, spec, grad_output)
    return _run(spec, b, grad_output, None, weight, (True, False, False))[0]  # type: ignore[return-value]


def conv_weight_grad(input: torch.Tensor, weight_size: Sequence[int], grad_output: torch.Tensor,
                     stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1,
                     backend: str = "auto") -> torch.Tensor:
    """grad_weight of a forward convolution (N-d generalisation of torch.nn.grad.conv2d_weight).

    Args:
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; floating dtype.
        weight_size: ``(C_out, C_in/groups, *k)``.
        grad_output: ``(N, C_out, *out_spatial)``, same dtype and device as input.
        stride, padding, dilation, groups, backend: as in ``conv_backward`` (defaults 1, 0, 1, 1, ``"auto"``).

    Returns:
        grad_weight of shape ``weight_size``.

    Raises:
        TypeError, ValueError: as ``conv_backward``.

    Source: the docs' "Derivation" page, "grad_weight": the padded input convolved with grad_output as the
    kernel, batch and channels swapped, stride and dilation swapped.

    Examples:
        >>> import torch, convgrad as cg
        >>> x, gy = torch.randn(2, 8, 7, 7), torch.randn(2, 12, 7, 7)
        >>> cg.conv_weight_grad(x, (12, 2, 3, 3), gy, padding=1, groups=4).shape
        torch.Size([12, 2, 3, 3])
    """
    fn = "conv_weight_grad"
    b = get_backend(backend, fn)
    check_tensors(fn, b, input=input, grad_output=grad_output)
    spec = ConvSpec.from_shapes(input.shape, check_size(fn, "weight_size", weight_size), stride, padding, dilation,
                                False, 0, groups, fn=fn)
    check_grad_output(fn, spec, grad_output)
    return _run(spec, b, grad_output, input, None, (False, True, False))[1]  # type: ignore[return-value]


def conv_transpose_input_grad(input_size: Sequence[int], weight: torch.Tensor, grad_output: torch.Tensor,
                              stride: IntOrTuple = 1, padding: PaddingArg = 0, output_padding: IntOrTuple = 0,
                              groups: int = 1, dilation: IntOrTuple = 1, backend: str = "auto") -> torch.Tensor:
    """grad_input of a transposed convolution: a forward convolution of grad_output.

    Args:
        input_size: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; the transposed conv's input shape.
        weight: ``(C_in, C_out/groups, *k)``; floating dtype.
        grad_output: ``(N, C_out, *out_spatial)``, same dtype and device as weight.
        stride, padding, output_padding, groups, dilation: torch.nn.functional.conv_transpose order
            (defaults 1, 0, 0, 1, 1).
        backend: one of ``convgrad.backends()`` (default ``"auto"``).

    Returns:
        grad_input of shape ``input_size``.

    Raises:
        TypeError, ValueError: as ``conv_backward``; ``padding='same'`` is a ValueError (not defined for a
            transposed convolution).

    Source: the docs' "Derivation" page, "transposed convolutions": grad_output convolved (forward) with the
    same weight, stride, padding, dilation and groups, cropped to ``input_size``.

    Examples:
        >>> import torch, convgrad as cg
        >>> w, gy = torch.randn(4, 3, 4, 4), torch.randn(1, 3, 10, 10)
        >>> gi = cg.conv_transpose_input_grad((1, 4, 4, 4), w, gy, stride=2)
        >>> gi.shape, torch.allclose(gi, torch.nn.functional.conv2d(gy, w, stride=2), atol=1e-5)
        (torch.Size([1, 4, 4, 4]), True)
    """
    fn = "conv_transpose_input_grad"
    b = get_backend(backend, fn)
    check_tensors(fn, b, weight=weight, grad_output=grad_output)
    spec = ConvSpec.from_shapes(check_size(fn, "input_size", input_size), weight.shape, stride, padding, dilation,
                                True, output_padding, groups, fn=fn)
    check_grad_output(fn, spec, grad_output)
    return _run(spec, b, grad_output, None, weight, (True, False, False))[0]  # type: ignore[return-value]


def conv_transpose_weight_grad(input: torch.Tensor, weight_size: Sequence[int], grad_output: torch.Tensor,
                               stride: IntOrTuple = 1, padding: PaddingArg = 0, output_padding: IntOrTuple = 0,
                               groups: int = 1, dilation: IntOrTuple = 1, backend: str = "auto") -> torch.Tensor:
    """grad_weight of a transposed convolution: the forward rule with input and grad_output exchanged.

    Args:
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``; floating dtype.
        weight_size: ``(C_in, C_out/groups, *k)``.
        grad_output: ``(N, C_out, *out_spatial)``, same dtype and device as input.
        stride, padding, output_padding, groups, dilation, backend: as in ``conv_transpose_input_grad``.

    Returns:
        grad_weight of shape ``weight_size``.

    Raises:
        TypeError, ValueError: as ``conv_transpose_input_grad``.

    Source: the docs' "Derivation" page, "transposed convolutions": the forward rule (``conv_weight_grad``)
    with input and grad_output exchanged.

    Examples:
        >>> import torch, convgrad as cg
        >>> x, gy = torch.randn(2, 4, 5, 5), torch.randn(2, 6, 11, 11)
        >>> gw = cg.conv_transpose_weight_grad(x, (4, 3, 3, 3), gy, stride=2, groups=2)
        >>> gw.shape, torch.allclose(gw, cg.conv_weight_grad(gy, (4, 3, 3, 3), x, stride=2, groups=2), atol=1e-5)
        (torch.Size([4, 3, 3, 3]), True)
    """
    fn = "conv_transpose_weight_grad"
    b = get_backend(backend, fn)
    check_tensors(fn, b, input=input, grad_output=grad_output)
    spec = ConvSpec.from_shapes(input.shape, check_size(fn, "weight_size", weight_size), stride, padding, dilation,
                                True, output_padding, groups, fn=fn)
    check_grad_output(fn, spec, grad_output)
    return _run(spec, b, grad_output, input, None, (False, True, False))[1]  # type: ignore[return-value]


def conv_bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """grad_bias: grad_output summed over the batch and every spatial dim.

    Args:
        grad_output: batched ``(N, C_out, *spatial)``, floating dtype; float16/bfloat16 accumulate in float32.

    Returns:
        ``(C_out,)``, the dtype of grad_output.

    Raises:
        TypeError: grad_output is not a floating tensor.
        ValueError: grad_output has fewer than 3 dims.

    Source: the docs' "Derivation" page, "grad_bias".

    Examples:
        >>> import torch, convgrad as cg
        >>> cg.conv_bias_grad(torch.ones(2, 3, 4, 5))
        tensor([40., 40., 40.])
    """
    fn = "conv_bias_grad"
    check_tensor(fn, "grad_output", grad_output)
    if grad_output.dim() < 3:
        raise ConvgradValueError(f"{fn}: grad_output.shape={tuple(grad_output.shape)} must be (N, C_out, *spatial)")
    return bias_grad(grad_output)


def _nd(fn: str, n: int, name: str, shape: Sequence[int]) -> None:
    if len(shape) != n + 2:
        raise ConvgradValueError(f"{fn}: {name} has {len(shape)} dims; a {n}d convolution needs {n + 2}")


def _make_nn_grad(n: int) -> tuple[Any, Any]:
    """torch.nn.grad's conv{n}d_input / conv{n}d_weight, with its exact signatures, on the N-d core."""

    def input_fn(input_size: Sequence[int], weight: torch.Tensor, grad_output: torch.Tensor, stride: IntOrTuple = 1,
                 padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1) -> torch.Tensor:
        _nd(f"conv{n}d_input", n, "weight", tuple(getattr(weight, "shape", ())))
        check_size(f"conv{n}d_input", "input_size", input_size)
        return conv_input_grad(input_size, weight, grad_output, stride, padding, dilation, groups)

    def weight_fn(input: torch.Tensor, weight_size: Sequence[int], grad_output: torch.Tensor, stride: IntOrTuple = 1,
                  padding: PaddingArg = 0, dilation: IntOrTuple = 1, groups: int = 1) -> torch.Tensor:
        _nd(f"conv{n}d_weight", n, "weight_size", check_size(f"conv{n}d_weight", "weight_size", weight_size))
        return conv_weight_grad(input, weight_size, grad_output, stride, padding, dilation, groups)

    for f, kind, what in ((input_fn, "input", "grad_input"), (weight_fn, "weight", "grad_weight")):
        f.__name__ = f.__qualname__ = f"conv{n}d_{kind}"
        f.__doc__ = (f"{what} of a {n}d convolution; torch.nn.grad.conv{n}d_{kind}'s signature, backend 'auto'.\n\n"
                     f"See ``convgrad.conv_{kind}_grad`` "
                     "for shapes, dtypes, errors and the source.")
    return input_fn, weight_fn


conv1d_input, conv1d_weight = _make_nn_grad(1)
conv2d_input, conv2d_weight = _make_nn_grad(2)
conv3d_input, conv3d_weight = _make_nn_grad(3)
