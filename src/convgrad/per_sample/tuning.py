"""The measured choice of a layer's per-sample method, by the tuner of "auto" (``convgrad.tuning``).

Three purposes, each a set of options for one conv layer (x, y: its two sides, see ``methods``):
    "grads"  all per-sample gradients:            unfold, conv, native (and fft, on kernels of fft.MIN_TAPS taps
             or more, in every purpose)
    "norms"  per-sample norms only:               ghost, unfold, conv, native (materialised chunk by chunk, then
             dropped)
    "clip"   norms, then the clipped sum (DP-SGD): ghost, unfold, conv, native, each followed by one more
             weight-gradient pass on the per-sample-scaled grad_output (Book-Keeping, Bu et al. 2023); and, where the
             per-sample gradients take no more memory than the (input, grad_output) that pass would keep,
             unfold+store, conv+store, native+store, fft+store (materialised once, then a weighted sum), which then
             take the place of unfold, conv, native, fft (``raced``)
Options are first pruned by the cost model (multiply-adds, ``estimates``; for "clip" without storing, the norms'
alone, since every option then ends with the same pass): one estimated over ``PRUNE`` (3x; 4x where "fft" races)
the cheapest is never run (ghost on ResNet-18's 64-channel 32x32 layers: 18x unfold's multiply-adds, and it measured
423 ms against unfold's 36 ms), and where one option is left it is the choice, untimed. The rest are screened on the
whole batch, the cheapest estimate first: each runs once (its checking call), and only those whose first call ran
within ``BEHIND`` times the fastest first call run again, timed; where one is left, the first calls decided and
nothing runs again. The fastest is taken; for "clip", the Book-Keeping pass that the options without "+store" share
runs once (a warm-up and a timed call) and its time is added to each of theirs, and not at all where every option
raced ends with it. Not on a
slice: the ranking moves with the batch (the small CNN's second conv, per sample: conv 0.17 ms and unfold 0.49 ms
on 4 samples, but 2.15 and 1.26 ms on 32; 2 busy shared cores). Unlike a backend, an option's work here is split
between the backward and the clipping, so a later call cannot run one option whole: the screening alone decides.
Choices share auto's mode (``CONVGRAD_AUTOTUNE=fixed``: the cost model of ``methods.choose_method``), its cache
file and batch buckets.
"native" (PyTorch's weight gradient of the batch folded into the groups, see ``methods``) is counted at
``methods.NATIVE_POSITIONS / P`` times its multiply-adds where a sample has fewer positions P, since that kernel
runs slowly there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from convgrad.backends import fft as fft_backend
from convgrad.backends import get_backend
from convgrad.backends.fft import per_sample as fft
from convgrad.per_sample import methods
from convgrad.spec import ConvSpec
from convgrad.tuning import Choice, Store, bucketed, decide, device_name, fixed, screen, threads, tunable, tune
from convgrad.tuning.tuner import PRUNE_ESTIMATE, prune, timed

__all__ = ["BEHIND", "PRUNE", "PURPOSES", "book_keeping", "chosen", "estimates", "method_for", "options", "raced"]

PURPOSES = ("grads", "norms", "clip")
_NAMES = ("ghost", "unfold", "conv", "native", "fft", "unfold+store", "conv+store", "native+store", "fft+store")
_MATERIALISING = ("unfold", "conv", "native", "fft")
Key = tuple[ConvSpec, str, torch.dtype, torch.device, int]
# An option estimated over PRUNE times the cheapest is never run (the tuner's default, PRUNE_ESTIMATE, is 4x). On the
# 42 conv layer shapes of per_sample_models' clipped steps (ResNet-18, small CNN, VGG-11, WRN-16-4, U-Net; batch 32,
# 2 shared cores), every option estimated over 3x the cheapest (60 of them) ran at least 1.39x the fastest, and the
# 17 of them estimated 3-4x ran 1.54-3.95x (benchmarks/results/per_sample_prune.md, made by
# ``benchmarks/per_sample_prune.py --threads 2``): on ResNet-18, unfold and conv on 256 channels at 8x8 and on 128
# channels at 16x16 stride 2 (3.3-3.6x ghost's norms) and ghost on 64 channels at 32x32 stride 2 (3.4x) go untimed.
# Where "fft" takes part (large kernels, none among those shapes), the tuner's 4x stays.
PRUNE = 3.0
# An option whose first (checking) call runs over BEHIND times the fastest first call is not timed again, and where
# one option is left within BEHIND, none is (``screen``'s ``behind``): a first call carries one-time costs over a
# warm call's work, so such an option could win only if its own first-call costs were over BEHIND times the
# fastest's, relative to the work. On ResNet-18's 11 layer shapes (first clipped step of ``benchmarks/first_step.py
# --per-sample c``, 4 runs, 2 shared busy cores) a first call of 50 ms or more ran at most 2.4x the option's fastest
# later call, mostly under 1.4x; in one traced first step, the 7 options whose first call ran over 2x the fastest
# first call and were timed again (conv+store, native+store, ghost) ran 1.7-3.6x the fastest warm call, none the
# fastest. Where the fastest takes a few ms, a first call can run 10x, but a wrong cut there costs at most those
# few ms per step.
BEHIND = 2.0


def _key(spec: ConvSpec, purpose: str, like: torch.Tensor) -> Key:
    return bucketed(spec), purpose, like.dtype, like.device, threads(like)


def _key_text(key: Key) -> str:
    spec, purpose, dtype, device, threads = key
    return f"per_sample|{spec!r}|{purpose}|{dtype}|{device.type}:{device_name(device)}|threads={threads}"


_choices = Store(_key_text, lambda c: {c.backend, *c.pending} <= set(_NAMES))


def estimates(spec: ConvSpec, purpose: str, store: bool) -> dict[str, float]:
    """Multiply-adds of each option (the cost model that prunes before any timing).

    With W = C_y·C_x·T/g weight entries and P positions: materialising is N·P·W (a weight gradient's work),
    the ghost norm N·P²·(C_y + C_x·T), the Book-Keeping pass N·P·W again, a weighted sum of stored gradients
    N·W, and the norms of stored gradients N·W. "native" materialises at N·P·W·max(1, NATIVE_POSITIONS/P), "fft"
    at half its flops (``convgrad.backends.fft.per_sample.estimate_flops``), and only on kernels of at least
    ``fft.MIN_TAPS`` taps.

    Examples:
        >>> from convgrad.per_sample.tuning import estimates
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((32, 64, 32, 32), (64, 64, 3, 3), 1, 1)  # ResNet-18's first stage
        >>> e = estimates(spec, "norms", False)
        >>> round(e["ghost"] / e["unfold"], 1)  # pruned: over PRUNE (3x)
        17.8
    """
    n, p, t = spec.batch, spec.positions, spec.taps
    cx, cy = spec.x_channels, spec.y_channels
    w = cy * spec.x_group_channels * t
    wgrad, ghost = n * p * w, n * p * p * (cy + cx * t)
    native = wgrad * max(1.0, methods.NATIVE_POSITIONS / max(p, 1))  # one sample's kernel is slow on few positions
    # "fft" only on large kernels (fft.worth_trying): elsewhere it is never even estimated, let alone timed
    big = {"fft": fft.estimate_flops(spec) / 2} if fft.worth_trying(spec) else {}
    # there the Book-Keeping pass (auto's weight gradient) may run on the fft backend: half its two gradients' flops
    keeping = min(wgrad, fft_backend.estimate_flops(spec)[0] / 4) if big else wgrad
    if purpose == "grads":
        return {"unfold": wgrad, "conv": wgrad, "native": native, **big}
    out = {"ghost": ghost, "unfold": wgrad, "conv": wgrad, "native": native, **big}
    if purpose == "clip":
        out = {k: v + keeping for k, v in out.items()}  # each followed by the Book-Keeping pass
        if store:
            out.update({f"{k}+store": out[k] - keeping + 2 * n * w for k in _MATERIALISING if k in out})
    return {k: float(v) for k, v in out.items()}


def _fixed(spec: ConvSpec, purpose: str, store: bool) -> str:
    """The cost model's choice (fixed mode, and wherever tensors cannot be timed)."""
    if purpose == "grads":
        return methods.choose_method(spec, norms=False)
    method = methods.choose_method(spec, norms=True)
    return f"{method}+store" if purpose == "clip" and store and method != "ghost" else method


def raced(spec: ConvSpec, purpose: str, store: bool) -> list[str]:
    """The options a tuning considers: those of ``estimates``, less, where storing is allowed, each materialising
    option without "+store" (m+store materialises the same, then replaces the Book-Keeping pass, a whole
    weight-gradient pass, by a weighted sum of N·W; it was the faster of the two on every ResNet-18 layer shape
    where storing is allowed, by 1.3-2.4x, 2 shared cores: the times of a first step of
    ``benchmarks/first_step.py --per-sample c``)."""
    names = estimates(spec, purpose, store)
    return [n for n in names if not (store and f"{n}+store" in names)]


def book_keeping(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The Book-Keeping pass of a "clip" option with all factors 1: the native weight gradient of the batch."""
    inp, gy = (y, x) if spec.transposed else (x, y)
    ones = gy.new_ones(spec.batch, *(1,) * (gy.dim() - 1))  # gy's dtype and device (autocast, CUDA)
    return get_backend("native").weight_grad(spec, inp, gy * ones)


def options(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, purpose: str, store: bool,
            kept: torch.Tensor | None = None, book: bool = True) -> dict[str, Callable[[int], object]]:
    """Each option as ``run(n)`` on the first n samples: what it computes for its purpose (for "grads": four of
    its samples, ``_screened_samples``; for "clip": the squared norms and the clipped sum with all factors 1, the
    Book-Keeping pass by the native backend). ``kept``: "clip" on the whole batch only, the Book-Keeping pass's
    result, computed once: the options without "+store" then return it instead of running that pass again.
    ``book=False``: those options return the squared norms alone (the pass is left out of the race).
    In the order of their estimates, the cheapest first (``BEHIND``)."""
    est = estimates(spec, purpose, store)
    names = sorted(raced(spec, purpose, store), key=est.__getitem__)  # stable: ties keep estimates' order

    def sub(n: int) -> tuple[ConvSpec, torch.Tensor, torch.Tensor]:
        return (spec, x, y) if n == spec.batch else (spec.with_batch(n), x[:n], y[:n])

    def run(name: str, n: int) -> object:
        s, xs, ys = sub(n)
        method, _, stores = name.partition("+")
        if purpose == "grads":
            return _screened_samples(methods.weight_grad(s, xs, ys, method))
        if stores:
            gw = methods.weight_grad(s, xs, ys, method)
            return methods.sq_norms(gw), torch.tensordot(gw.new_ones(n), gw, dims=1)
        sq = methods.ghost_sq_norms(s, xs, ys) if method == "ghost" else methods.materialised_sq_norms(s, xs, ys,
                                                                                                          method)
        if purpose != "clip" or not book:
            return sq
        return sq, (kept if kept is not None and n == spec.batch else book_keeping(s, xs, ys))

    return {name: (lambda n, name=name: run(name, n)) for name in names}


def _screened_samples(gw: torch.Tensor) -> torch.Tensor:
    """The samples of a "grads" option's result that the screening compares with the reference's: the first two,
    the middle and the last, which cross the chunk boundaries of every method. Whole results, the reference's and
    their difference live at once were 3 x 302 MiB on VGG-11's 512-channel layers: its first step of all
    per-sample gradients peaked at 1779 MiB allocated against 1189 MiB in the steps after."""
    n = gw.shape[0]
    return gw[sorted({0, min(1, n - 1), n // 2, n - 1})] if n else gw  # (<=4, *weight_shape), a copy


def method_for(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, purpose: str, store: bool = False) -> str:
    """The method for this layer and purpose: tuned on first use (see the module doc), else the cost model.

    Args:
        spec: the layer; x, y: its two sides ``(N, C_x, *i)``, ``(N, C_y, *o)`` (``methods``).
        purpose: "grads", "norms" or "clip".
        store: "clip" only: whether storing the per-sample gradients is allowed (memory).

    Returns:
        One of "unfold", "conv", "native", "fft" ("grads"), "ghost" too ("norms"), and "unfold+store",
        "conv+store", "native+store", "fft+store" ("clip").

    Examples:
        >>> import torch
        >>> from convgrad.backends import auto
        >>> from convgrad.per_sample.tuning import method_for
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((8, 4, 6, 6), (4, 4, 3, 3), 1, 1)
        >>> x, y = torch.randn(spec.input_shape), torch.randn(spec.output_shape)
        >>> with auto.tuning_mode("tune"):
        ...     method_for(spec, x, y, "grads") in ("unfold", "conv", "native")  # the fastest here, timed
        True
    """
    if fixed() or spec.batch == 0 or not tunable(x, y):
        return _fixed(spec, purpose, store)
    key = _key(spec, f"{purpose}+store" if store else purpose, x)
    choice = _choices.lookup(key)
    if choice is None:
        choice = _tune(spec, x, y, purpose, store)
        _choices.remember(key, choice)
    return choice.backend


def chosen(spec: ConvSpec, purpose: str, like: torch.Tensor, store: bool = False) -> Choice | None:
    """The tuned choice for this layer and purpose on tensors like ``like``, if any."""
    return _choices.lookup(_key(spec, f"{purpose}+store" if store else purpose, like))


def _tune(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, purpose: str, store: bool) -> Choice:
    est = estimates(spec, purpose, store)
    # the reference is one of the options raced: "unfold" is none where "unfold+store" takes its place (issue 38, F3)
    reference = min(raced(spec, purpose, store), key=lambda n: (est[n], n != _fixed(spec, purpose, store)))
    # without storing, every "clip" option ends with the Book-Keeping pass: a cost they all share cannot rank them,
    # so the cost model prunes on the rest, the norms' (ghost on ResNet-18's 4x4 and 8x8 stride-2 layers: 1/11-1/28
    # of unfold's multiply-adds, measured 5-75x faster)
    dropped = prune(estimates(spec, "norms", False) if purpose == "clip" and not store else est, keep=(reference,),
                    margin=PRUNE_ESTIMATE if "fft" in est else PRUNE)  # PRUNE's evidence has no large kernel
    if all(n in dropped for n in raced(spec, purpose, store) if n != reference):
        return Choice(reference, {}, (), spec.batch)  # nothing left to compare it with: no call to time
    with torch.no_grad():
        if purpose != "clip":
            runs = {n: r for n, r in options(spec, x, y, purpose, store).items() if n not in dropped}
            choice, _ = tune(runs, spec.batch, x.device, reference, estimates=est, on=spec.batch, behind=BEHIND)
        else:
            choice = _tune_clip(spec, x, y, store, dropped, reference)
    return dataclasses.replace(choice, pending=())  # the screening decides (module doc): its fastest


def _tune_clip(spec: ConvSpec, x: torch.Tensor, y: torch.Tensor, store: bool, dropped: set[str],
               reference: str) -> Choice:
    """tune() for "clip" (``dropped``: the options the cost model pruned). The Book-Keeping pass that every option
    without "+store" ends with is the same pass: where such options race against "+store" ones, it runs once (a
    warm-up, then a timed call) and its time is added to each of theirs (``screen``'s ``extra``); where every option
    raced ends with it, it cannot change the ranking and is not run at all (ResNet-18's first clipped step ran it
    about 100 times for 11 layer shapes)."""
    racing = [n for n in raced(spec, "clip", store) if n not in dropped]
    book = len({"+" in n for n in racing}) > 1  # options with and without the pass race each other
    kept, pass_s = None, 0.0
    if book:
        book_keeping(spec, x, y)  # warm-up: its first call at this shape pays the kernel's first-call costs
        kept, pass_s = timed(lambda: book_keeping(spec, x, y), x.device)
    runs = options(spec, x, y, "clip", store, kept=kept, book=book)
    seen = screen({n: r for n, r in runs.items() if n not in dropped}, spec.batch, x.device, reference,
                  on=spec.batch, behind=BEHIND, extra={n: pass_s for n in racing if "+" not in n})
    return decide(spec.batch, seen.times, reference, seen.rejected, keep=(reference,))
