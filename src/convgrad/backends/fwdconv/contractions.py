"""The contractions of the fwdconv plans: the one multiply-accumulate each plan ends its data path with.

Each follows plan.Contraction: a frozen dataclass called with (data, kernel), with ``shape``, ``describe()``,
``code()`` and ``reads()``. Per group (x: big side, y: small side; spec.phase_taps has the phases' derivation):
    Conv          a forward conv, data * kernel, with explicit stride, padding, dilation and groups
    MatMul        a conv whose kernel is 1x1, or covers its whole input:  [B, I] x [I, O] -> [B, O]
    DepthwiseTaps a stride-1 depthwise conv summed tap by tap (the few taps of a polyphase phase)
    PhaseConvs    polyphase grad of x: x rows rho::s = y padded * flipped taps first::s/g (one Phase per rho)
Results are written in the data's memory format (channels last stays channels last).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.plan import Chain, Contraction, TensorOp, commas, pad_code
from convgrad.backends.fwdconv.steps import new_like
from convgrad.spec import Pair, Shape
from convgrad.spec.chunks import PHASE_CHUNK_BYTES
from convgrad.tensor_ops import CONV, add_product_, channels_innermost, pad, plain, sliced

__all__ = ["CHUNK_BYTES", "Conv", "DepthwiseTaps", "MatMul", "Phase", "PhaseConvs", "TakeTaps", "phase_rows"]

# Memory-bound phases (PhaseConvs.chunked) run a few samples at a time on the CPU, so that a chunk's phase results
# are still in cache when they are interleaved into the big side (spec.chunks; grad_input.CHUNK_MAX_CHANNELS).
CHUNK_BYTES = PHASE_CHUNK_BYTES


def _coordinate(index: int, counts: Shape, dim: int) -> int:
    """The coordinate in ``dim`` of a row-major flat index over ``counts``."""
    return index // math.prod(counts[dim + 1:]) % counts[dim]


@dataclass(frozen=True)
class Conv:
    """A forward convolution, data * kernel, with explicit stride, padding, dilation and groups."""

    stride: Shape
    padding: Shape
    dilation: Shape
    groups: int
    shape: Shape

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return CONV[len(self.stride)](data, kernel, None, self.stride, self.padding, self.dilation, self.groups)

    def describe(self) -> str:
        return (f"conv{len(self.stride)}d stride={self.stride} padding={self.padding} "
                f"dilation={self.dilation} groups={self.groups}")

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        return [f"{out} = F.conv{len(self.stride)}d({data}, {kernel}, None, stride={self.stride}, "
                f"padding={self.padding}, dilation={self.dilation}, groups={self.groups})  # {self.shape}"]

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Result row u sums data[u*s + t*d] * kernel[t], the data padded by the conv's own padding."""
        s, p, d, rows = self.stride[dim], self.padding[dim], self.dilation[dim], self.shape[2 + dim]
        return geo.contract(lambda a, k: geo.conv_rows(a, k, s, p, d, rows), data, kernel)


# ---- matmuls ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MatMul:
    """A conv computed as one matmul: its kernel is 1x1 (``pointwise``), or it covers the whole input.

    pointwise: (B, g*I, *S) x (O, I, 1, ..) -> (B, O, *S);  full: (B, g*I, *J) x (O, I, *J) -> (B, O, 1, ..).
    """

    groups: int
    pointwise: bool
    shape: Shape

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        return self._pointwise(data, kernel) if self.pointwise else self._full(data, kernel)

    def _pointwise(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        g, b, o, i = self.groups, data.shape[0], self.shape[1], data.shape[1] // self.groups  # b: a batch chunk too
        spatial = data.shape[2:]
        k = kernel.reshape(g, o // g, i)  # (g, O/g, I)
        if i == 1 and o == g:  # depthwise: a matmul of 1x1 matrices per channel is a per-channel scale
            return data * kernel.reshape(1, g, *(1,) * len(spatial))  # (B, C, *S), in data's memory format
        if channels_innermost(data) and g == 1:
            out = data.movedim(1, -1).reshape(b * math.prod(spatial), i) @ k[0].t()  # (B*S, O)
            return out.reshape(b, *spatial, o).movedim(-1, 1)  # (B, O, *S), channels last
        out = torch.matmul(k, data.reshape(b, g, i, math.prod(spatial)))  # (B, g, O/g, S)
        return out.reshape(b, o, *spatial)

    def _full(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        g, (b, o) = self.groups, self.shape[:2]
        ij = data.shape[1] // g * math.prod(data.shape[2:])
        d = data.reshape(b, g, ij).transpose(0, 1)  # (g, B, I*J)
        k = kernel.reshape(g, o // g, ij)  # (g, O/g, I*J)
        return torch.matmul(d, k.transpose(1, 2)).transpose(0, 1).reshape(self.shape)  # (B, O, 1, ..)

    def describe(self) -> str:
        kind = "a 1x1 kernel" if self.pointwise else "a kernel covering its whole input"
        return f"conv with {kind}, groups={self.groups}: one matmul"

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """pointwise: row u is data[u] * kernel[0]; full: one row, the sum of data[j] * kernel[j]."""
        def one(a: geo.Axis, k: geo.Axis) -> geo.Axis:
            if self.pointwise:
                return geo.Axis(tuple(geo.Out("out", u, ((c, k.cells[0]),), (a, k)) for u, c in enumerate(a.cells)))
            return geo.Axis((geo.Out("out", 0, tuple(zip(a.cells, k.cells, strict=True)), (a, k)),))

        return geo.contract(one, data, kernel)

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        g, o = self.groups, self.shape[1]
        if self.pointwise:
            return [f"{out} = torch.matmul({kernel}.reshape({g}, {o // g}, -1), {data}.unflatten(1, ({g}, -1))"
                    f".flatten(3)).reshape({commas(self.shape)})  # 1x1 conv as a matmul"]
        return [f"{out} = torch.matmul({data}.unflatten(1, ({g}, -1)).flatten(2).transpose(0, 1), {kernel}.reshape("
                f"{g}, {o // g}, -1).transpose(1, 2)).transpose(0, 1).reshape({commas(self.shape)})"
                f"  # full-size kernel"]


@dataclass(frozen=True)
class DepthwiseTaps:
    """A depthwise conv (one channel of y per output channel) with stride 1, summed tap by tap: each tap scales its
    shifted slice of y by that channel's weight, and adds it into the rows the tap reaches.

    For the few taps of a polyphase phase this beats a conv call: a conv reorders y into oneDNN's blocked layout
    and its result back, and the phase work is memory-bound (measurements: grad_input.TAPS_MAX_PHASE_TAPS).
    ``rows`` holds, per tap (row-major over ``counts``) and per dim, the output rows first..stop and the data row
    that the first of them reads (``spec.tap_rows``); taps that read nothing are left out.
    """

    counts: Shape
    rows: tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]  # (tap index, per dim (first, stop, data_first))
    size: Shape  # the spatial size of y
    shape: Shape
    # computed once with the plan, not a cached_property: torch.compile cannot enter its lock
    _indices: list[tuple[int, tuple[slice, ...] | None, tuple[slice, ...] | None]] = field(
        init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_indices", self._index_rows())

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        c, nd = kernel.shape[0], len(self.counts)
        scales = kernel.reshape(c, -1).t().reshape(-1, 1, c, *(1,) * nd)  # (T, 1, C, 1, ..): each tap's weights
        fused = plain(data) and plain(kernel)
        out = None
        if not self._indices or self._indices[0][1] is not None:  # no tap reaches every row: start from zeros
            out = new_like(data, (data.shape[0], *self.shape[1:]), kernel).zero_()  # (B, C, *rows)
        for tap, rows, src in self._indices:
            part = data if src is None else data[src]
            if out is None:
                out = part * scales[tap]  # (B, C, *rows), in data's memory format
            else:
                add_product_(out if rows is None else out[rows], part, scales[tap], fused)
        return out

    def _index_rows(self) -> list[tuple[int, tuple[slice, ...] | None, tuple[slice, ...] | None]]:
        """Per tap, a tap that fills every row first: (tap, rows of the result, rows of y), None where all rows.

        Indexing with whole-dim slices only would return an alias, which the legacy vmap of is_grads_batched
        cannot batch (``tensor_ops.sliced``); None skips it."""
        def index(ranges: list[tuple[int, int]], sizes: Shape) -> tuple[slice, ...] | None:
            if all(a == 0 and b == n for (a, b), n in zip(ranges, sizes, strict=True)):
                return None
            return (slice(None), slice(None), *(slice(a, b) for a, b in ranges))

        entries = []
        for tap, dims in self.rows:
            rows = index([(first, stop) for first, stop, _ in dims], self.shape[2:])
            src = [(d, d + stop - first) for first, stop, d in dims]
            entries.append((tap, rows, src))
        entries.sort(key=lambda e: e[1] is not None)
        return [(tap, rows, index(src, self.size)) for tap, rows, src in entries]

    def describe(self) -> str:
        return f"depthwise conv of {math.prod(self.counts)} taps {self.counts}, summed tap by tap"

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Tap q adds data[r + offset_q] into row r; rows whose data row lies outside y read padding."""
        reach: dict[int, int] = {}  # tap coordinate in this dim -> data row read by result row 0
        for tap, dims in self.rows:
            first, _, data_first = dims[dim]
            reach[_coordinate(tap, self.counts, dim)] = data_first - first

        def one(a: geo.Axis, k: geo.Axis) -> geo.Axis:
            rows = range(self.shape[2 + dim])
            return geo.Axis(tuple(geo.Out("out", r, tuple((geo.row_or_pad(a, r + off), k.cells[q]) for q, off in
                                                          sorted(reach.items())), (a, k)) for r in rows))

        return geo.contract(one, data, kernel)

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        c, nd = self.shape[1], len(self.counts)
        lines = [f"{out} = {data}.new_zeros(({data}.shape[0], {commas(self.shape[1:])}))  # depthwise, tap by tap",
                 f"{out}_w = {kernel}.reshape({c}, -1)"]
        for tap, dims in self.rows:
            rows = ", ".join(f"{first}:{stop}" for first, stop, _ in dims)
            src = ", ".join(f"{d}:{d + stop - first}" for first, stop, d in dims)
            lines.append(f"{out}[..., {rows}] += {data}[..., {src}] * {out}_w[:, {tap}].reshape(1, {c}"
                         f"{', 1' * nd})  # tap {tap}")
        return lines


# ---- polyphase grad of x ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TakeTaps(Chain):
    """Keep the taps first, first+step, ... (count of them) of the kernel in every spatial dim."""

    first: Shape
    step: Shape
    shape: Shape

    def ops(self, shape: Shape) -> tuple[TensorOp, ...]:
        taps = tuple(slice(f, f + s * (c - 1) + 1, s) for f, s, c in zip(self.first, self.step, self.shape[2:]))
        return (TensorOp("index", (taps,), f"taps of this phase: {self.shape}"),)

    def describe(self) -> str:
        return f"keep the taps {', '.join(f'{f}::{s}' for f, s in zip(self.first, self.step))} of the flipped kernel"

    def label(self) -> str:
        return self.describe()

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        f, s, c = self.first[dim], self.step[dim], self.shape[2 + dim]
        return geo.each(lambda a: geo.select(a, range(f, f + s * (c - 1) + 1, s)), axis)


@dataclass(frozen=True)
class Phase:
    """One phase of the big side: y cropped/padded, convolved with this phase's taps only.

    ``pads`` are applied first (negative: a crop, which is a view); a Conv may pad more itself, in
    which case its output starts ``start`` rows early in each dim.
    """

    rho: Shape
    pads: tuple[Pair, ...]
    taps: TakeTaps
    conv: Contraction
    shape: Shape
    start: Shape = ()

    def __call__(self, data: torch.Tensor, taps: torch.Tensor) -> torch.Tensor:
        """This phase's rows from y and its taps (``self.taps`` of the kernel, taken by PhaseConvs)."""
        out = self.conv(pad(data, self.pads), taps)
        if any(self.start):
            out = sliced(out, [slice(b, b + r) for b, r in zip(self.start, self.shape[2:], strict=True)])
        return out

    def describe(self) -> str:
        return f"phase {self.rho}: pad y by {self.pads}, {self.taps.describe()}, {self.conv.describe()}"

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """This phase's rows: y padded by ``pads``, read by its taps of the kernel; each row tagged with rho."""
        taps = self.taps.rows(dim, kernel)
        y = geo.each(lambda a: geo.pad_axis(a, *self.pads[dim]), data) if self.pads else data
        out = self.conv.reads(dim, y, taps)
        b, n, rho = (self.start[dim] if self.start else 0), self.shape[2 + dim], self.rho[dim]
        return geo.each(lambda a: geo.Axis(tuple(c._replace(phase=rho) for c in a.cells[b:b + n])), out)

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        y = pad_code(f"{out}_y", data, self.pads, "negative crops") if self.pads else [f"{out}_y = {data}"]
        lines = [*y, f"{out}_k = {kernel}", *self.taps.code(f"{out}_k", ())]
        lines += self.conv.code(out, f"{out}_y", f"{out}_k")
        if any(self.start):
            rows = ", ".join(f"{b}:{b + r}" for b, r in zip(self.start, self.shape[2:], strict=True))
            lines.append(f"{out} = {out}[..., {rows}]  # the rows of this phase")
        return lines


def phase_rows(stride: Shape, rho: Shape) -> tuple[slice, ...]:
    """Where phase rho lands in the big side: rows rho::s in every dim."""
    return tuple(slice(r, None, s) for r, s in zip(rho, stride, strict=True))


def _counts(stride: Shape, size: Shape, rho: Shape) -> str:
    """`:n` per dim, n = len(range(rho, i, s)): the rows of phase rho that exist in the big side."""
    return ", ".join(f":{len(range(r, i, s))}" for r, s, i in zip(rho, stride, size, strict=True))


@dataclass(frozen=True)
class PhaseConvs:
    """Every phase of the big side, each its own small conv, written into rows rho::s; empty phases are zeros.

    With stride 2 in the last dim, the two phases of each row are written at once, as the real and imaginary
    parts of a complex view of the result (see ``_pairs_as_complex``).
    """

    stride: Shape
    phases: tuple[Phase | None, ...]  # row-major over rho
    shape: Shape
    chunked: bool = False  # memory-bound phases: a few samples at a time on the CPU (CHUNK_BYTES)

    def __call__(self, data: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
        out = new_like(data, self.shape, kernel)
        taps = [None if p is None else p.taps(kernel) for p in self.phases]
        write = self._write_pairs if self._pairs_as_complex(out, data, kernel) else self._write_phases
        n, chunk = out.shape[0], self.batch_chunk(out, data)
        for first in range(0, n, chunk):
            samples = [slice(first, min(first + chunk, n))]
            write(sliced(out, samples, 0), sliced(data, samples, 0), taps)
        return out

    def batch_chunk(self, out: torch.Tensor, data: torch.Tensor) -> int:
        """Samples per chunk: as many as keep a chunk's phases, its y and its rows of x within CHUNK_BYTES.

        On the CPU only: a GPU wants the whole batch in each launch.
        """
        n = out.shape[0]
        if not self.chunked or out.device.type != "cpu" or n <= 1:
            return max(n, 1)
        per_sample = (2 * math.prod(out.shape[1:]) + math.prod(data.shape[1:])) * out.element_size()
        return max(1, min(n, CHUNK_BYTES // per_sample))

    def _write_phases(self, out: torch.Tensor, data: torch.Tensor, taps: list[torch.Tensor | None]) -> None:
        for rho, phase, k in zip(itertools.product(*(range(s) for s in self.stride)), self.phases, taps, strict=True):
            rows = (..., *phase_rows(self.stride, rho))
            if phase is None or k is None:
                out[rows] = 0
            else:
                out[rows] = sliced(phase(data, k), [slice(0, n) for n in out[rows].shape[2:]])

    def _pairs_as_complex(self, out: torch.Tensor, data: torch.Tensor, kernel: torch.Tensor) -> bool:
        """Whether the two phases of a stride-2 last dim can be written as the real and imaginary parts of one
        complex tensor: a stride-2 copy per phase costs about as much as native's whole grad_input for memory-bound
        layers (MobileNetV2's depthwise 3x3/2); torch.complex interleaves both in one vectorised pass. ``out=``
        has no autograd, no forward AD and no vmap rule, so not while a graph is built nor under a transform."""
        if self.stride[-1] != 2 or self.shape[-1] % 2 or not out.is_contiguous() or None in self.phases:
            return False
        if out.dtype not in (torch.float32, torch.float64) or torch.compiler.is_compiling():
            return False  # compiled: the plain writes trace into one graph, an out= op would break it
        if torch.is_grad_enabled() and (data.requires_grad or kernel.requires_grad):
            return False
        return plain(data) and plain(kernel)

    def _write_pairs(self, out: torch.Tensor, data: torch.Tensor, taps: list[torch.Tensor | None]) -> None:
        pairs = torch.view_as_complex(out.view(*out.shape[:-1], out.shape[-1] // 2, 2))  # (n, C, *i[:-1], i_last/2)
        phases = iter(zip(self.phases, taps, strict=True))
        for lead in itertools.product(*(range(s) for s in self.stride[:-1])):
            target = pairs[(..., *phase_rows(self.stride[:-1], lead), slice(None))]
            rows = [slice(0, n) for n in target.shape[2:]]
            even, odd = (sliced(p(data, k), rows) for p, k in (next(phases), next(phases)))  # type: ignore[union-attr, arg-type]
            torch.complex(even, odd, out=target)

    def describe(self) -> str:
        live = [p for p in self.phases if p is not None]
        lines = [f"{len(live)} of {len(self.phases)} phases of stride {self.stride} receive taps (the rest are "
                 f"zeros); phase rho fills rows rho::{self.stride}"
                 + (f" (on the CPU a few samples at a time, up to {CHUNK_BYTES >> 20} MiB each: memory-bound)"
                    if self.chunked else "") + ":"]
        return "\n".join(lines + [f"  {p.describe()}" for p in live])

    def reads(self, dim: int, data: geo.Geometry, kernel: geo.Geometry) -> geo.Geometry:
        """Row u of the big side is row u // s of phase u % s; the rows of a phase no tap reaches read nothing."""
        s = self.stride[dim]
        phases: dict[int, geo.Geometry] = {}
        for p in self.phases:
            if p is not None and p.rho[dim] not in phases:  # every phase with this rho reads the same rows here
                phases[p.rho[dim]] = p.reads(dim, data, kernel)
        return geo.Axis(tuple(phases[u % s].cells[u // s]._replace(key=u) if u % s in phases  # type: ignore[union-attr]
                              else geo.Out("out", u, phase=u % s) for u in range(self.shape[2 + dim])))

    def code(self, out: str, data: str, kernel: str) -> list[str]:
        lines = [f"{out} = {data}.new_zeros({commas(self.shape)})  # phases no tap reaches stay zero"]
        for p in self.phases:
            if p is not None:
                rows = ", ".join(f"{r}::{s}" for r, s in zip(p.rho, self.stride, strict=True))
                lines += [f"# phase {p.rho}", *p.code("p", data, kernel),
                          f"{out}[..., {rows}] = p[..., {_counts(self.stride, self.shape[2:], p.rho)}]"]
        return lines
