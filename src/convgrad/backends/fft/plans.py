"""The fft backend's plans: from a ``ConvSpec`` (shapes only) the steps of one result, which ``explain`` shows.

A plan names its kind (KINDS: which side is computed from which), the polyphase split of every dim
(``ConvSpec.fft_phases``), the chunks (groups, samples) and its steps: pad, phases, taps, transform, product,
inverse, crop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec, FftDim

__all__ = ["CHUNK_MIN_REALS", "KINDS", "FftPlan", "FftStep", "plan"]

Shape = tuple[int, ...]
KINDS = ("y_from_x", "x_from_y", "w_from_xy")
# One chunk's spectra hold about max(CHUNK_MIN_REALS, a quarter of the layer's x and y elements) reals: with the
# inverse transform and the result beside them, a backward's peak stays near native's (benchmarks/large_kernels.py).
CHUNK_MIN_REALS = 2**18


@dataclass(frozen=True)
class FftStep:
    """One step of an fft plan: its name (pad, phases, transform, product, inverse, crop, taps), what it does,
    and the shape of the tensor after it."""

    name: str
    text: str
    shape: Shape

    def describe(self) -> str:
        return f"{self.name}: {self.text} -> {self.shape}"


@dataclass(frozen=True)
class FftPlan:
    """The plan of one result (``gradient``: grad_input, grad_weight or output) by the convolution theorem."""

    gradient: str
    spec: ConvSpec
    kind: str  # one of KINDS
    dims: tuple[FftDim, ...]
    chunks: tuple[int, int]  # (groups, samples) per chunk
    steps: tuple[FftStep, ...]
    method: str = "fft"

    @property
    def phase_count(self) -> int:
        return math.prod(len(d.phases) for d in self.dims)

    @property
    def sizes(self) -> Shape:
        return tuple(d.size for d in self.dims)

    @property
    def group_channels(self) -> tuple[int, int, int]:
        """(A, B0, B): y channels per group, x channels per group, and x channels per group times the live phases."""
        b0 = self.spec.x_channels // self.spec.groups
        return self.spec.y_channels // self.spec.groups, b0, b0 * self.phase_count

    def describe(self) -> str:
        return "\n".join(f"{j + 1}. {s.describe()}" for j, s in enumerate(self.steps))


def plan(spec: ConvSpec, gradient: str) -> FftPlan:
    """The plan of ``gradient`` (grad_input, grad_weight, or output: the convolution itself) for ``spec``.

    Raises:
        ValueError: an unknown gradient.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> p = plan(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256), "output")
        >>> p.kind, p.sizes, [s.name for s in p.steps]
        ('y_from_x', (45, 45), ['pad', 'phases', 'taps', 'transform', 'product', 'inverse', 'crop'])
    """
    kinds = {"grad_input": "y_from_x" if spec.transposed else "x_from_y", "grad_weight": "w_from_xy",
             "output": "x_from_y" if spec.transposed else "y_from_x"}
    if gradient not in kinds:
        raise ConvgradValueError(f"fft.plan: gradient={gradient!r} must be one of {sorted(kinds)}")
    kind, dims = kinds[gradient], spec.fft_phases
    p = math.prod(len(d.phases) for d in dims)
    chunks = spec.fft_chunks(p, max(CHUNK_MIN_REALS, spec.side_elements // 4))
    return FftPlan(gradient, spec, kind, dims, chunks, _steps(spec, kind, dims, p))


def _steps(spec: ConvSpec, kind: str, dims: tuple[FftDim, ...], p: int) -> tuple[FftStep, ...]:
    n, cx, cy, g = spec.batch, spec.x_channels, spec.y_channels, spec.groups
    q, sizes = tuple(d.taps for d in dims), tuple(d.size for d in dims)
    phases = tuple(d.phases for d in dims)
    x_steps = (FftStep("pad", f"pad x by {tuple(d.transform_pads for d in dims)} (negative = crop) to stride * L rows",
                       (n, cx, *(s * r for s, r in zip(spec.stride, sizes)))),
               FftStep("phases", f"split x into the live phases {phases} of stride {spec.stride}, as channels",
                       (n, cx * p, *sizes)))
    w_steps = (FftStep("taps", f"place each tap t at slot (phase, t*d div s) of a {q} kernel per phase",
                       (cy, cx // g * p, *q)),)
    contraction = f"per bin, {g} groups as a batch dim"
    if kind == "y_from_x":
        return (*x_steps, *w_steps,
                FftStep("transform", f"transform x and the kernel to {sizes} bins (zero-padded)", (n, cx * p, *sizes)),
                FftStep("product", f"Y[n,a] = sum_b X[n,b] W(-f)[a,b], {contraction}", (n, cy, *sizes)),
                FftStep("inverse", "inverse transform", (n, cy, *sizes)),
                FftStep("crop", f"keep the first o = {spec.y_size} rows: the stride-1 correlation", spec.y_shape))
    if kind == "x_from_y":
        return (*w_steps,
                FftStep("transform", f"transform y and the kernel to {sizes} bins (zero-padded)", (n, cy, *sizes)),
                FftStep("product", f"X[n,b] = sum_a Y[n,a] W[a,b], {contraction}", (n, cx * p, *sizes)),
                FftStep("inverse", "inverse transform: the L rows of each phase", (n, cx * p, *sizes)),
                FftStep("phases", "interleave the phases (zeros in those no tap reaches) and crop the pads",
                        spec.x_shape))
    return (*x_steps,
            FftStep("transform", f"transform x and y to {sizes} bins (zero-padded)", (n, cx * p, *sizes)),
            FftStep("product", f"W[a,b] = sum_n Y(-f)[n,a] X[n,b], {contraction}", (cy, cx // g * p, *sizes)),
            FftStep("inverse", "inverse transform", (cy, cx // g * p, *sizes)),
            FftStep("crop", f"keep the first Q = {q} slots: the correlation's lags", (cy, cx // g * p, *q)),
            FftStep("taps", "read each tap t from its slot", spec.weight_shape))
