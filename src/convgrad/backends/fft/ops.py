"""The operations of the fft backend's plans: each one a tensor function and the sentence that says what it does.

A plan step (``plans.FftStep``) names one of these (``OPS``), the registers it reads and writes and the keyword
arguments it passes; ``execute.run`` calls ``OPS[step.op].run(*registers, **arguments)``, the step's text is
``OPS[step.op].say(**arguments)`` and its line of code is the same call written out (``ops.<name>(...)``), so what
runs, what is said and what is written come from one object. A chunk's range of groups, samples or kernel rows is a
register, ``g``, ``n`` or ``r`` = ``(start, stop)``, which a plan's loops bind (the whole range outside them).

Spectra are laid out per group (g'), sample (n') and channel with their bins flattened to F for the per-bin products
(``transforms.x_bins`` and its siblings); every op is differentiable, so gradients of any order come from autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from convgrad.backends.fft import transforms as tf
from convgrad.backends.fft.sizing import FftDim
from convgrad.spec import Pair
from convgrad.tensor_ops import batched_like, sliced

__all__ = ["OPS", "Op", "Result", "accumulate", "collect", "finish", "from_phases", "inverse", "kernel_spectra",
           "place_taps", "read_taps", "result", "start", "w_inverse", "w_product", "write_groups", "write_rows",
           "x_inverse", "x_product", "x_spectra", "y_product", "y_spectra"]

Shape = tuple[int, ...]
Range = tuple[int, int]


@dataclass(frozen=True)
class Op:
    """One operation: ``run`` on the step's registers and keyword arguments, ``say`` the sentence it is, from the
    same keyword arguments."""

    name: str
    run: Callable[..., Any]
    say: Callable[..., str]


OPS: dict[str, Op] = {}


def _op(say: Callable[..., str]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the op of its name, said by ``say`` (which takes its keyword arguments)."""
    def register(run: Callable[..., Any]) -> Callable[..., Any]:
        OPS[run.__name__] = Op(run.__name__, run, say)
        return run

    return register


def _span(at: Range) -> int:
    return at[1] - at[0]


def _bins(sizes: Shape, real: bool) -> Shape:
    """The bins of a transform of ``sizes``: the last dim halved (+1) for real data (rfftn)."""
    return (*sizes[:-1], sizes[-1] // 2 + 1) if real else sizes


def _taps(dims: tuple[FftDim, ...]) -> Shape:
    return tuple(d.taps for d in dims)


# ---- the kernel ---------------------------------------------------------------------------------------------------
@_op(lambda dims: f"place each tap t at slot (phase, t*d div s) of a {_taps(dims)} kernel per phase, zeros elsewhere")
def place_taps(w: torch.Tensor, *, dims: tuple[FftDim, ...]) -> torch.Tensor:
    """w (C_y, B0, *k) -> the phase kernels (C_y, B, *Q), placed once for every chunk."""
    return tf.place_taps(w, dims)


def _say_kernel(a: int, b: int, dims: tuple[FftDim, ...], sizes: Shape, place: bool, reverse: bool,
                resolve: bool) -> str:
    placed = f"place its taps in {_taps(dims)} slots per phase, " if place else ""
    flipped = ", reversed (W(-f): a conjugate for real data)" if reverse else ""
    kept = "; the lazy conjugate resolved once, not per sample chunk" if resolve else ""
    return f"the kernel rows r of groups g ({a} a group): {placed}transform to {sizes}{flipped}{kept}"


@_op(_say_kernel)
def kernel_spectra(kernel: torch.Tensor, real: bool, g: Range, r: Range, *, a: int, b: int,
                   dims: tuple[FftDim, ...], sizes: Shape, place: bool, reverse: bool, resolve: bool) -> torch.Tensor:
    """The spectra of kernel rows r of groups g: (g', r', B, F). ``kernel``: the phase kernels (C_y, B, *Q), or the
    weight (C_y, B0, *k) with ``place`` (a dense layer's row slices, placed as they are transformed)."""
    if _span(r) == a:
        rows = sliced(kernel, [slice(g[0] * a, g[1] * a)], 0)  # (g'*A, *rest)
    else:
        rows = kernel.reshape(-1, a, *kernel.shape[1:])[g[0]:g[1], r[0]:r[1]].reshape(-1, *kernel.shape[1:])
    if place:
        rows = tf.place_taps(rows, dims)  # (g'*r', B, *Q)
    wf = tf.forward_transform(rows, sizes)  # (g'*r', B, *bins)
    if reverse:
        wf = tf.reversed_spectrum(wf, len(sizes), real)
    wf = wf.reshape(_span(g), _span(r), b, -1)  # (g', r', B, F)
    # W(-f) of real data is a lazy conj, which a broadcast product resolves per sample chunk (SincNet: 8 copies, not 1)
    return wf.resolve_conj() if resolve else wf


# ---- the spectra of x and y ---------------------------------------------------------------------------------------
def _say_x(b0: int, b: int, dims: tuple[FftDim, ...], stride: Shape, sizes: Shape, zeros: tuple[Pair, ...],
           bins_major: bool) -> str:
    whole = tuple(d.phase_pads(s)[0] for d, s in zip(dims, stride))
    rows = tuple(d.whole_rows(s) for d, s in zip(dims, stride))
    phases = tuple(d.phases for d in dims)
    layout = "; laid out bins-major once, for the per-bin matmul of every kernel-row chunk" if bins_major else ""
    return (f"x's samples n of groups g ({b0} channels a group): pad by {whole} (negative = crop) to stride * M rows "
            f"(M = {rows} a phase), split into the live phases {phases} of stride {stride} as channels, transform "
            f"each phase padded by {zeros} zero rows to {sizes}{_pruned(sizes)}{layout}")


def _pruned(sizes: Shape) -> str:
    """How the transforms prune, on a grid with dims before the last (``transforms._pays``): a 1d grid has none."""
    return "" if len(sizes) == 1 else " (pruned where it pays: transforms.PRUNE_FILL, PRUNE_MIN_POINTS)"


@_op(_say_x)
def x_spectra(x: torch.Tensor, n: Range, g: Range, *, b0: int, b: int, dims: tuple[FftDim, ...], stride: Shape,
              sizes: Shape, zeros: tuple[Pair, ...], bins_major: bool) -> torch.Tensor:
    """The spectra of x's live phases, samples n of groups g: (n', g', B, F)."""
    part = sliced(x, [slice(*n), slice(g[0] * b0, g[1] * b0)], 0)  # (n', g'*B0, *i)
    xf = tf.forward_transform(tf.to_phases(part, dims, stride), sizes, zeros)  # (n', g'*B, *bins)
    xf = xf.reshape(_span(n), _span(g), b, -1)  # (n', g', B, F)
    if bins_major:  # laid out (g', F, n', B) once: the per-bin matmul of every row chunk reads it
        xf = xf.permute(1, 3, 0, 2).contiguous().permute(2, 0, 3, 1)  # (n', g', B, F)
    return xf


def _say_y(a: int, sizes: Shape, reverse: bool) -> str:
    flipped = ", reversed (Y(-f): a conjugate for real data)" if reverse else ""
    return f"y's samples n, kernel rows r of groups g ({a} a group): transform to {sizes}{_pruned(sizes)}{flipped}"


@_op(_say_y)
def y_spectra(y: torch.Tensor, real: bool, n: Range, g: Range, r: Range, *, a: int, sizes: Shape,
              reverse: bool) -> torch.Tensor:
    """The spectra of y's rows r of groups g, samples n: (n', g'*r', *bins)."""
    part = sliced(y, [slice(*n), slice(g[0] * a + r[0], g[1] * a - (a - r[1]))], 0)  # (n', g'*r', *o)
    yf = tf.forward_transform(part, sizes)  # (n', g'*r', *bins)
    return tf.reversed_spectrum(yf, len(sizes), real) if reverse else yf


# ---- the per-bin products, one per contraction --------------------------------------------------------------------
@_op(lambda groups, sizes: f"Y[n,a] = sum_b X[n,b] W(-f)[a,b] per bin, {groups} groups as a batch dim")
def y_product(xf: torch.Tensor, wf: torch.Tensor, real: bool, n: Range, g: Range, r: Range, *, groups: int,
              sizes: Shape) -> torch.Tensor:
    """x's spectra (n', g', B, F) and the kernel's (g', r', B, F) -> y's (n', g'*r', *bins)."""
    return tf.y_bins(xf, wf).reshape(_span(n), _span(g) * _span(r), *_bins(sizes, real))


@_op(lambda groups: f"X[n,b] = sum_a Y[n,a] W[a,b] per bin, {groups} groups as a batch dim")
def x_product(yf: torch.Tensor, wf: torch.Tensor, n: Range, g: Range, r: Range, *, groups: int) -> torch.Tensor:
    """y's spectra (n', g'*r', *bins) and the kernel's (g', r', B, F) -> x's term (n', g', B, F)."""
    return tf.x_bins(yf.reshape(_span(n), _span(g), _span(r), -1), wf)


@_op(lambda groups: f"W[a,b] = sum_n Y(-f)[n,a] X[n,b] per bin, {groups} groups as a batch dim")
def w_product(xf: torch.Tensor, yf: torch.Tensor, n: Range, g: Range, r: Range, *, groups: int) -> torch.Tensor:
    """x's spectra (n', g', B, F) and y's (n', g'*r', *bins) -> the weight's term (g', r', B, F), summed over n."""
    return tf.w_bins(xf, yf.reshape(_span(n), _span(g), _span(r), -1))


@_op(lambda what: f"{what}: empty")
def start(*, what: str) -> None:
    """Nothing yet: the first ``accumulate`` or ``collect`` after it starts the sum or the list."""
    return None


@_op(lambda over: f"add the term into the sum over the chunks of {over} (in place after the first)")
def accumulate(total: torch.Tensor | None, term: torch.Tensor, *, over: str) -> torch.Tensor:
    """total + term; the first term is the total (a fresh tensor of the product: summed into in place)."""
    return term if total is None else total.add_(term)


@_op(lambda: "conjugate x's spectra for real data, so that the product with Y(f) is conj(sum_n Y(-f) X) "
              "(the conj on x's spectra, A times smaller than y's where B = 1); as they are for complex data")
def conj_if_real(t: torch.Tensor, real: bool) -> torch.Tensor:
    """conj(t) for real data (a lazy view), t itself for complex data."""
    return t.conj() if real else t


@_op(lambda sizes: f"Y(-f) of the spectra for complex data (flip and roll over {len(sizes)} dim(s)); for real data "
                   "the spectra as they are (their conjugate is on x's side)")
def reverse_if_complex(t: torch.Tensor, real: bool, *, sizes: Shape) -> torch.Tensor:
    """The transform of the reversed sequence for complex data; t itself for real data."""
    return t if real else tf.reversed_spectrum(t, len(sizes), real)


# ---- inverse transforms and crops ---------------------------------------------------------------------------------
def _say_inverse(sizes: Shape, cuts: tuple[Pair, ...]) -> str:
    pruned = "" if len(sizes) == 1 else " (pruned where it pays: transforms.PRUNE_MIN_POINTS)"
    return f"inverse transform of {sizes}, cut {cuts} rows off each dim's ends{pruned}"


@_op(_say_inverse)
def inverse(t: torch.Tensor, real: bool, *, sizes: Shape, cuts: tuple[Pair, ...]) -> torch.Tensor:
    """The inverse transform of spectra (.., *bins) with ``cuts`` rows cut: (.., *kept)."""
    return tf.inverse_transform(t, sizes, real, cuts)


@_op(_say_inverse)
def x_inverse(xf: torch.Tensor, real: bool, *, sizes: Shape, cuts: tuple[Pair, ...]) -> torch.Tensor:
    """x's spectra (n', g', B, F) -> each phase's rows (n', g'*B, *M): the inverse, the phases' zero rows cut."""
    n, g, b = xf.shape[:3]
    return tf.inverse_transform(xf.reshape(n, g * b, *_bins(sizes, real)), sizes, real, cuts)


def _say_w_inverse(sizes: Shape, cuts: tuple[Pair, ...], conj_real: bool) -> str:
    undo = "conjugate the sum back (real data), " if conj_real else ""
    return f"{undo}{_say_inverse(sizes, cuts)}: the first Q slots, as a compact copy"


@_op(_say_w_inverse)
def w_inverse(wf: torch.Tensor, real: bool, *, sizes: Shape, cuts: tuple[Pair, ...], conj_real: bool
              ) -> torch.Tensor:
    """The weight's spectra (g', r', B, F) -> its rows' phase kernels (g'*r', B, *Q): a compact copy (the crop of
    the inverse would keep it alive)."""
    if conj_real and real:
        wf = wf.conj()
    g, r, b = wf.shape[:3]
    wf = wf.reshape(g * r, b, *_bins(sizes, real))  # (g'*r', B, *bins)
    return tf.inverse_transform(wf, sizes, real, cuts).contiguous()


@_op(lambda dims, stride, b0: f"interleave the phases (zeros in those no tap reaches) and crop the pads "
                              f"{tuple(d.phase_pads(s)[0] for d, s in zip(dims, stride))}")
def from_phases(xs: torch.Tensor, g: Range, *, dims: tuple[FftDim, ...], stride: Shape, b0: int) -> torch.Tensor:
    """Each phase's rows (n', g'*B, *M) -> x (n', g'*B0, *i)."""
    return tf.from_phases(xs, dims, stride, _span(g) * b0)


@_op(lambda dims, b0: "read each tap t from its slot (the kernel rows of every chunk, in order)")
def read_taps(parts: list[torch.Tensor], *, dims: tuple[FftDim, ...], b0: int) -> torch.Tensor:
    """The rows' phase kernels (``w_inverse``), in order -> the weight (C_y, C_x/g, *k)."""
    wp = torch.cat(parts, 0) if len(parts) > 1 else parts[0]  # (C_y, B, *Q)
    return tf.read_taps(wp, dims, b0)


@_op(lambda: "keep this chunk's kernel rows for the weight")
def collect(parts: list[torch.Tensor] | None, rows: torch.Tensor) -> list[torch.Tensor]:
    """The list of the weight's row chunks, this one appended."""
    parts = [] if parts is None else parts
    parts.append(rows)
    return parts


# ---- the result, written chunk by chunk ---------------------------------------------------------------------------
class Result:
    """The result, assembled chunk by chunk: written into one tensor when there are several chunks (a list and a
    cat would hold it twice), a compact copy of the one chunk otherwise (a crop of the inverse transform is a view
    that would keep the whole transform alive)."""

    def __init__(self, shape: Shape, several: bool, data: torch.Tensor, kernel: torch.Tensor) -> None:
        self.several = several
        self.tensor = batched_like(batched_like(data.new_empty(shape), kernel), data) if several else data

    def put(self, n0: int, n1: int, c0: int, c1: int, part: torch.Tensor) -> None:
        if self.several:
            self.tensor[n0:n1, c0:c1] = part
        else:
            self.tensor = part.contiguous()


@_op(lambda shape, several: f"the result {shape}, " + ("written chunk by chunk into one tensor" if several else
                                                       "the one chunk's compact copy"))
def result(data: torch.Tensor, kernel: torch.Tensor, *, shape: Shape, several: bool) -> Result:
    """The result to write the chunks into (``Result``)."""
    return Result(shape, several, data, kernel)


@_op(lambda a: f"write the chunk into samples n, kernel rows r of groups g ({a} a group)")
def write_rows(out: Result, part: torch.Tensor, n: Range, g: Range, r: Range, *, a: int) -> Result:
    """y's chunk (n', g'*r', *o) into its samples and channels; rows < A only with one group per chunk."""
    out.put(n[0], n[1], g[0] * a + r[0], g[1] * a - (a - r[1]), part)
    return out


@_op(lambda b0: f"write the chunk into samples n, channels of groups g ({b0} a group)")
def write_groups(out: Result, part: torch.Tensor, n: Range, g: Range, *, b0: int) -> Result:
    """x's chunk (n', g'*B0, *i) into its samples and channels."""
    out.put(n[0], n[1], g[0] * b0, g[1] * b0, part)
    return out


@_op(lambda: "the result")
def finish(out: Result) -> torch.Tensor:
    """The tensor the chunks were written into."""
    return out.tensor
