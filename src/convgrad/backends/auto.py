"""The "auto" backend: per configuration and per gradient, the fastest backend that agrees with native.

Contraction: whichever candidate wins (every registered backend that can serve, ``candidates``), separately for
grad_input and grad_weight, because the fastest formulation differs per gradient and per layer.

Like ``torch.backends.cudnn.benchmark``: the first time a (configuration, gradient, dtype, device,
memory format, thread count) is seen, batch sizes counted up to the next power of two, the
candidates are tuned by ``convgrad.tuning`` (its tuner). Each runs on a slice of the batch (an
eighth, at least 4 samples): once as a probe checked against native (one that disagrees is never
chosen), once timed (again while a call runs 10% faster than the one before, twice at most: fft's
first calls on a new shape are several times its steady time; the same holds in the rounds below).
Those over 2x the fastest there are dropped, native never: a slice can
misrank the options (per-sample speeds move with the batch), so native always takes part in
what follows. The fastest runs from then on; when others survived, the calls that follow
compare them on the whole batch, each in turn twice in a row, the second call timed and paired
with the anchor's (native, if it survived) in the same round, until a clear call (3 rounds, or
fewer when one is 25% behind after one round) or up to 7 rounds for a close one. The winner is
the anchor unless another beats it by more than ``PREFER_NATIVE`` (3%, about the noise of one
tuning) in the median of those ratios.
When both gradients are wanted, the options are each backend's own backward for both, which may
share work (native's aten.convolution_backward, gemm's columns, fft's one spectrum of grad_output), and
the two per-gradient fastest one after the other ("split", when they differ), which must beat every backend by
``SPLIT_MARGIN`` (5%). One tuning screens each gradient and, where a backend shares work, its own
backward; when one backend was fastest for each gradient, it is the anchor instead of native.
Every call computes a real result, so the comparison costs no extra calls. The per-sample
methods (``convgrad.per_sample.tuning``) are chosen by the same tuner, mode, cache and buckets.

The cost of the first call: the screening, two calls of every option on the slice (for both
gradients: each backend's grad_input and grad_weight, and the own backward of native, gemm and fft),
about a quarter of a call per option; afterwards, only the difference in speed while a slower
survivor runs. Layers of the same configuration share one tuning, so a network pays once per
distinct layer shape and batch bucket: about one steady step for a CIFAR ResNet-18
(benchmarks/results/auto_first_step.md, made by ``benchmarks/first_step.py``). With
``CONVGRAD_AUTOTUNE_CACHE=1`` and the cache already written, a new process pays only the lookups.

A choice is watched on the CPU: when its calls run ``DRIFT`` (2) times slower per sample than it
was tuned at, ``DRIFT_CALLS`` (3) calls in a row, it is tuned again, at most ``MAX_RETUNES`` (2)
times per configuration: a backend's speed can change within a process, and a choice made once would keep the
slow one (benchmarks/results/auto_margins.md). Before that, native is timed once: a choice that slowed down no more
than native did (a loaded machine) is kept, its tuned times scaled.

Modes, set by ``set_mode`` or the ``CONVGRAD_AUTOTUNE`` environment variable (read on first use):

* ``"tune"`` (default): time the candidates on first use, as above. Which candidate wins depends on
  timings, so results may differ between runs in the last bits of floating point.
* ``"fixed"``: no timing; always ``FIXED_CHOICE`` ("native"), deterministic and bitwise PyTorch's.

The forward mode, set by ``set_forward_mode`` or ``CONVGRAD_AUTOTUNE_FORWARD``: ``"tune"`` (default) races the
forward as above; ``"native"`` keeps it torch's own convolution (fft's forward errs normwise: a causal conv's early
outputs move with a later spike) while the gradients are tuned as the mode says.

Persistence (off by default): ``CONVGRAD_AUTOTUNE_CACHE=1`` keeps the winners in the user cache
directory, ``CONVGRAD_AUTOTUNE_CACHE=/some/file.json`` in that file (``convgrad.tuning``'s store).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from convgrad import tuning
from convgrad.backends import Backend, backend_names, get_backend, register
from convgrad.backends.memory_format import output_like_torch
from convgrad.backends.native import forward as native_forward  # here, not per call: Dynamo would trace the import
from convgrad.spec import ConvSpec
from convgrad.tuning import (  # auto's documented names, kept from before tuning/ had its own package
    PREFER_NATIVE,
    SPLIT_MARGIN,
    Choice,
    batch_bucket,
    cache_path,
    device_name,
    fixed,
    forward_fixed,
    get_forward_mode,
    get_mode,
    set_forward_mode,
    set_mode,
    tuning_mode,
)
from convgrad.tuning import tune as _tune  # a module name, so that tests can count the tunings

__all__ = ["FIXED_CHOICE", "PREFER_NATIVE", "SPLIT_MARGIN", "Choice", "batch_bucket", "cache_path", "candidates",
           "changes", "chosen", "clear", "device_name", "dynamo_compiling", "fixed", "forward_fixed",
           "get_forward_mode", "get_mode", "memo_state", "set_forward_mode", "set_mode", "settled_native",
           "tuning_mode"]

FIXED_CHOICE = "native"

# Dynamo's own compile query where torch has it (2.3+): one Python frame, where torch.compiler.is_compiling asks
# torch.jit.is_scripting first. What is_compiling() counts besides Dynamo (non-strict export, AOTAutograd's tracing
# of a backward) runs on fake tensors, which the per-call lookups below never find settled (``tuning.tunable``)
dynamo_compiling = getattr(torch.compiler, "is_dynamo_compiling", torch.compiler.is_compiling)

Gradient = Callable[[Backend, ConvSpec, int], torch.Tensor]  # (backend, spec of n samples, n)

Key = tuple[ConvSpec, str, torch.dtype, torch.device, bool, int]


def clear() -> None:
    """Forget every tuned choice held in memory, the per-sample methods' too (the cache file is left alone)."""
    tuning.clear()


def _key(spec: ConvSpec, gradient: str, like: torch.Tensor) -> Key:
    """(spec with its batch bucketed, gradient, dtype, device, channels last, CPU threads): what a choice depends on."""
    last = not like.is_contiguous() and like.dim() >= 3 and like.shape[1] > 1 and like.stride(1) == 1
    return tuning.bucketed(spec), gradient, like.dtype, like.device, last, tuning.threads(like)


def _key_text(key: Key) -> str:
    """The key as it is stored in the cache file, naming the device model instead of its index."""
    spec, gradient, dtype, device, last, threads = key
    return (f"{spec!r}|{gradient}|{dtype}|{device.type}:{device_name(device)}|"
            f"{'channels_last' if last else 'contiguous'}|threads={threads}")


def _valid(choice: Choice) -> bool:
    """A choice read from the cache names registered backends, and "split" only with its two parts."""
    names = set(backend_names())
    splits = "split" in (choice.backend, *choice.pending)
    return ({choice.backend, *choice.pending} <= names | {"split"} and set(choice.parts) <= names
            and len(choice.parts) in ((2,) if splits else (0, 2)))


_choices = tuning.Store(_key_text, _valid)


def chosen(spec: ConvSpec, gradient: str, like: torch.Tensor) -> Choice | None:
    """The tuned choice for this configuration and gradient on tensors like ``like`` (grad_output), if any."""
    return _choices.lookup(_key(spec, gradient, like))


def candidates(spec: ConvSpec, like: torch.Tensor) -> list[Backend]:
    """The backends auto races for this layer on tensors like ``like``, native first: every registered backend
    (auto aside) made of torch ops (``differentiable``, as auto promises to be), handling this dtype, whose
    ``can_serve(spec, like)`` lets it in. Registering a backend is all it takes to be raced."""
    names = ["native", *(n for n in backend_names() if n not in ("native", "auto"))]
    return [b for b in map(get_backend, names) if b.differentiable and (not like.is_complex() or b.supports_complex)
            and b.can_serve(spec, like)]


def _head(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    """The first n samples of a batched tensor (itself when that is all of it)."""
    return t if t is None or n == t.shape[0] else t[:n]


def _sub(spec: ConvSpec, n: int) -> ConvSpec:
    """The spec of the first n samples."""
    return spec.with_batch(n)


def _shares_work(backend: Backend) -> bool:
    """Whether the backend's own backward for both gradients is more than its two gradients one after the other."""
    return type(backend).backward is not Backend.backward


def _tune_both(spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor,
               weight: torch.Tensor) -> Choice:
    """One tuning of both gradients. Each backend's grad_input and grad_weight are screened on a slice of the
    batch; so is its own backward where it shares work between the two, unless its slower gradient alone is
    already SCREEN_DROP times the best estimate for both (sharing cannot make both faster than one of them).
    The options for both (each backend's own backward, and "split") are then decided on those times, a
    backend's backward that does not share work estimated as its two gradients in a row; the survivors are
    compared on the calls that follow (``Store.run``)."""
    n, device, cands = spec.batch, grad_output.device, candidates(spec, grad_output)
    gi = {b.name: (lambda m, b=b: b.input_grad(_sub(spec, m), weight, _head(grad_output, m))) for b in cands}
    gw = {b.name: (lambda m, b=b: b.weight_grad(_sub(spec, m), _head(input, m), _head(grad_output, m))) for b in cands}
    own = {b.name: (lambda m, b=b: b.backward(_sub(spec, m), _head(grad_output, m), _head(input, m), weight, True,
                                              True)) for b in cands}
    screens = [tuning.screen(gi, n, device, "native"), tuning.screen(gw, n, device, "native")]
    ti, tw = screens[0].times, screens[1].times
    if not (ti and tw):  # native's own probe was not finite: nothing could be checked
        return Choice(FIXED_CHOICE, {}, (), n)
    bi, bw = min(ti, key=ti.__getitem__), min(tw, key=tw.__getitem__)
    estimates = {b: ti[b] + tw[b] for b in own if b in ti and b in tw}
    if bi != bw:
        estimates["split"] = ti[bi] + tw[bw]
    bound = tuning.SCREEN_DROP * min(estimates.values())
    fused = [b.name for b in cands if _shares_work(b) and b.name in estimates
             and (b.name == "native" or max(ti[b.name], tw[b.name]) <= bound)]
    screens.append(tuning.screen({b: own[b] for b in fused}, n, device, "native"))
    estimates.update(screens[2].times)
    for b in screens[2].rejected:
        estimates.pop(b, None)
    rejected = tuple(dict.fromkeys(r for s in screens for r in s.rejected))
    choice = tuning.decide(n, estimates, bi if bi == bw else "native", rejected, keep=("native",))
    return dataclasses.replace(choice, parts=(bi, bw)) if "split" in estimates else choice


def _both_call(name: str, parts: tuple[str, ...], spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor,
               weight: torch.Tensor) -> Callable[[], tuning.Result]:
    """Both gradients by one option: a backend's own backward, or "split" (its parts one after the other)."""
    if name == "split":
        bi, bw = map(get_backend, parts)
        return lambda: (bi.input_grad(spec, weight, grad_output), bw.weight_grad(spec, input, grad_output))
    backend = get_backend(name)
    return lambda: backend.backward(spec, grad_output, input, weight, True, True)


def changes() -> int:
    """A count that moves whenever a choice of "auto" changes (what was memoised from them is stale then)."""
    return _choices.changes


def memo_state() -> tuple[int, int]:
    """What a caller's memo of ``settled_native`` answers depends on beyond its call: ``tuning.modes.generation``
    (moved by every setting of the mode, every change of a choice and ``clear``) and the thread count (a key of every
    choice). A memo filled in one mode never serves in another; in fixed mode a thread change costs one miss."""
    return tuning.modes.generation, torch.get_num_threads()


def _forward_candidates(spec: ConvSpec, like: torch.Tensor) -> list[Backend]:
    """The candidates with a forward of their own (fft, fwdconv's padded input) that may differ from native here:
    ``Backend.can_serve_forward`` (fwdconv is raced for the gradients everywhere, its forward only where a large
    padding sends native to a slower kernel)."""
    return [b for b in candidates(spec, like) if b.name != "native" and hasattr(b, "forward")
            and b.can_serve_forward(spec, like)]


# Positive answers of settled_native and of "is the choice for this gradient a settled native": a memo key ->
# the spec it was computed for (kept, so that its id stays its own), valid while _choices.changes is _settled_at
_settled: dict[tuple[object, ...], ConvSpec] = {}
_settled_at = -1


def _remembered(memo: tuple[object, ...], spec: ConvSpec, compute: Callable[[], bool]) -> bool:
    """compute(), memoised when True until a choice changes: asked on every call of every layer."""
    global _settled_at
    if _settled_at != _choices.changes:
        _settled.clear()
        _settled_at = _choices.changes
    elif _settled.get(memo) is spec:
        return True
    if not compute():
        return False
    if len(_settled) >= 4096:
        _settled.clear()
    _settled[memo] = spec
    return True


def _lookup(spec: ConvSpec, what: object, like: torch.Tensor) -> tuple[tuple[object, ...], bool]:
    """The memo key of a call (what _key reads of ``like``, with the spec's identity, cheap to hash, instead of the
    bucketed spec) and whether a positive answer for it is remembered and still valid: a settled layer's call
    costs this one dict lookup (``_remembered`` and its ``compute`` are built only on a miss)."""
    last = not like.is_contiguous() and like.dim() >= 3 and like.shape[1] > 1 and like.stride(1) == 1
    memo = (id(spec), what, like.dtype, like.device, last, tuning.threads(like))
    return memo, _settled_at == _choices.changes and _settled.get(memo) is spec


def _native_settled(choice: Choice | None, device: torch.device) -> bool:
    """The choice is native, settled, and not watched for drift (``Store.watched`` would just run it)."""
    return (choice is not None and not choice.pending and choice.backend == "native"
            and (device.type != "cpu" or choice.times.get("native", 0.0) < tuning.store.DRIFT_MIN_S))


def settled_native(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, need_input: bool,
                   need_weight: bool) -> bool:
    """Whether tuning has settled on native for this convolution's forward and for the gradients a call needs
    (``need_input``, ``need_weight``; looked up for a grad_output laid out as ``input``), so that torch's own
    convolution computes the same; False while anything is still to tune or compare, or for tensors that cannot
    be tuned (a call through the backend tunes and settles them), or while a choice is watched for drift (calls
    of 1 ms and more on the CPU, see ``auto_cache``). Memoised per spec object until a choice changes."""
    memo, known = _lookup(spec, (need_input, need_weight), input)
    return known or _remembered(memo, spec, lambda: _settled_native(spec, input, weight, need_input, need_weight))


def _settled_native(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, need_input: bool,
                    need_weight: bool) -> bool:
    """settled_native without its memo."""
    if not tuning.tunable(input, weight):
        return False
    like = _key(spec, "", input)
    gradient = "both" if need_input and need_weight else "grad_input" if need_input else "grad_weight"
    for name in (gradient,) if need_input or need_weight else ():
        if not _native_settled(_choices.lookup((like[0], name, *like[2:])), input.device):
            return False
    if forward_fixed():  # the forward mode "native": torch's convolution, whatever was tuned for the forward
        return True
    choice = _choices.lookup((like[0], "forward", *like[2:]))
    if choice is not None:
        return not choice.pending and choice.backend == "native"
    return not _forward_candidates(spec, input)


def _forward_of(backend: Backend, spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, m: int) -> torch.Tensor:
    """A backend's forward of the first m samples (no bias), laid out as torch's (as the calls that follow)."""
    sub, head = _sub(spec, m), _head(input, m)
    return output_like_torch(sub, head, weight, backend.forward(sub, head, weight))  # type: ignore[arg-type, attr-defined]


# Forward keys that no backend but native may serve (their cost models said so once): not a measured choice, so
# neither stored nor written to the cache file; forgotten when a choice or the mode changes (tuning.modes.generation)
_native_only: set[Key] = set()
_native_only_at = -1


def forward(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The convolution itself through the backend tuned for it (``convgrad.conv*``, the nn modules and ``patch``
    with backend="auto"): native, or a candidate with a ``forward`` (fft; fwdconv's, on the input padded beforehand)
    where its rule lets it in (``_forward_candidates``), tuned, cached and settled like a gradient, native kept
    unless beaten by ``PREFER_NATIVE``. Native when tuning is off, the forward mode is "native"
    (``set_forward_mode``), or the tensors cannot be timed (compiling, vmap, forward AD, meta)."""
    if torch.compiler.is_compiling() or forward_fixed() or not tuning.tunable(input, weight):
        return native_forward(spec, input, weight, bias)
    key = _key(spec, "forward", input)
    known = _choices.lookup(key)
    if known is None:
        global _native_only_at
        if _native_only_at != tuning.modes.generation:
            _native_only.clear()
            _native_only_at = tuning.modes.generation
        elif key in _native_only:
            return native_forward(spec, input, weight, bias)
        cands = _forward_candidates(spec, input)
        if not cands:
            _native_only.add(key)
            return native_forward(spec, input, weight, bias)
        options: dict[str, Callable[[int], torch.Tensor]] = {
            "native": lambda m: native_forward(_sub(spec, m), _head(input, m), weight, None)}
        for b in cands:
            options[b.name] = functools.partial(_forward_of, b, spec, input, weight)
        known, _ = _tune(options, spec.batch, input.device)
        _choices.remember(key, known)

    def make(name: str) -> Callable[[], torch.Tensor]:
        if name == "native":
            return lambda: native_forward(spec, input, weight, bias)
        backend = get_backend(name)
        shape = (-1, *(1,) * spec.n)  # bias (C_out,) -> (C_out, 1, ..., 1)
        # fft's transforms lay out their own result: torch's layout (channels last on such operands) is kept
        return lambda: output_like_torch(spec, input, weight, backend.forward(spec, input, weight)  # type: ignore[attr-defined]
                                         + (0 if bias is None else bias.reshape(shape)))

    return _choices.run(key, known, spec.batch, input.device, make)


@register
class AutoBackend(Backend):
    """Delegates each gradient to the candidate chosen for it (see the module docstring)."""

    name = "auto"
    supports_complex = True
    bench_by_default = True

    def backward(self, spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
        if need_input and need_weight and self._settled_on_native(spec, "both", grad_output):
            return get_backend(FIXED_CHOICE).backward(spec, grad_output, input, weight, True, True)
        if not (need_input and need_weight) or not self._tuning(grad_output, input, weight):
            if need_input and need_weight:
                return get_backend(FIXED_CHOICE).backward(spec, grad_output, input, weight, True, True)
            gi = self.input_grad(spec, weight, grad_output) if need_input else None
            gw = self.weight_grad(spec, input, grad_output) if need_weight else None
            return gi, gw
        key = _key(spec, "both", grad_output)
        known = _choices.lookup(key)
        if known is None:
            known = _tune_both(spec, grad_output, input, weight)
            _choices.remember(key, known)
        return _choices.run(key, known, spec.batch, grad_output.device,
                            lambda name: _both_call(name, known.parts, spec, grad_output, input, weight))

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self._grad(spec, "grad_input", lambda b, s, n: b.input_grad(s, weight, _head(grad_output, n)),
                          grad_output, weight)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self._grad(spec, "grad_weight",
                          lambda b, s, n: b.weight_grad(s, _head(input, n), _head(grad_output, n)), grad_output, input)

    def choose(self, spec: ConvSpec, gradient: str, grad_output: torch.Tensor) -> Backend:
        """The backend that computes ``gradient`` (grad_input or grad_weight) now: the tuned winner, else native."""
        choice = _choices.lookup(_key(spec, gradient, grad_output)) if get_mode() == "tune" else None
        return get_backend(choice.backend if choice else FIXED_CHOICE)

    @staticmethod
    def _settled_on_native(spec: ConvSpec, gradient: str, grad_output: torch.Tensor) -> bool:
        """The choice for this gradient (or "both") is native and settled: native runs without the lookups and
        the drift watch (memoised, see settled_native); what runs is the same. The fixed mode is asked only on a
        miss: a remembered answer (from the tune mode) says native, which is what the fixed mode runs anyway."""
        if dynamo_compiling():  # Dynamo cannot trace the lookup (torch.get_num_threads)
            return False
        memo, known = _lookup(spec, gradient, grad_output)
        return known or (not fixed() and _remembered(memo, spec, lambda: tuning.tunable(grad_output) and
                                                     _native_settled(_choices.lookup(_key(spec, gradient, grad_output)),
                                                                     grad_output.device)))

    @staticmethod
    def _tuning(*tensors: torch.Tensor | None) -> bool:
        if tuning.fixed():
            return False
        return tuning.tunable(*(t for t in tensors if t is not None))

    def _grad(self, spec: ConvSpec, gradient: str, call: Gradient, grad_output: torch.Tensor,
              operand: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or tuning.fixed():
            # while torch.compile traces, as for both gradients (_tuning): no tuning, no lookup of a choice by a key
            # (torch.get_num_threads in it is untraceable), and no eager timing decides what a graph computes
            return call(get_backend(FIXED_CHOICE), spec, spec.batch)
        if self._settled_on_native(spec, gradient, grad_output):
            return call(get_backend(FIXED_CHOICE), spec, spec.batch)
        key = _key(spec, gradient, grad_output)
        known = _choices.lookup(key)
        if known is None:
            if not tuning.tunable(grad_output, operand):
                return call(get_backend(FIXED_CHOICE), spec, spec.batch)
            options = {b.name: (lambda m, b=b: call(b, _sub(spec, m), m)) for b in candidates(spec, grad_output)}
            known, out = _tune(options, spec.batch, grad_output.device)
            _choices.remember(key, known)
            if out is not None and not torch.is_grad_enabled():
                return out
        make = lambda name: lambda: call(get_backend(name), spec, spec.batch)  # noqa: E731
        if not tuning.tunable(grad_output):
            return make(known.backend)()
        return _choices.run(key, known, spec.batch, grad_output.device, make)
