"""The fft backend's cost model (which layers auto lets it race) and its normwise error bound (``convgrad check``)."""

from __future__ import annotations

import math

import torch

from convgrad.backends.fft import sizing
from convgrad.spec import ConvSpec

__all__ = ["BOUND_UNITS", "MIN_TAPS", "estimate_flops", "normwise_bound", "worth_trying"]

# auto does not try fft below this many taps (a 7x7 kernel has 49): on the large suite's 3x3 and 7x7 layers another
# backend beat it (benchmarks/results/large_kernels.md, `python benchmarks/large_kernels.py --threads 2`)
MIN_TAPS = 64


# ---- the cost model -------------------------------------------------------------------------------------------
def estimate_flops(spec: ConvSpec) -> tuple[float, float]:
    """(fft, direct): estimated flops of both gradients by the convolution theorem and by direct sums.

    A real transform of V = prod(L) points costs about 2.5 V log2 V flops, a complex multiply-add per bin 8;
    grad_input transforms y, the kernels and (inverse) x's phases, grad_weight x's phases, y and (inverse)
    the kernels; the direct sums cost 2 macs per gradient.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> fft, direct = estimate_flops(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15,
        ...                                                   groups=256))
        >>> direct / fft > 4
        True
    """
    dims = sizing.phases(spec)
    p = sizing.phase_count(spec)
    volume = math.prod([d.size for d in dims])
    bins = sizing.bins(spec)
    n, cx, cy, cxg = spec.batch, spec.x_channels, spec.y_channels, spec.x_group_channels
    transforms = 2 * (n * cy + n * cx * p) + 2 * cy * cxg * p
    products = 2 * n * cy * cxg * p * bins
    return 2.5 * volume * math.log2(max(volume, 2)) * transforms + 8.0 * products, 4.0 * spec.macs()


def worth_trying(spec: ConvSpec) -> bool:
    """Whether fft can beat the direct sums on this layer: at least MIN_TAPS taps, and fewer estimated flops.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> worth_trying(ConvSpec.from_shapes((8, 64, 56, 56), (64, 64, 3, 3), padding=1))
        False
        >>> worth_trying(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256))
        True
    """
    if spec.taps < MIN_TAPS or spec.batch == 0:
        return False
    fft, direct = estimate_flops(spec)
    return fft < direct


# ---- the error bound ------------------------------------------------------------------------------------------
# Roundings per transform level (Higham's eta, about 6u with exact twiddles) times the three transforms of a
# product, plus the per-bin product and its sum: the docs' "Numerics" page derives it.
BOUND_UNITS = 20.0


def normwise_bound(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                   dtype: torch.dtype) -> dict[str, float]:
    """The computation's part of the bound on ``||ours - ref||_2`` of fft's grad_input and grad_weight (the judge
    adds the last rounding, u ||ref||_2), for data already rounded to ``dtype``.

    One product through transforms of V = prod(L) points errs by at most c u_c log2(V) ||a||_2 ||b||_1 in the
    2-norm (Higham 24.1 for each transform; ||IFFT(D B)||_2 <= ||D||_2 ||B||_inf / sqrt(V) <= ... ||b||_1), and
    a gradient is a sum of such products over its contraction, so::

        ||ours - ref||_2 <= u ||ref||_2 + BOUND_UNITS u_c log2(V) sum_(n, a, b) ||a_nb||_2 ||b_ab||_1

    with u the unit roundoff of ``dtype`` (the last rounding), u_c that of the dtype computed in (float32 for
    half precision). Entry-wise bounds do not hold for FFTs: a large entry's error spreads over every bin.

    Args:
        spec: the configuration; input, weight, grad_output: batched, float64 or complex128, rounded to dtype.
        dtype: the dtype the backend computed in.

    Returns:
        ``{"grad_input": float, "grad_weight": float}``.

    Source: Higham, *Accuracy and Stability of Numerical Algorithms* (2002), section 24.1; the docs' "Numerics" page.
    """
    x, y = (grad_output, input) if spec.transposed else (input, grad_output)
    g, n = spec.groups, spec.batch
    a, b = spec.y_group_channels, spec.x_group_channels
    x2 = x.abs().reshape(n, g, b, math.prod(spec.x_size)).norm(dim=-1)  # (N, g, B0)
    y2 = y.abs().reshape(n, g, a, math.prod(spec.y_size)).norm(dim=-1)  # (N, g, A)
    y1 = y.abs().reshape(n, g, a, math.prod(spec.y_size)).sum(-1)  # (N, g, A)
    w1 = weight.abs().reshape(g, a, b, spec.taps).sum(-1)  # (g, A, B0)
    gi = torch.einsum("ngb,gab->", x2, w1) if spec.transposed else torch.einsum("nga,gab->", y2, w1)
    gw = torch.einsum("ngb,nga->", x2, y1)
    computed = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    volume = math.prod(d.size for d in sizing.phases(spec))
    scale = BOUND_UNITS * torch.finfo(computed).eps / 2 * math.log2(max(2, volume))
    return {"grad_input": float(scale * gi), "grad_weight": float(scale * gw)}
