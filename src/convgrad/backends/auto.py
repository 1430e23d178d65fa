"""The "auto" backend: per configuration and per gradient, the fastest backend that agrees with native.

Contraction: whichever candidate wins (native, fwdconv, gemm; see their files), separately for
grad_input and grad_weight, because the fastest formulation differs per gradient and per layer.

Like ``torch.backends.cudnn.benchmark``: the first time a (configuration, gradient, dtype, device,
memory format, thread count) is seen, batch sizes counted up to the next power of two, every
candidate computes the gradient on the real tensors once as a probe, and those that agree with
native within tolerance are timed, interleaved, a few times each (each time on its second call
in a row, after a warm-up call); the fastest, by the median over rounds of its time over
native's in the same round, is remembered. A candidate that disagreed with native on the probe
is never chosen, and one that beats native by less than ``PREFER_NATIVE`` (3%, about the noise
of one tuning) is not either. A close call (a runner-up within 10% of the best) gets more rounds,
among the options still in it, than a clear one. When both gradients are wanted, one more choice
is tuned ("both"): one backend's own backward for both, which may share work (native's
aten.convolution_backward, gemm's columns), or the two per-gradient winners one after the other
("split", when they differ). When one backend won both gradients, it is the incumbent there instead
of native. Split must beat every backend by ``SPLIT_MARGIN`` (5%).
Tuning runs under ``torch.no_grad()``; when no graph is being built, the winner's probe result is
returned, so the first call costs only the extra timings.

A choice is watched on the CPU: when its calls run ``_DRIFT`` (2) times slower per sample than it
was tuned at, ``_DRIFT_CALLS`` (3) calls in a row, it is tuned again, at most ``_MAX_RETUNES`` (2)
times per configuration. A backend's speed can change within a process (on a 2-core VM, gemm's
grad_weight of MobileNetV2's pointwise conv went from 4.6 to 11 ms per call after a few seconds,
while native stayed at 4.5-5.9 ms), and a choice made once would keep the slow one.

Modes, set by ``set_mode`` or the ``CONVGRAD_AUTOTUNE`` environment variable (read on first use):

* ``"tune"`` (default): time the candidates on first use, as above. Which candidate wins depends on
  timings, so results may differ between runs in the last bits of floating point.
* ``"fixed"``: no timing; always ``FIXED_CHOICE`` ("native"), deterministic and bitwise PyTorch's.

Persistence (off by default): ``CONVGRAD_AUTOTUNE_CACHE=1`` keeps the winners in the user cache
directory, ``CONVGRAD_AUTOTUNE_CACHE=/some/file.json`` in that file (``convgrad.backends.auto_cache``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator

import torch

from convgrad._ops import plain
from convgrad.backends import Backend, auto_cache, backend_names, get_backend, register
from convgrad.backends.auto_cache import cache_path, device_name
from convgrad.backends.auto_tuning import PREFER_NATIVE, SPLIT_MARGIN, Choice, Result
from convgrad.backends.auto_tuning import tune as _tune
from convgrad.spec import ConvSpec

__all__ = ["CANDIDATES", "FIXED_CHOICE", "PREFER_NATIVE", "SPLIT_MARGIN", "Choice", "batch_bucket", "cache_path",
           "chosen", "clear", "device_name", "get_mode", "set_mode", "tuning_mode"]

CANDIDATES: tuple[str, ...] = ("native", "fwdconv", "gemm", "channels_last", "regroup")  # those registered take part
FIXED_CHOICE = "native"
MODES = ("tune", "fixed")
# The watch (module docstring): calls this many times slower per sample than tuned, this many in a row, re-tune;
# choices tuned faster than _DRIFT_MIN_S are not watched (cold caches alone slow down tiny calls, and little is lost)
_DRIFT, _DRIFT_CALLS, _MAX_RETUNES, _DRIFT_MIN_S = 2.0, 3, 2, 1e-3

Gradient = Callable[[Backend], torch.Tensor]


_mode: str | None = None  # None: not read from the environment yet
Key = tuple[ConvSpec, str, torch.dtype, torch.device, bool, int]
_choices: dict[Key, Choice] = {}
_slow: dict[Key, int] = {}  # calls in a row that ran _DRIFT times slower than tuned
_retunes: dict[Key, int] = {}


def set_mode(mode: str) -> str:
    """Switch "auto" between ``"tune"`` (time candidates on first use) and ``"fixed"`` (always native).

    Args:
        mode: ``"tune"`` or ``"fixed"``.

    Returns:
        The previous mode.

    Raises:
        ValueError: an unknown mode.

    Examples:
        >>> from convgrad.backends import auto
        >>> previous = auto.set_mode("fixed")
        >>> auto.get_mode()
        'fixed'
        >>> _ = auto.set_mode(previous)
    """
    global _mode
    if mode not in MODES:
        raise ValueError(f"set_mode: mode={mode!r} must be one of {MODES}")
    previous, _mode = get_mode(), mode
    return previous


def get_mode() -> str:
    """The current mode; on first use read from ``CONVGRAD_AUTOTUNE`` (default ``"tune"``)."""
    global _mode
    if _mode is None:
        env = os.environ.get("CONVGRAD_AUTOTUNE", "tune").strip().lower() or "tune"
        if env not in MODES:
            raise ValueError(f"convgrad: CONVGRAD_AUTOTUNE={env!r} must be one of {MODES}")
        _mode = env
    return _mode


@contextlib.contextmanager
def tuning_mode(mode: str) -> Iterator[None]:
    """Run a block in the given mode, then restore the previous one."""
    previous = set_mode(mode)
    try:
        yield
    finally:
        set_mode(previous)


def clear() -> None:
    """Forget every tuned choice held in memory (the cache file, if any, is left alone)."""
    _choices.clear()
    _slow.clear()
    _retunes.clear()
    auto_cache.clear()


def batch_bucket(batch: int) -> int:
    """The batch size a choice is tuned for: the next power of two (0 stays 0).

    Batches that share a bucket share one tuning. DP-SGD with Poisson sampling (Opacus, our
    examples/dp_sgd_digits.py) draws a new batch size at every step; keyed by the exact size, every
    step would tune again. Within a factor of two the ranking of the candidates hardly moves.

    Args:
        batch: N, the batch size of the configuration (int, >= 0).

    Returns:
        The smallest power of two >= ``batch``; 0 for an empty batch.

    Examples:
        >>> from convgrad.backends import auto
        >>> [auto.batch_bucket(n) for n in (0, 1, 3, 4, 300)]
        [0, 1, 4, 4, 512]
    """
    return 1 << (batch - 1).bit_length() if batch > 0 else 0


def _key(spec: ConvSpec, gradient: str, like: torch.Tensor) -> Key:
    """(spec with its batch bucketed, gradient, dtype, device, channels last, CPU threads): what a choice depends on."""
    last = like.dim() >= 3 and like.shape[1] > 1 and like.stride(1) == 1 and not like.is_contiguous()
    threads = torch.get_num_threads() if like.device.type == "cpu" else 0
    spec = dataclasses.replace(spec, batch=batch_bucket(spec.batch))
    return spec, gradient, like.dtype, like.device, last, threads


def _key_text(key: Key) -> str:
    """The key as it is stored in the cache file, naming the device model instead of its index."""
    spec, gradient, dtype, device, last, threads = key
    return (f"{spec!r}|{gradient}|{dtype}|{device.type}:{device_name(device)}|"
            f"{'channels_last' if last else 'contiguous'}|threads={threads}")


def chosen(spec: ConvSpec, gradient: str, like: torch.Tensor) -> Choice | None:
    """The tuned choice for this configuration and gradient on tensors like ``like`` (grad_output), if any."""
    return _lookup(_key(spec, gradient, like))


def _lookup(key: Key) -> Choice | None:
    """The choice in memory, else in the cache file."""
    if key in _choices:
        return _choices[key]
    entry = auto_cache.entry(_key_text(key))
    if entry is None or entry.get("backend") not in (*backend_names(), "split"):
        return None
    try:  # an entry edited by hand or written by another version: ignored, tuned again
        _choices[key] = Choice(str(entry["backend"]), {str(n): float(t) for n, t in entry.get("times", {}).items()},
                               tuple(map(str, entry.get("rejected", ()))), int(entry.get("batch", 0)))
    except (TypeError, ValueError, AttributeError):
        return None
    return _choices[key]


def _save() -> None:
    auto_cache.save({_key_text(k): {"backend": c.backend, "times": c.times, "rejected": list(c.rejected),
                                    "batch": c.batch} for k, c in _choices.items()})


def _tunable(*tensors: torch.Tensor) -> bool:
    """Real tensors only: no tuning while compiling, on meta/fake tensors, subclasses, or under vmap or forward AD."""
    if torch.compiler.is_compiling():
        return False
    return all(plain(t) and t.device.type != "meta" for t in tensors)


def _watched(key: Key, choice: Choice, batch: int, run: Callable[[], Result]) -> Result:
    """Run the chosen option; on the CPU, time it, and forget the choice (the next call tunes again) once it ran
    _DRIFT times slower per sample than tuned, _DRIFT_CALLS calls in a row."""
    tuned = choice.times.get(choice.backend, 0.0)
    if (key[3].type != "cpu" or tuned < _DRIFT_MIN_S or not (choice.batch and batch)
            or _retunes.get(key, 0) >= _MAX_RETUNES):
        return run()
    start = time.perf_counter()
    out = run()
    slow = (time.perf_counter() - start) / batch > _DRIFT * tuned / choice.batch
    _slow[key] = _slow.get(key, 0) + 1 if slow else 0
    if _slow[key] >= _DRIFT_CALLS:
        _retunes[key] = _retunes.get(key, 0) + 1
        del _slow[key], _choices[key]
        auto_cache.forget(_key_text(key))
    return out


def _candidates(spec: ConvSpec, like: torch.Tensor) -> list[Backend]:
    """The registered candidates that handle this dtype, native first; a backend with a ``can_serve(spec, like)``
    rule takes part only where that rule says it can differ from native."""
    names = ["native", *(n for n in CANDIDATES if n != "native" and n in backend_names())]
    return [b for b in map(get_backend, names) if (not like.is_complex() or b.supports_complex)
            and getattr(b, "can_serve", lambda spec, like: True)(spec, like)]


@register
class AutoBackend(Backend):
    """Delegates each gradient to the candidate chosen for it (see the module docstring)."""

    name = "auto"
    supports_complex = True

    def backward(self, spec, grad_output, input, weight, need_input, need_weight):  # type: ignore[no-untyped-def]
        if not (need_input and need_weight) or not self._tuning(grad_output, input, weight):
            if need_input and need_weight:
                return get_backend(FIXED_CHOICE).backward(spec, grad_output, input, weight, True, True)
            gi = self.input_grad(spec, weight, grad_output) if need_input else None
            gw = self.weight_grad(spec, input, grad_output) if need_weight else None
            return gi, gw
        key = _key(spec, "both", grad_output)
        known = _lookup(key)
        if known is None:
            with torch.no_grad():  # first the per-gradient winners: they make the "split" option
                self.input_grad(spec, weight, grad_output)
                self.weight_grad(spec, input, grad_output)
            bi, bw = (self.choose(spec, g, grad_output) for g in ("grad_input", "grad_weight"))
            # every backend's own backward (both gradients, what a user who picks one backend gets), and the
            # per-gradient winners one after the other when they differ
            options = {b.name: (lambda b=b: b.backward(spec, grad_output, input, weight, True, True))
                       for b in _candidates(spec, grad_output)}
            if bi.name != bw.name:
                options["split"] = lambda: (bi.input_grad(spec, weight, grad_output),
                                            bw.weight_grad(spec, input, grad_output))
            known, out = _tune(options, grad_output.device, spec.batch, bi.name if bi.name == bw.name else "native")
            _choices[key] = known
            _save()
            if not torch.is_grad_enabled():
                return out
        if known.backend == "split":  # each gradient's own choice, watched on its own
            return self.input_grad(spec, weight, grad_output), self.weight_grad(spec, input, grad_output)
        backend = get_backend(known.backend)
        return _watched(key, known, spec.batch,
                        lambda: backend.backward(spec, grad_output, input, weight, True, True))

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self._grad(spec, "grad_input", lambda b: b.input_grad(spec, weight, grad_output), grad_output, weight)

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        return self._grad(spec, "grad_weight", lambda b: b.weight_grad(spec, input, grad_output), grad_output, input)

    def choose(self, spec: ConvSpec, gradient: str, grad_output: torch.Tensor) -> Backend:
        """The backend that computes ``gradient`` (grad_input or grad_weight) now: the tuned winner, else native."""
        choice = _lookup(_key(spec, gradient, grad_output)) if get_mode() == "tune" else None
        return get_backend(choice.backend if choice else FIXED_CHOICE)

    @staticmethod
    def _tuning(*tensors: torch.Tensor | None) -> bool:
        if _mode == "fixed" or (_mode is None and get_mode() == "fixed"):
            return False
        return _tunable(*(t for t in tensors if t is not None))

    def _grad(self, spec: ConvSpec, gradient: str, call: Gradient, grad_output: torch.Tensor,
              operand: torch.Tensor) -> torch.Tensor:
        if _mode == "fixed" or (_mode is None and get_mode() == "fixed"):
            return call(get_backend(FIXED_CHOICE))
        key = _key(spec, gradient, grad_output)
        known = _choices.get(key) or _lookup(key)
        if known is not None:
            backend = get_backend(known.backend)
            return _watched(key, known, spec.batch, lambda: call(backend)) if _tunable(grad_output) else call(backend)
        if not _tunable(grad_output, operand):
            return call(get_backend(FIXED_CHOICE))
        known, out = _tune({b.name: (lambda b=b: call(b)) for b in _candidates(spec, grad_output)}, grad_output.device,
                           spec.batch)
        _choices[key] = known
        _save()
        return call(get_backend(known.backend)) if torch.is_grad_enabled() else out
