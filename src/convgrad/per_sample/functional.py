"""Per-sample gradients of one convolution layer: weight, bias, and the norm of both.

Arguments follow torch.nn.grad (input, weight_size, grad_output, stride, padding,
dilation, groups), then the transposed-conv extras of aten.convolution_backward.
The derivation is in the docs' "Per-sample gradients and DP-SGD" guide; the contractions are listed in
``convgrad.per_sample.methods``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from convgrad.checks import check_grad_output, check_same_kind, check_size, check_tensor
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.per_sample import methods, tuning
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg

__all__ = ["per_sample_bias_grad", "per_sample_grad_norms", "per_sample_weight_grad"]

_METHODS = ("auto", "conv", "unfold", "native", "ghost", "fft")


def _check(fn: str, input: Any, weight_size: Any, grad_output: Any, stride: IntOrTuple, padding: PaddingArg,
           dilation: IntOrTuple, groups: int, transposed: bool, output_padding: IntOrTuple,
           method: str) -> tuple[ConvSpec, torch.Tensor, torch.Tensor]:
    """Validate everything; return the spec and the (x, y) sides of its forward geometry."""
    tensors = {name: check_tensor(fn, name, t, complex_ok=False) for name, t in (("input", input),
                                                                               ("grad_output", grad_output))}
    check_same_kind(fn, tensors)
    if method not in _METHODS:
        raise ConvgradValueError(f"{fn}: method={method!r} must be one of {_METHODS}")
    weight_size = check_size(fn, "weight_size", weight_size)
    spec = ConvSpec.from_shapes(input.shape, weight_size, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    if spec.unbatched:
        raise ConvgradValueError(f"{fn}: input.shape={tuple(input.shape)} has no batch dim; per-sample gradients need "
                                 f"(N, C_in, *spatial)")
    check_grad_output(fn, spec, grad_output)
    x, y = (grad_output, input) if spec.transposed else (input, grad_output)
    return spec, x, y


def per_sample_weight_grad(input: torch.Tensor, weight_size: Sequence[int], grad_output: torch.Tensor,
                           stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1,
                           groups: int = 1, transposed: bool = False, output_padding: IntOrTuple = 0,
                           method: str = "auto") -> torch.Tensor:
    """The weight gradient of every sample separately: grad_weight without the sum over the batch.

    Args:
        input: ``(N, C_in, *spatial)``, real floating dtype.
        weight_size: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        grad_output: ``(N, C_out, *out_spatial)``, same dtype and device as input.
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple, N-tuple of ``(lo, hi)`` pairs, ``'same'`` or ``'valid'`` (default 0).
        groups: int dividing both channel counts (default 1).
        transposed: the layer is a transposed convolution (default False).
        output_padding: int or N-tuple, transposed only (default 0).
        method: ``"unfold"`` (im2col + one batched GEMM per group), ``"conv"`` (a grouped convolution
            with the batch folded into the groups), ``"native"`` (PyTorch's weight-gradient kernel once, on the batch
            folded into the groups, as torch.func's vmap does; fast on layers with many positions, see
            ``convgrad.per_sample.methods``), ``"fft"`` (the convolution theorem: one product per sample and
            frequency bin, no im2col; fast on large kernels, ``convgrad.backends.fft.per_sample``) or ``"auto"``
            (default: the
            fastest, timed once per layer configuration on the batch, as ``backend="auto"`` times backends; with
            ``CONVGRAD_AUTOTUNE=fixed`` the cost model of
            ``per_sample_grad_norms``). ``"ghost"`` computes norms
            only and is refused here.

    Returns:
        ``(N, *weight_size)``, contiguous; summed over dim 0 it equals ``convgrad.conv_weight_grad``.

    Raises:
        TypeError: a non-tensor or a non-real-floating dtype, mismatched dtypes.
        ValueError: invalid hyperparameters, shapes that do not fit, no batch dim, an unknown method or "ghost".

    Source: the docs' "Per-sample gradients and DP-SGD" guide;
    the grouped-conv form is the fwdconv weight-gradient plan
    (DESIGN.md) with the batch folded into the groups instead of being summed.

    Examples:
        >>> import torch, convgrad as cg
        >>> x, gy = torch.randn(5, 4, 8, 8), torch.randn(5, 6, 4, 4)
        >>> gw = cg.per_sample_weight_grad(x, (6, 2, 3, 3), gy, stride=2, padding=1, groups=2)
        >>> gw.shape
        torch.Size([5, 6, 2, 3, 3])
        >>> torch.allclose(gw.sum(0), cg.conv_weight_grad(x, (6, 2, 3, 3), gy, stride=2, padding=1, groups=2),
        ...                atol=1e-4)
        True
    """
    fn = "per_sample_weight_grad"
    spec, x, y = _check(fn, input, weight_size, grad_output, stride, padding, dilation, groups, transposed,
                        output_padding, method)
    if method == "ghost":
        raise ConvgradValueError(f"{fn}: method='ghost' yields norms only; use per_sample_grad_norms, or method "
                                 f"'unfold', 'conv', 'native', 'fft' or 'auto'")
    with methods.one_layer():
        if method == "auto":
            method = tuning.method_for(spec, x, y, "grads")
        return methods.weight_grad(spec, x, y, method)


def per_sample_bias_grad(grad_output: torch.Tensor) -> torch.Tensor:
    """The bias gradient of every sample: grad_output summed over its spatial dims only.

    Args:
        grad_output: ``(N, C_out, *spatial)``, real floating dtype; half precision accumulates in float32.

    Returns:
        ``(N, C_out)``, the dtype of grad_output.

    Raises:
        TypeError: grad_output is not a real floating tensor.
        ValueError: grad_output has fewer than 2 dims.

    Source: the docs' "Per-sample gradients and DP-SGD" guide ("bias").

    Examples:
        >>> import torch, convgrad as cg
        >>> cg.per_sample_bias_grad(torch.ones(2, 3, 4, 5))
        tensor([[20., 20., 20.],
                [20., 20., 20.]])
    """
    fn = "per_sample_bias_grad"
    if not isinstance(grad_output, torch.Tensor) or not grad_output.is_floating_point():
        raise ConvgradTypeError(f"{fn}: grad_output must be a real floating torch.Tensor, got "
                                f"{getattr(grad_output, 'dtype', type(grad_output).__name__)}")
    if grad_output.dim() < 2:
        raise ConvgradValueError(f"{fn}: grad_output.shape={tuple(grad_output.shape)} must be (N, C_out, *spatial)")
    dims = list(range(2, grad_output.dim()))
    if not dims:
        return grad_output.clone()
    if grad_output.dtype in (torch.float16, torch.bfloat16):
        return grad_output.sum(dims, dtype=torch.float32).to(grad_output.dtype)
    return grad_output.sum(dims)


def per_sample_grad_norms(input: torch.Tensor, weight_size: Sequence[int], grad_output: torch.Tensor,
                          stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1,
                          groups: int = 1, transposed: bool = False, output_padding: IntOrTuple = 0,
                          bias: bool = True, method: str = "auto") -> torch.Tensor:
    """The L2 norm of each sample's whole layer gradient (weight, and bias if present), exactly.

    "ghost" never forms a per-sample gradient: with U = im2col(x) per group,
    ``|gw[n]|² = Σ_g ⟨y[n]ᵀ y[n], U[n]ᵀ U[n]⟩``, one pair of P×P Gram matrices per group
    (summing the Gram matrices over groups first, as BackPACK's BatchL2Grad does, adds the
    cross-group terms and is wrong). "auto" times the methods once per layer configuration on a
    slice of the batch (``convgrad.per_sample.tuning``; a method whose multiply-adds below are over
    3x the cheapest, 4x beside "fft", is never run) and takes the fastest; with ``CONVGRAD_AUTOTUNE=fixed`` it follows
    the cost model below, with P = prod(out positions of the small side), T = prod(k), g = groups
    and C_x, C_y the channels of the big and small side (the input and output channels of a
    forward conv):

    - time: materialising costs ``N·P·C_y·C_x·T/g`` MACs, the ghost norm ``N·P²·(C_y + C_x·T)``;
      "ghost" is chosen iff ``P·g·(C_y + C_x·T) < C_y·C_x·T``, which also makes its memory
      ``N·g·P²`` smaller than the gradients' ``N·C_y·C_x·T/g``.
    - otherwise the gradients are materialised, chunk by chunk of the batch so that scratch space
      stays under 2^20 elements (``methods.CHUNK_ELEMENTS``): "unfold" copies ``N·C_x·T·P`` elements into an
      im2col buffer and runs GEMMs whose output tile per (sample, group) is ``(C_y/g)×(C_x·T/g)``; when that tile has
      fewer than 64 entries (depthwise-like layers, where such GEMMs are inefficient) "conv" is
      chosen instead: one grouped convolution, no im2col buffer. "native" (PyTorch's weight-gradient
      kernel on the batch folded into the groups) is measured by "auto" too, but never chosen by this cost model.
    - "fft" (kernels of at least 64 taps only): the per-sample gradients by the convolution theorem, chunk by chunk
      over samples, groups and channels, each chunk's squares summed as it comes, so the norms never hold
      ``N·C_y·C_x·T/g``; chosen where its estimated multiply-adds (``convgrad.backends.fft.per_sample``) are fewer
      than the others' (a 31x31 depthwise layer on 28x28: about 9x fewer than materialising, while "unfold" and
      "ghost" would copy 961 times the input per sample).

    Args:
        input, weight_size, grad_output, stride, padding, dilation, groups, transposed, output_padding:
            as ``per_sample_weight_grad``.
        bias: include the bias gradient ``grad_output`` summed over space (default True).
        method: ``"auto"`` (default), ``"ghost"``, ``"unfold"``, ``"conv"``, ``"native"`` or ``"fft"``.

    Returns:
        ``(N,)``, the dtype of input; half precision accumulates the squares in float32, so a norm is finite
        wherever it fits the dtype.

    Raises:
        TypeError, ValueError: as ``per_sample_weight_grad``
            (an unknown method included).

    Source: the docs' "Per-sample gradients and DP-SGD" guide;
    Goodfellow, "Efficient per-example gradient computations" (2015);
    Li et al., "Large language models can be strong differentially private learners" (ICLR 2022).

    Examples:
        >>> import torch, convgrad as cg
        >>> x, gy = torch.randn(3, 4, 6, 6), torch.randn(3, 6, 6, 6)
        >>> ghost = cg.per_sample_grad_norms(x, (6, 2, 3, 3), gy, padding=1, groups=2, method="ghost")
        >>> gw = cg.per_sample_weight_grad(x, (6, 2, 3, 3), gy, padding=1, groups=2)
        >>> full = torch.cat([gw.flatten(1), cg.per_sample_bias_grad(gy)], 1).norm(dim=1)
        >>> torch.allclose(ghost, full, rtol=1e-4)
        True
    """
    fn = "per_sample_grad_norms"
    spec, x, y = _check(fn, input, weight_size, grad_output, stride, padding, dilation, groups, transposed,
                        output_padding, method)
    if not isinstance(bias, bool):
        raise ConvgradTypeError(f"{fn}: bias={bias!r} must be a bool")
    with methods.one_layer():
        if method == "auto":
            method = tuning.method_for(spec, x, y, "norms")
        if method == "ghost":
            sq = methods.ghost_sq_norms(spec, x, y)
        else:
            sq = methods.materialised_sq_norms(spec, x, y, method)
    if bias:
        sq = sq + methods.sq_norms(per_sample_bias_grad(grad_output))
    return sq.sqrt().to(input.dtype)
