"""The fft backend's plans: from a ``ConvSpec`` (shapes only) the steps of one result, which ``explain`` shows.

A plan names its kind (KINDS: which side is computed from which), the polyphase split of every dim
(``sizing.phases``), the chunks (groups, samples, and the kernel rows of one group a dense layer's spectra
are split into) and its steps: pad, phases, taps, transform, product, inverse, crop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft.sizing import FftDim
from convgrad.backends.native import weight_scratch
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec, Pair, pad_to_rows

__all__ = ["KINDS", "FftPlan", "FftStep", "plan"]

Shape = tuple[int, ...]
KINDS = ("y_from_x", "x_from_y", "w_from_xy")


@dataclass(frozen=True)
class FftStep:
    """One step of an fft plan: its name (pad, phases, transform, product, inverse, crop, taps), what it does,
    and the shape of the tensor after it."""

    name: str
    text: str
    shape: Shape
    lines: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"{self.name}: {self.text} -> {self.shape}"

    def code(self) -> list[str]:
        """The step's lines of the plan's script (``FftPlan.code``): torch and the package's transforms."""
        return list(self.lines)


@dataclass(frozen=True)
class FftPlan:
    """The plan of one result (``gradient``: grad_input, grad_weight or output) by the convolution theorem."""

    gradient: str
    spec: ConvSpec
    kind: str  # one of KINDS
    dims: tuple[FftDim, ...]
    chunks: tuple[int, int]  # (groups, samples) per chunk
    steps: tuple[FftStep, ...]
    phase_count: int  # P, the live phases: sizing.phase_count, held because execute reads it per chunk
    method: str = "fft"
    rows: int = 0  # kernel rows (y channels of one group) whose spectra are held at once; 0: all of them

    @property
    def row_chunk(self) -> int:
        """The kernel rows per chunk: ``rows``, or all C_y/g when 0. Fewer than all only with one group per chunk."""
        return self.rows or self.spec.y_group_channels

    @property
    def sizes(self) -> Shape:
        return tuple(d.size for d in self.dims)

    def bins(self, real: bool) -> Shape:
        """The frequency bins of a transform of ``sizes``: the last dim halved (+1) for real data (rfftn)."""
        return (*self.sizes[:-1], self.sizes[-1] // 2 + 1) if real else self.sizes

    @property
    def phase_zeros(self) -> tuple[Pair, ...]:
        """Per dim the zero rows (c, e) around each phase's data rows in its L rows (``FftDim.phase_pads``): the pads
        of the phases' transform, and the cuts of x's inverse before the phases are interleaved. A plain property:
        Dynamo cannot trace the lock of a ``functools.cached_property`` (the fft backward under torch.compile)."""
        return tuple(d.phase_pads(s)[1] for d, s in zip(self.dims, self.spec.stride))

    def cuts_to(self, rows: Shape) -> tuple[Pair, ...]:
        """The rows (0, L - r) cut off each dim's L rows to keep its first ``rows``: the inverse's cuts."""
        return tuple(pad_to_rows((0, 0), r, n) for r, n in zip(rows, self.sizes))

    @property
    def group_channels(self) -> tuple[int, int, int]:
        """(A, B0, B): y channels per group, x channels per group, and x channels per group times the live phases."""
        b0 = self.spec.x_group_channels
        return self.spec.y_group_channels, b0, b0 * self.phase_count

    def describe(self) -> str:
        return "\n".join(f"{j + 1}. {s.describe()}" for j, s in enumerate(self.steps))

    def code(self) -> list[str]:
        """A runnable script of the plan for real data, one chunk: it reads ``x`` and ``w`` (y_from_x), ``y`` and
        ``w`` (x_from_y) or ``x`` and ``y`` (w_from_xy) and leaves the result in ``out``."""
        a, _, b = self.group_channels
        n, g = self.spec.batch, self.spec.groups
        head = ["import torch", "from convgrad.backends.fft import transforms as tf",
                "from convgrad.backends.fft.sizing import FftDim", f"dims = {self.dims!r}",
                f"sizes, stride, n, g, A, B = {self.sizes}, {self.spec.stride}, {n}, {g}, {a}, {b}",
                f"bins = {(*self.sizes[:-1], self.sizes[-1] // 2 + 1)}"]
        return head + [line for step in self.steps for line in step.code()]


# pure (a frozen ConvSpec in, a frozen FftPlan out) and read 2-3 times a backward: cached, as fwdconv's plans are;
# the backend calls it through ``planning.planned`` (uncached while torch.compile traces). A ValueError is not cached
@lru_cache(maxsize=512)
def plan(spec: ConvSpec, gradient: str) -> FftPlan:
    """The plan of ``gradient`` (grad_input, grad_weight, or output: the convolution itself) for ``spec``.

    Chunks (``chunking.chunks``) hold about ``chunking.chunk_budget(spec, chunking.CHUNK_MIN_REALS)`` reals of
    spectra; grad_weight's also no more than ``chunking.WEIGHT_SCRATCH_RATIO`` times native's scratch
    (``native.weight_scratch``), at least ``chunking.CHUNK_MIN_REALS`` (``chunking.weight_chunks``).

    Raises:
        ValueError: an unknown gradient.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> p = plan(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256), "output")
        >>> p.kind, p.sizes, [s.name for s in p.steps]
        ('y_from_x', (45, 48), ['pad', 'phases', 'taps', 'transform', 'product', 'inverse', 'crop'])
        >>> uxnet = ConvSpec.from_shapes((1, 48, 48, 48, 48), (48, 1, 7, 7, 7), padding=3, groups=48)
        >>> plan(uxnet, "output").chunks, plan(uxnet, "grad_weight").chunks
        ((10, 1), (2, 1))
    """
    kinds = {"grad_input": "y_from_x" if spec.transposed else "x_from_y", "grad_weight": "w_from_xy",
             "output": "x_from_y" if spec.transposed else "y_from_x"}
    if gradient not in kinds:
        raise ConvgradValueError(f"fft.plan: gradient={gradient!r} must be one of {sorted(kinds)}")
    kind, dims = kinds[gradient], sizing.phases(spec)
    p = sizing.phase_count(spec)
    least = chunking.CHUNK_MIN_REALS
    budget = chunking.chunk_budget(spec, least)
    chunks = chunking.chunks(spec, p, budget)
    if gradient == "grad_weight":  # never more groups or samples than the side's budget gives
        most = chunking.weight_chunks(spec, p, max(least, chunking.WEIGHT_SCRATCH_RATIO * weight_scratch(spec)))
        chunks = (min(chunks[0], most[0]), min(chunks[1], most[1]))
    a, b = spec.y_group_channels, spec.x_group_channels * p
    # a group's kernel spectra over the chunk budget (C_y/g (C_x/g) P F complex) are held a slice of rows at a time,
    # so that fft's peak stays near native's (issue 28's memory target)
    rows, samples = chunking.kernel_rows(tuple(d.size for d in dims), a, b, spec.batch, budget)
    if rows < a:
        chunks = (1, samples)
    bare = FftPlan(gradient, spec, kind, dims, chunks, (), p, rows=rows)
    return replace(bare, steps=_steps(bare))


def _steps(plan: FftPlan) -> tuple[FftStep, ...]:
    spec, kind, dims, p = plan.spec, plan.kind, plan.dims, plan.phase_count
    n, cx, cy, g, nd = spec.batch, spec.x_channels, spec.y_channels, spec.groups, spec.n
    q, sizes, zeros = tuple(d.taps for d in dims), plan.sizes, plan.phase_zeros
    _, b0, b = plan.group_channels
    phases = tuple(d.phases for d in dims)
    whole = tuple(d.phase_pads(s)[0] for d, s in zip(dims, spec.stride))
    rows = tuple(d.whole_rows(s) for d, s in zip(dims, spec.stride))  # M per phase
    pruned = ("pruned on large grids where the data fills few of the rows before the last dim (transforms.PRUNE_FILL): "
              "the last dim first over the data's rows only, then each earlier dim, each padded as it is reached")
    inverse = ("inverse transform and cut, pruned on large grids (transforms.PRUNE_MIN_POINTS): the earlier dims "
               "first, each cut to its kept rows before the next, the last dim on the remaining rows only")
    if nd == 1:  # pruning transforms the earlier dims apart from the last: a 1d grid has none (transforms._pays)
        pruned, inverse = "one real FFT per row", "inverse transform and cut"
    x_steps = (FftStep("pad", f"pad x by {whole} (negative = crop) to stride * M rows, M = {rows} whole rows a phase",
                       (n, cx, *(s * r for s, r in zip(spec.stride, rows))),
                       ("xs = tf.to_phases(x, dims, stride)  # pad, then the phases as channels: (n, C_x*P, *M)",)),
               FftStep("phases", f"split x into the live phases {phases} of stride {spec.stride}, as channels",
                       (n, cx * p, *rows)))
    w_steps = (FftStep("taps", f"place each tap t at slot (phase, t*d div s) of a {q} kernel per phase",
                       (cy, b, *q), ("wp = tf.place_taps(w, dims)  # (C_y, B, *Q)",)),)
    contraction = f"per bin, {g} groups as a batch dim"
    if kind == "y_from_x":
        cuts = plan.cuts_to(spec.y_size)
        return (*x_steps, *w_steps,
                FftStep("transform", f"transform x (each phase padded by {zeros} zero rows) and the kernel to {sizes} "
                        f"bins; {pruned}", (n, cx * p, *sizes),
                        (f"xf = tf.forward_transform(xs, sizes, {zeros}).reshape(n, g, B, -1)  # (n, g, B, F)",
                         f"wf = tf.reversed_spectrum(tf.forward_transform(wp, sizes), {nd}, True)",
                         "wf = wf.reshape(g, A, B, -1)  # (g, A, B, F)")),
                FftStep("product", f"Y[n,a] = sum_b X[n,b] W(-f)[a,b], {contraction}", (n, cy, *sizes),
                        ("yf = tf.y_bins(xf, wf).reshape(n, g * A, *bins)  # (n, C_y, *bins)",)),
                FftStep("inverse", f"{inverse}: cuts {cuts}", spec.y_shape,
                        (f"out = tf.inverse_transform(yf, sizes, True, {cuts})  # (n, C_y, *o)",)),
                FftStep("crop", f"keep the first o = {spec.y_size} rows (the stride-1 correlation): the inverse's cuts",
                        spec.y_shape))
    if kind == "x_from_y":
        return (*w_steps,
                FftStep("transform", f"transform y and the kernel to {sizes} bins (zero-padded); {pruned}",
                        (n, cy, *sizes),
                        ("yf = tf.forward_transform(y, sizes).reshape(n, g, A, -1)  # (n, g, A, F)",
                         "wf = tf.forward_transform(wp, sizes).reshape(g, A, B, -1)  # (g, A, B, F)")),
                FftStep("product", f"X[n,b] = sum_a Y[n,a] W[a,b], {contraction}", (n, cx * p, *sizes),
                        ("xf = tf.x_bins(yf, wf).reshape(n, g * B, *bins)  # (n, C_x*P, *bins)",)),
                FftStep("inverse", f"{inverse}: each phase's M = {rows} rows, its zero rows {zeros} cut",
                        (n, cx * p, *rows),
                        (f"xs = tf.inverse_transform(xf, sizes, True, {zeros})  # (n, C_x*P, *M)",)),
                FftStep("phases", "interleave the phases (zeros in those no tap reaches) and crop the pads",
                        spec.x_shape, (f"out = tf.from_phases(xs, dims, stride, {cx})  # (n, C_x, *i)",)))
    cuts = plan.cuts_to(q)
    return (*x_steps,
            FftStep("transform", f"transform x (each phase padded by {zeros} zero rows) and y to {sizes} bins; "
                    f"{pruned}", (n, cx * p, *sizes),
                    (f"xf = tf.forward_transform(xs, sizes, {zeros}).reshape(n, g, B, -1)  # (n, g, B, F)",
                     f"yf = tf.reversed_spectrum(tf.forward_transform(y, sizes), {nd}, True).reshape(n, g, A, -1)")),
            FftStep("product", f"W[a,b] = sum_n Y(-f)[n,a] X[n,b], {contraction}", (cy, b, *sizes),
                    ("wf = tf.w_bins(xf, yf).reshape(g * A, B, *bins)  # (C_y, B, *bins)",)),
            FftStep("inverse", f"{inverse}: cuts {cuts}", (cy, b, *q),
                    (f"wq = tf.inverse_transform(wf, sizes, True, {cuts})  # (C_y, B, *Q)",)),
            FftStep("crop", f"keep the first Q = {q} slots (the correlation's lags): the inverse's cuts",
                    (cy, b, *q)),
            FftStep("taps", "read each tap t from its slot", spec.weight_shape,
                    (f"out = tf.read_taps(wq, dims, {b0})  # (C_y, C_x/g, *k)",)))
