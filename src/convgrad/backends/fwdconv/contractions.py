"""The polyphase and sub-pixel steps of the fwdconv grad of x: no products with inserted zeros.

Contractions, per group (x: big side, y: small side; spec.phase_taps has the derivation):
    polyphase   x rows rho::s  =  y padded * flipped taps first::s/g      (one small conv per phase)
    sub-pixel   [N, C_y/g, y] * [P*C_x/g, C_y/g, fused taps] -> [N, P*C_x/g, ceil(i/s)] -> depth to space

Steps follow fwdconv.py: frozen dataclasses with ``shape``, ``__call__`` and ``describe()``, plus
``code()`` for ``Recipe.to_python``. Results are written phase by phase into a tensor of the big
side's exact size, in the data's memory format (channels last stays channels last).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from convgrad._ops import pad, plain, sliced
from convgrad.backends.fwdconv import geometry as geo
from convgrad.backends.fwdconv.plan import pad_code
from convgrad.backends.fwdconv.steps import Contraction, _contraction_code, _dims, _flat, _new_like, _slices
from convgrad.spec import Pair, PhaseTaps

Shape = tuple[int, ...]

__all__ = ["CHUNK_BYTES", "DepthToSpace", "Phase", "PhaseConvs", "SubpixelKernel", "TakeTaps"]

# Memory-bound phases (PhaseConvs.chunked) run a few samples at a time on the CPU, so that a chunk's phase results
# are still in cache when they are interleaved into the big side: their writes, not the convs, are the cost there.
# 16 MiB sits within the last-level cache of current server CPUs (measurements: fwdconv.CHUNK_MAX_CHANNELS).
CHUNK_BYTES = 16 * 2**20


# ---- polyphase grad of x ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TakeTaps:
    """Keep the taps first, first+step, ... (count of them) of the kernel in every spatial dim."""

    first: Shape
    step: Shape
    shape: Shape

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        counts = self.shape[2:]
        return w[(..., *(slice(f, f + s * (c - 1) + 1, s) for f, s, c in zip(self.first, self.step, counts)))]

    def describe(self) -> str:
        return f"keep the taps {', '.join(f'{f}::{s}' for f, s in zip(self.first, self.step))} of the flipped kernel"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        f, s, c = self.first[dim], self.step[dim], self.shape[2 + dim]
        return geo.each(lambda a: geo.select(a, range(f, f + s * (c - 1) + 1, s)), axis)

    def code(self, v: str, shape: Shape) -> list[str]:
        return [f"{v} = {v}[..., {_slices(self.first, self.step, self.shape[2:])}]  # taps of this phase: {self.shape}"]


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
        lines += _contraction_code(self.conv, out, f"{out}_y", f"{out}_k")
        if any(self.start):
            rows = ", ".join(f"{b}:{b + r}" for b, r in zip(self.start, self.shape[2:], strict=True))
            lines.append(f"{out} = {out}[..., {rows}]  # the rows of this phase")
        return lines


def _phase_rows(stride: Shape, rho: Shape) -> tuple[slice, ...]:
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
        out = _new_like(data, self.shape, kernel)
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
            rows = (..., *_phase_rows(self.stride, rho))
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
            target = pairs[(..., *_phase_rows(self.stride[:-1], lead), slice(None))]
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
        lines = [f"{out} = {data}.new_zeros({_dims(self.shape)})  # phases no tap reaches stay zero"]
        for p in self.phases:
            if p is not None:
                rows = ", ".join(f"{r}::{s}" for r, s in zip(p.rho, self.stride, strict=True))
                lines += [f"# phase {p.rho}", *p.code("p", data, kernel),
                          f"{out}[..., {rows}] = p[..., {_counts(self.stride, self.shape[2:], p.rho)}]"]
        return lines


# ---- sub-pixel grad of x: every phase in one conv -------------------------------------------------------------------

@dataclass(frozen=True)
class SubpixelKernel:
    """(C_x, C_y/g, *k) -> (g*P*C_x/g, C_y/g, *fused): each phase's taps, shifted into one common kernel."""

    groups: int
    phases: tuple[tuple[PhaseTaps | None, ...], ...]  # per dim, per rho
    offsets: tuple[tuple[int, ...], ...]  # per dim, per rho
    shape: Shape

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        c_x, cyg, *_ = w.shape
        fused = self.shape[2:]
        w = w.reshape(self.groups, c_x // self.groups, cyg, *w.shape[2:])  # (g, C_x/g, C_y/g, *k)
        subs = []
        for combo in itertools.product(*(range(len(dim)) for dim in self.phases)):
            taps = [dim[r] for dim, r in zip(self.phases, combo)]
            if any(t is None for t in taps):
                subs.append(w.new_zeros(*w.shape[:3], *fused))
                continue
            sub = w[(..., *(slice(t.first, t.first + t.step * (t.count - 1) + 1, t.step) for t in taps))]
            shifts = [(off[r], f - off[r] - t.count) for off, r, f, t in zip(self.offsets, combo, fused, taps)]
            subs.append(pad(sub, shifts))  # (g, C_x/g, C_y/g, *fused)
        return torch.stack(subs, 1).reshape(self.shape)  # (g*P*C_x/g, C_y/g, *fused)

    def describe(self) -> str:
        return (f"gather each phase's taps into one kernel of {self.shape[2:]} taps per phase, "
                f"phases as output channels within each of the {self.groups} group(s)")

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """One member per phase rho: its taps of the flipped kernel at their offset, zero taps around them."""
        fused = self.shape[2 + dim]
        members = []
        for rho, t in enumerate(self.phases[dim]):
            zeros = [geo.Cell("zero", 0)] * fused
            if t is None:
                members.append(geo.renumber(geo.Axis(()), zeros))
                continue
            off = self.offsets[dim][rho]
            taps = [axis.cells[t.first + t.step * q] for q in range(t.count)]  # type: ignore[union-attr]
            members.append(geo.renumber(geo.Axis(()), [*zeros[:off], *taps, *zeros[off + t.count:]]))
        return geo.Family(tuple(members), False)

    def code(self, v: str, shape: Shape) -> list[str]:
        c_x, cyg, *k = shape
        fused = self.shape[2:]
        lines = [f"{v}_w = {v}.reshape({_dims((self.groups, c_x // self.groups, cyg, *k))})  # (g, C_x/g, C_y/g, *k)",
                 "subs = []"]
        for combo in itertools.product(*(range(len(dim)) for dim in self.phases)):
            taps = [dim[r] for dim, r in zip(self.phases, combo)]
            if any(t is None for t in taps):
                zeros = (self.groups, c_x // self.groups, cyg, *fused)
                lines.append(f"subs.append({v}_w.new_zeros({_dims(zeros)}))")
                continue
            sl = _slices(*zip(*((t.first, t.step, t.count) for t in taps)))  # type: ignore[union-attr]
            shifts = tuple((off[r], f - off[r] - t.count) for off, r, f, t in zip(self.offsets, combo, fused, taps))  # type: ignore[union-attr]
            lines.append(f"subs.append(F.pad({v}_w[..., {sl}], {_flat(shifts)}))  # phase {combo}")
        return [*lines, f"{v} = torch.stack(subs, 1).reshape({_dims(self.shape)})  # every phase's taps: {self.shape}"]


@dataclass(frozen=True)
class DepthToSpace:
    """(N, g*P*C_x/g, *rows) -> (N, C_x, *i): the channels of phase rho become the rows rho::s (cropped to i).

    The phases' rows begin ``start`` rows into the conv's output (rows a symmetric conv padding added).
    """

    groups: int
    stride: Shape
    shape: Shape
    start: Shape = ()

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        n, _, *rows = t.shape
        g, c_x = self.groups, self.shape[1]
        phases = t.view(n, g, math.prod(self.stride), c_x // g, *rows)  # (N, g, P, C_x/g, *rows)
        out = _new_like(t, self.shape)
        grouped = out.view(n, g, c_x // g, *self.shape[2:])  # (N, g, C_x/g, *i)
        start = self.start or (0,) * len(rows)
        for p, rho in enumerate(itertools.product(*(range(s) for s in self.stride))):
            where = (..., *_phase_rows(self.stride, rho))
            rows_of_p = (slice(b, b + m) for b, m in zip(start, grouped[where].shape[3:], strict=True))
            grouped[where] = sliced(phases[:, :, p], list(rows_of_p))
        return out

    def describe(self) -> str:
        return f"depth to space: the channels of phase rho become the rows rho::{self.stride}"

    def rows(self, dim: int, axis: geo.Geometry) -> geo.Geometry:
        """Row u of the big side is row start + u // s of phase u % s's result."""
        s, b = self.stride[dim], (self.start[dim] if self.start else 0)
        members = axis.members if isinstance(axis, geo.Family) else (axis,)
        return geo.Axis(tuple(members[u % s].cells[b + u // s]._replace(key=u, phase=u % s)  # type: ignore[union-attr]
                              for u in range(self.shape[2 + dim])))

    def code(self, v: str, shape: Shape) -> list[str]:
        n, _, *rows = shape
        g, c_x = self.groups, self.shape[1]
        lines = [f"{v}_p = {v}.reshape({_dims((n, g, math.prod(self.stride), c_x // g, *rows))})  # (N, g, P, "
                 f"C_x/g, *rows)", f"{v} = {v}.new_zeros({_dims((n, g, c_x // g, *self.shape[2:]))})"]
        start = self.start or (0,) * len(rows)
        for p, rho in enumerate(itertools.product(*(range(s) for s in self.stride))):
            where = ", ".join(f"{r}::{s}" for r, s in zip(rho, self.stride, strict=True))
            rows_of_p = ", ".join(f"{b}:{b + len(range(r, i, s))}" for b, r, s, i in
                                  zip(start, rho, self.stride, self.shape[2:], strict=True))
            lines.append(f"{v}[..., {where}] = {v}_p[:, :, {p}][..., {rows_of_p}]")
        return [*lines, f"{v} = {v}.reshape({_dims(self.shape)})  # depth to space: {self.shape}"]

