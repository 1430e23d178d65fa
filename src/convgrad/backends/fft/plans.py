"""The fft backend's plans: from a ``ConvSpec`` (shapes only) the steps of one result, or of both gradients.

``plan`` sizes the chunks (``chunking``) and lists the steps of its kind (KINDS: which side is computed from which):
per chunk of groups, samples and kernel rows, the phases and transforms of the operands, the product per bin, the
sum over chunks, the inverse and its crop (the plan as data: ``program``). The fused backward (``backward_plan``,
``fuse``) is one plan with two outputs, grad_output transformed once per chunk for both products.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache
from typing import Any

from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft.program import FftPlan, FftStep, Loop
from convgrad.backends.native import weight_scratch
from convgrad.errors import ConvgradValueError
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import chunk_ranges

__all__ = ["FUSED_KINDS", "KINDS", "backward_plan", "fuse", "plan", "shares_spectra"]

Shape = tuple[int, ...]
KINDS = ("y_from_x", "x_from_y", "w_from_xy")
FUSED_KINDS = ("both_from_y", "both_from_x")  # a forward conv's backward (grad_output is y), a transposed conv's (x)


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
        ('y_from_x', (45, 48), ['taps', 'result', 'transform', 'transform', 'product', 'inverse', 'write', 'result'])
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
    return _BUILD[kind](bare)


def shares_spectra(pi: FftPlan, pw: FftPlan) -> bool:
    """Whether grad_input's plan ``pi`` and grad_weight's ``pw`` can run as one pass (``backward_plan``).

    They can with the same sample chunks and transform sizes, and each group's kernel rows one chunk. A dense layer
    sliced by kernel rows (``FftPlan.row_chunk`` < A) cannot: x's spectra summed over the row slices for grad_input,
    the weight's over the sample chunks for grad_weight, one of them would be held whole beside the other's slices.
    The pass runs ``pi``'s chunks: ``pw``'s may hold fewer groups (``chunking.WEIGHT_SCRATCH_RATIO``, for grad_weight
    alone, whose native peak is a scratch), whereas native's backward of both holds grad_input's result too.

    Args:
        pi: grad_input's plan, ``plan(spec, "grad_input")``.
        pw: grad_weight's plan of the same spec, ``plan(spec, "grad_weight")``.

    Returns:
        bool; False for a batch of 0 (nothing to transform).

    Examples:
        >>> from convgrad.backends.fft import plan
        >>> from convgrad.spec import ConvSpec
        >>> def shared(spec): return shares_spectra(plan(spec, "grad_input"), plan(spec, "grad_weight"))
        >>> depthwise = ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256)
        >>> dense = ConvSpec.from_shapes((2, 64, 28, 28), (64, 64, 31, 31), padding=15)
        >>> shared(depthwise), plan(dense, "grad_input").row_chunk, shared(dense)   # dense: one kernel row a slice
        (True, 1, False)
    """
    a = pi.group_channels[0]
    return (pi.chunks[1] == pw.chunks[1] and pi.sizes == pw.sizes and pi.row_chunk == pw.row_chunk == a > 0
            and pi.spec.batch > 0)


@lru_cache(maxsize=512)
def backward_plan(spec: ConvSpec) -> FftPlan | None:
    """Both gradients of ``spec`` in one pass (``fuse`` of its grad_input and grad_weight plans), or None where they
    do not share their spectra (``shares_spectra``). Cached, as ``plan`` is.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> both = backward_plan(ConvSpec.from_shapes((2, 4, 30), (4, 1, 9), padding=4, groups=4))
        >>> both.kind, both.outputs, [loop.name for loop in both.loops]
        ('both_from_y', ('grad_input', 'grad_weight'), ['groups', 'samples'])
    """
    pi, pw = plan(spec, "grad_input"), plan(spec, "grad_weight")
    return fuse(pi, pw) if shares_spectra(pi, pw) else None


# ---- the steps of each kind ---------------------------------------------------------------------------------------
class _Steps:
    """The steps of one plan as they are added, each at a depth; the shapes declared are the first chunk's."""

    def __init__(self, p: FftPlan) -> None:
        spec = p.spec
        self.p = p
        self.steps: list[FftStep] = []
        self.a, self.b0, self.b = p.group_channels
        self.g = min(p.chunks[0], spec.groups)  # groups, samples and kernel rows of the first chunk
        self.n = min(p.chunks[1], spec.batch)
        self.r = min(p.row_chunk, self.a)
        self.bins = p.bins(True)
        self.f = math.prod(self.bins)
        self.taps = tuple(d.taps for d in p.dims)
        self.rows = tuple(d.whole_rows(s) for d, s in zip(p.dims, spec.stride))  # M per phase

    def add(self, depth: int, name: str, op: str, reads: tuple[str, ...], writes: str, declared: Shape,
            **args: Any) -> None:
        self.steps.append(FftStep(name, op, reads, writes, tuple(args.items()), declared, depth))

    # the steps that recur, at a depth
    def placed(self) -> str:
        """The phase kernels placed once where a group's kernel rows are one chunk ("kernel"); else the weight
        itself ("w"), each row slice placed as it is transformed (the placed whole is the weight's size again)."""
        if self.p.row_chunk < self.a:
            return "w"
        self.add(0, "taps", "place_taps", ("w",), "kernel", (self.p.spec.y_channels, self.b, *self.taps),
                 dims=self.p.dims)
        return "kernel"

    def start(self, depth: int, writes: str, what: str) -> None:
        """An empty register (a sum, a list) that the steps after it fill."""
        self.add(depth, "start", "start", (), writes, (), what=what)

    def kernel(self, depth: int, source: str, reverse: bool, resolve: bool = False, rows: int | None = None) -> None:
        p = self.p
        self.add(depth, "transform", "kernel_spectra", (source, "real", "g", "r"), "wf",
                 (self.g, rows or self.r, self.b, self.f), a=self.a, b=self.b, dims=p.dims, sizes=p.sizes,
                 place=p.row_chunk < self.a, reverse=reverse, resolve=resolve)

    def x(self, depth: int, writes: str, samples: int, bins_major: bool = False) -> None:
        p = self.p
        self.add(depth, "transform", "x_spectra", ("x", "n", "g"), writes, (samples, self.g, self.b, self.f),
                 b0=self.b0, b=self.b, dims=p.dims, stride=p.spec.stride, sizes=p.sizes, zeros=p.phase_zeros,
                 bins_major=bins_major)

    def y(self, depth: int, writes: str, reverse: bool, rows: int | None = None) -> None:
        self.add(depth, "transform", "y_spectra", ("y", "real", "n", "g", "r"), writes,
                 (self.n, self.g * (rows or self.r), *self.bins), a=self.a, sizes=self.p.sizes, reverse=reverse)

    def x_side(self, depth: int, spectra: str, out: str) -> None:
        """x's spectra -> its chunk, written into the result ``out``."""
        p, spec = self.p, self.p.spec
        self.add(depth, "inverse", "x_inverse", (spectra, "real"), "xs", (self.n, self.g * self.b, *self.rows),
                 sizes=p.sizes, cuts=p.phase_zeros)
        self.add(depth, "phases", "from_phases", ("xs", "g"), "xc", (self.n, self.g * self.b0, *spec.x_size),
                 dims=p.dims, stride=spec.stride, b0=self.b0)
        self.add(depth, "write", "write_groups", (out, "xc", "n", "g"), out, spec.x_shape, b0=self.b0)

    def w_side(self, depth: int, total: str, conj_real: bool = False) -> None:
        """The weight's summed spectra -> its rows' phase kernels, kept for the taps read at the end."""
        p = self.p
        self.add(depth, "inverse", "w_inverse", (total, "real"), "wq", (self.g * self.r, self.b, *self.taps),
                 sizes=p.sizes, cuts=p.cuts_to(self.taps), conj_real=conj_real)
        self.add(depth, "collect", "collect", ("parts", "wq"), "parts", (self.g * self.r, self.b, *self.taps))

    def loops(self, *order: str) -> tuple[Loop, ...]:
        spec, p = self.p.spec, self.p
        table = {"groups": ("g", spec.groups, p.chunks[0]), "samples": ("n", spec.batch, p.chunks[1]),
                 "kernel rows": ("r", self.a, p.row_chunk)}
        return tuple(Loop(name, table[name][0], (0, table[name][1]), tuple(chunk_ranges(*table[name][1:])))
                     for name in order)

    def done(self, loops: tuple[Loop, ...], inputs: tuple[str, ...], **fields: Any) -> FftPlan:
        return replace(self.p, steps=tuple(self.steps), loops=loops, inputs=inputs, **fields)


def _several(p: FftPlan) -> bool:
    """Whether the plan runs in more than one chunk (of groups, samples or kernel rows)."""
    return p.chunks[0] < p.spec.groups or p.chunks[1] < p.spec.batch or p.row_chunk < p.group_channels[0]


def _build_y_from_x(p: FftPlan) -> FftPlan:
    """y = the correlation of x with the kernel: per chunk of groups, samples, then kernel rows."""
    s, spec = _Steps(p), p.spec
    whole, samples = p.row_chunk >= s.a, len(chunk_ranges(spec.batch, p.chunks[1]))
    kernel = s.placed()
    s.add(0, "result", "result", ("x", "w"), "result", spec.y_shape, shape=spec.y_shape, several=_several(p))
    if whole:  # the kernel spectra of the chunk's groups, shared by its sample chunks
        s.kernel(1, kernel, True, resolve=samples > 1 and s.b == 1)
    s.x(2, "xf", s.n, bins_major=not whole and s.b > 1)
    if not whole:
        s.kernel(3, kernel, True)
    s.add(3, "product", "y_product", ("xf", "wf", "real", "n", "g", "r"), "yf", (s.n, s.g * s.r, *s.bins),
          groups=spec.groups, sizes=p.sizes)
    s.add(3, "inverse", "inverse", ("yf", "real"), "yc", (s.n, s.g * s.r, *spec.y_size), sizes=p.sizes,
          cuts=p.cuts_to(spec.y_size))
    s.add(3, "write", "write_rows", ("result", "yc", "n", "g", "r"), "result", spec.y_shape, a=s.a)
    s.add(0, "result", "finish", ("result",), "out", spec.y_shape)
    return s.done(s.loops("groups", "samples", "kernel rows"), ("x", "w"))


def _build_x_from_y(p: FftPlan) -> FftPlan:
    """x = the adjoint correlation of y with the kernel: per chunk of groups and samples, x's spectra summed over
    the kernel-row chunks (each slice's spectra of y and of the kernel made and dropped in turn)."""
    s, spec = _Steps(p), p.spec
    whole = p.row_chunk >= s.a
    kernel = s.placed()
    s.add(0, "result", "result", ("y", "w"), "result", spec.x_shape, shape=spec.x_shape, several=_several(p))
    if whole:
        s.kernel(1, kernel, False)
    s.start(2, "xf", "x's spectra, summed over the kernel-row chunks")
    s.y(3, "yf", False)
    if not whole:
        s.kernel(3, kernel, False)
    s.add(3, "product", "x_product", ("yf", "wf", "n", "g", "r"), "term", (s.n, s.g, s.b, s.f), groups=spec.groups)
    s.add(3, "sum", "accumulate", ("xf", "term"), "xf", (s.n, s.g, s.b, s.f), over="kernel rows")
    s.x_side(2, "xf", "result")
    s.add(0, "result", "finish", ("result",), "out", spec.x_shape)
    return s.done(s.loops("groups", "samples", "kernel rows"), ("y", "w"))


def _build_w_from_xy(p: FftPlan) -> FftPlan:
    """w = the correlation of x with y over the samples: per chunk of groups and kernel rows, the weight's spectra
    summed over the sample chunks; x's spectra made once per group chunk where the samples are one chunk."""
    s, spec = _Steps(p), p.spec
    one = len(chunk_ranges(spec.batch, p.chunks[1])) == 1
    s.start(0, "parts", "the weight's row chunks")
    if one:  # x's spectra shared by every kernel-row chunk, laid out bins-major once where they are several
        s.x(1, "xf", spec.batch, bins_major=len(chunk_ranges(s.a, p.row_chunk)) > 1 and s.b > 1)
    s.start(2, "wsum", "the weight's spectra, summed over the sample chunks")
    if not one:
        s.x(3, "xf", s.n)
    s.y(3, "yf", True)
    s.add(3, "product", "w_product", ("xf", "yf", "n", "g", "r"), "term", (s.g, s.r, s.b, s.f), groups=spec.groups)
    s.add(3, "sum", "accumulate", ("wsum", "term"), "wsum", (s.g, s.r, s.b, s.f), over="samples")
    s.w_side(2, "wsum")
    s.add(0, "taps", "read_taps", ("parts",), "out", spec.weight_shape, dims=p.dims, b0=s.b0)
    return s.done(s.loops("groups", "kernel rows", "samples"), ("x", "y"))


_BUILD = {"y_from_x": _build_y_from_x, "x_from_y": _build_x_from_y, "w_from_xy": _build_w_from_xy}


def fuse(pi: FftPlan, pw: FftPlan) -> FftPlan:
    """grad_input's and grad_weight's plans of one spec as one pass: grad_output's spectrum made once per chunk of
    ``pi`` and read by both products. A forward conv's grad_output is y: its Y feeds X' = sum_a Y W (grad_input) and
    W' = sum_n ~Y X; a transposed conv's is x: its X feeds Y = sum_b X ~W and W'.

    Args:
        pi, pw: ``plan(spec, "grad_input")`` and ``plan(spec, "grad_weight")``, which ``shares_spectra``.

    Returns:
        FftPlan with gradient "backward", inputs (grad_output's side, input's side, "w"), outputs ("grad_input",
        "grad_weight") and ``parts`` (pi, pw).
    """
    s, spec = _Steps(pi), pi.spec
    s.add(0, "taps", "place_taps", ("w",), "kernel", (spec.y_channels, s.b, *s.taps), dims=pi.dims)
    s.start(0, "parts", "the weight's row chunks")
    if pi.kind == "x_from_y":  # a forward conv: y = grad_output shared, x = input
        s.add(0, "result", "result", ("y", "w"), "result", spec.x_shape, shape=spec.x_shape, several=_several(pi))
        s.kernel(1, "kernel", False)
        s.start(1, "wsum", "the weight's spectra, summed over the sample chunks")
        s.y(2, "yf", False)
        s.add(2, "product", "x_product", ("yf", "wf", "n", "g", "r"), "xf", (s.n, s.g, s.b, s.f), groups=spec.groups)
        s.x_side(2, "xf", "result")
        s.x(2, "xw", s.n)
        s.add(2, "conj", "conj_if_real", ("xw", "real"), "xw", (s.n, s.g, s.b, s.f))
        s.add(2, "reverse", "reverse_if_complex", ("yf", "real"), "yr", (s.n, s.g * s.a, *s.bins), sizes=pi.sizes)
        s.add(2, "product", "w_product", ("xw", "yr", "n", "g", "r"), "term", (s.g, s.a, s.b, s.f),
              groups=spec.groups)
        s.add(2, "sum", "accumulate", ("wsum", "term"), "wsum", (s.g, s.a, s.b, s.f), over="samples")
        s.w_side(1, "wsum", conj_real=True)
        kind, inputs = "both_from_y", ("y", "x", "w")
    else:  # a transposed conv: x = grad_output shared, y = input
        samples = len(chunk_ranges(spec.batch, pi.chunks[1]))
        s.add(0, "result", "result", ("x", "w"), "result", spec.y_shape, shape=spec.y_shape, several=_several(pi))
        s.kernel(1, "kernel", True, resolve=samples > 1 and s.b == 1)
        s.start(1, "wsum", "the weight's spectra, summed over the sample chunks")
        s.x(2, "xf", s.n)
        s.add(2, "product", "y_product", ("xf", "wf", "real", "n", "g", "r"), "yf", (s.n, s.g * s.a, *s.bins),
              groups=spec.groups, sizes=pi.sizes)
        s.add(2, "inverse", "inverse", ("yf", "real"), "yc", (s.n, s.g * s.a, *spec.y_size), sizes=pi.sizes,
              cuts=pi.cuts_to(spec.y_size))
        s.add(2, "write", "write_rows", ("result", "yc", "n", "g", "r"), "result", spec.y_shape, a=s.a)
        s.y(2, "ys", True)
        s.add(2, "product", "w_product", ("xf", "ys", "n", "g", "r"), "term", (s.g, s.a, s.b, s.f),
              groups=spec.groups)
        s.add(2, "sum", "accumulate", ("wsum", "term"), "wsum", (s.g, s.a, s.b, s.f), over="samples")
        s.w_side(1, "wsum")
        kind, inputs = "both_from_x", ("x", "y", "w")
    s.add(0, "result", "finish", ("result",), "grad_input", spec.input_shape)
    s.add(0, "taps", "read_taps", ("parts",), "grad_weight", spec.weight_shape, dims=pw.dims, b0=s.b0)
    return s.done(s.loops("groups", "samples"), inputs, gradient="backward", kind=kind,
                  outputs=("grad_input", "grad_weight"), parts=(pi, pw))
