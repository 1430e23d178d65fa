"""Per-sample weight gradients and their squared norms by the convolution theorem (``convgrad.per_sample``'s "fft").

Per sample n, group g and frequency bin f (the notation of ``convgrad.backends.fft``: x's live phases as B
channels per group, y's A channels per group, ~Y(f) = conj(Y(f)) the transform of the reversed y):
    W[n, a, b](f) = ~Y[n, a](f) X[n, b](f)        [a] [b] -> [a, b]: an outer product per bin, no sum over n
then, as in grad_weight's plan (``plan(spec, "grad_weight")``, whose transform sizes and phases it uses), the
inverse transform, the first Q lags and each tap read from its slot, per sample. No im2col of T columns: a
depthwise 31x31 layer on 28x28 costs 3 transforms of 45x48 points per (sample, channel), not 961 x 784 multiply-adds.

Work goes in chunks of (groups, samples, y channels) (``chunking.per_sample_chunks``) holding about a quarter
of the layer's x and y, at least ``chunking.CHUNK_MIN_REALS`` reals (the backend's budget). ``sq_norms`` reduces
each chunk as it comes, so norms never hold N x weight: their peak stays within the layer's plain backward
(benchmarks/per_sample_memory.py). Real dtypes only; half precision is computed in float32.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft import transforms as tf
from convgrad.backends.fft.cost import MIN_TAPS
from convgrad.backends.fft.plans import plan
from convgrad.backends.planning import planned
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import chunk_ranges
from convgrad.tensor_ops import sliced

__all__ = ["estimate_flops", "sq_norms", "weight_grads", "worth_trying"]

Block = tuple[slice, slice, slice]  # samples, groups, y channels within each group


def _blocks(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> Iterator[tuple[Block, torch.Tensor]]:
    """Each chunk's per-sample gradients (n', g', a', C_x/g, *k) with its (samples, groups, channels) slices."""
    p = planned(plan, spec, "grad_weight")
    dims, sizes, nd = p.dims, p.sizes, spec.n
    a, b0, b = p.group_channels
    q = tuple(d.taps for d in dims)
    gc, nc, ac = chunking.per_sample_chunks(spec, p.phase_count, max(chunking.CHUNK_MIN_REALS, spec.side_elements // 4))
    for g0, g1 in chunk_ranges(spec.groups, gc):
        for n0, n1 in chunk_ranges(spec.batch, nc):
            n, g = n1 - n0, g1 - g0
            part = sliced(x, [slice(n0, n1), slice(g0 * b0, g1 * b0)], 0)  # (n', g'*B0, *i)
            xf = tf.forward_transform(tf.to_phases(part, dims, spec.stride), sizes, p.phase_zeros)  # (n', g'*B, *bins)
            bins = xf.shape[2:]
            xf = xf.reshape(n, g, 1, b, -1)  # (n', g', 1, B, F)
            part = sliced(y, [slice(n0, n1), slice(g0 * a, g1 * a)], 0)  # (n', g'*A, *o)
            yf = tf.reversed_spectrum(tf.forward_transform(part, sizes), nd, True).reshape(n, g, a, 1, -1)
            for a0, a1 in chunk_ranges(a, ac):
                wf = sliced(yf, [slice(a0, a1)], 2) * xf  # (n', g', a', B, F): per sample, no sum over n
                wf = wf.reshape(n * g * (a1 - a0), b, *bins)  # (n'g'a', B, *bins)
                wq = tf.inverse_transform(wf, sizes, True, p.cuts_to(q))  # (n'g'a', B, *Q)
                taps = tf.read_taps(wq, dims, b0)  # (n'g'a', B0, *k)
                yield (slice(n0, n1), slice(g0, g1), slice(a0, a1)), taps.reshape(n, g, a1 - a0, b0, *spec.kernel_size)


def _computed(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Half precision in float32 (FFT libraries lack it on most sizes), as the backend's ``execute``."""
    if x.dtype in (torch.float16, torch.bfloat16):
        return x.float(), y.float()
    return x, y


def weight_grads(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-sample weight gradients by the convolution theorem, written chunk by chunk into one result.

    Args:
        spec: the layer (forward geometry); x ``(N, C_x, *i)`` and y ``(N, C_y, *o)``: its two sides (a forward
            conv's input and grad_output, a transposed conv's grad_output and input), real, plain tensors.

    Returns:
        ``(N, C_y, C_x/g, *k)`` (``spec.weight_shape`` per sample), x's dtype; summed over dim 0 it is grad_weight.

    Raises:
        Nothing a user can cause: the per-sample entry points validate the spec and tensors first.

    The formula: grad_weight's product per frequency bin (docs/derivation.md, "The convolution theorem"), kept per
    sample instead of summed over n.

    Examples:
        >>> import torch
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((3, 4, 20), (4, 1, 9), padding=4, groups=4)
        >>> x, y = torch.randn(spec.x_shape, dtype=torch.float64), torch.randn(spec.y_shape, dtype=torch.float64)
        >>> gw = weight_grads(spec, x, y)
        >>> one = torch.nn.grad.conv1d_weight(x[1:2], (4, 1, 9), y[1:2], padding=4, groups=4)
        >>> gw.shape, torch.allclose(gw[1], one, atol=1e-12)
        (torch.Size([3, 4, 1, 9]), True)
    """
    dtype = x.dtype
    x, y = _computed(x, y)
    a = spec.y_group_channels
    out = x.new_empty(spec.batch, spec.groups, a, *spec.weight_shape[1:])  # (N, g, A, C_x/g, *k)
    for (n, g, c), part in _blocks(spec, x, y):
        out[n, g, c] = part
    return out.view(spec.batch, *spec.weight_shape).to(dtype)  # (N, C_y, C_x/g, *k)


def sq_norms(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Squared norms of the per-sample weight gradients, each chunk reduced as it comes (never N x weight).

    Args:
        spec, x, y: as ``weight_grads``.

    Returns:
        ``(N,)``, in float32 for half precision, else x's dtype.

    Raises:
        Nothing a user can cause (as ``weight_grads``).

    Examples:
        >>> import torch
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((3, 4, 20), (4, 1, 9), padding=4, groups=4)
        >>> x, y = torch.randn(spec.x_shape, dtype=torch.float64), torch.randn(spec.y_shape, dtype=torch.float64)
        >>> torch.allclose(sq_norms(spec, x, y), weight_grads(spec, x, y).flatten(1).square().sum(1))
        True
    """
    x, y = _computed(x, y)
    out = x.new_zeros(spec.batch)
    for (n, _, _), part in _blocks(spec, x, y):
        out[n] += torch.linalg.vector_norm(part.flatten(1), dim=1).square()  # no squared copy of the chunk
    return out


def estimate_flops(spec: ConvSpec) -> float:
    """Estimated flops of the per-sample weight gradients by the convolution theorem (the per-sample cost model).

    A real transform of V = prod(L) points costs about 2.5 V log2 V flops, a complex product per bin 6: per sample
    x's live phases (C_x P) and y (C_y) are transformed, and each of its C_y (C_x/g) P products inverted.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256)
        >>> round(spec.macs() / (estimate_flops(spec) / 2))  # direct MACs per fft multiply-add
        8
    """
    dims = sizing.phases(spec)
    p = sizing.phase_count(spec)
    volume = math.prod([d.size for d in dims])
    bins = sizing.bins(spec)
    n, cx, cy = spec.batch, spec.x_channels, spec.y_channels
    products = n * cy * spec.x_group_channels * p
    transforms = n * (cx * p + cy) + products
    return 2.5 * volume * math.log2(max(volume, 2)) * transforms + 6.0 * products * bins


def worth_trying(spec: ConvSpec) -> bool:
    """Whether the per-sample cost model should consider fft at all: kernels of at least MIN_TAPS taps (below, the
    transforms cost more than the direct sums on any layer; ResNets and ConvNeXts never time it).

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> def layer(k): return ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, k, k), padding=k // 2, groups=64)
        >>> worth_trying(layer(7)), worth_trying(layer(9))   # 49 taps, 81 taps
        (False, True)
    """
    return spec.taps >= MIN_TAPS and spec.batch > 0
