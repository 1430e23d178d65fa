"""The fft backend's chunk sizing: how many groups, samples and kernel rows one chunk of its work holds.

Integers only, no torch: the budget of one chunk's spectra (``chunk_budget``), the chunks that fit it (``chunks``,
``weight_chunks``, ``per_sample_chunks``) and the kernel rows a dense layer's spectra are split into
(``kernel_rows``), each over a ``ConvSpec`` and the transform geometry of ``sizing``; the integer rules they apply
(``budget_reals``, ``fit_chunks``, ``fit_per_sample_chunks``) come first.
"""

from __future__ import annotations

import math

from convgrad.backends.fft.sizing import bins, phases, rfft_bins
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import equal_chunk

__all__ = ["CHUNK_MIN_REALS", "WEIGHT_SCRATCH_RATIO", "budget_reals", "chunk_budget", "chunks", "fit_chunks",
           "fit_per_sample_chunks", "kernel_rows", "per_sample_chunks", "weight_chunks"]

# The measurements behind the budgets: benchmarks/results/chunk_budgets.md, and the peaks they give:
# benchmarks/results/fft_memory.md (`python benchmarks/large_kernels.py --memory-only`).
# The least a chunk's spectra hold: tiny layers are not worth more chunks, and each call's peak stays under 1.8x
# native's
CHUNK_MIN_REALS = 2**18
# grad_weight's native peak is a scratch that does not grow with the batch (``native.weight_scratch``), far under a
# quarter of x and y on depthwise layers: a grad_weight chunk holds at most this many times it (issue 28's 2x)
WEIGHT_SCRATCH_RATIO = 2


def budget_reals(x_elements: int, y_elements: int, rows: int, least: int) -> int:
    """The reals of spectra one chunk of the FFT backend holds: ``max(least, (x + y) // 4)``, and at least
    ``min(x, y)`` where a group has one kernel row (``rows == 1``: depthwise).

    fft's peak is its result plus about 8 bytes per budget real (float32: a chunk's spectra and their product or
    inverse), native's about twice its result (forward) or more, so the smaller side keeps a depthwise layer's calls
    near native's peak; with several rows a group's kernel spectra are held a slice at a time (``kernel_rows``) beside
    the samples' spectra, within a quarter of x and y; where x and y differ much a quarter of both is the larger
    (the peaks and timings: benchmarks/results/chunk_budgets.md).

    Args:
        x_elements: elements of the big side x, whole batch (int, >= 0).
        y_elements: elements of the small side y, whole batch (int, >= 0).
        rows: kernel rows (y channels) per group (int, >= 1).
        least: the smallest budget (int, >= 1): chunks of tiny layers are not worth splitting further.

    Returns:
        The budget in reals (int, >= ``least``).

    Examples:
        >>> budget_reals(802816, 802816, 1, 2**18), budget_reals(802816, 802816, 48, 2**18)
        (802816, 401408)
        >>> budget_reals(128000, 10080000, 1, 2**18), budget_reals(10, 10, 1, 2**18)
        (2552000, 262144)
    """
    return max(least, (x_elements + y_elements) // 4, min(x_elements, y_elements) if rows == 1 else 0)


def fit_chunks(kernel: int, sample: int, batch: int, groups: int, budget: int) -> tuple[int, int]:
    """(groups, samples) per chunk, so that one chunk holds about ``budget`` elements.

    ``kernel``: elements per group independent of the batch; ``sample``: per group and sample. Whole batches of as
    many groups as fit, else one group at a time and as many samples as fit; never less than one sample of one
    group (``chunks`` gives the FFT backend's sizes).

    Examples:
        >>> fit_chunks(kernel=10, sample=5, batch=4, groups=8, budget=70)
        (2, 4)
        >>> fit_chunks(kernel=10, sample=5, batch=4, groups=8, budget=20)
        (1, 2)
    """
    n = max(batch, 1)
    fit = budget // (kernel + n * sample)
    if fit >= 1:
        return min(fit, groups), n
    return 1, max(1, min(n, (budget - kernel) // sample))


def fit_per_sample_chunks(spectra: int, channel: int, batch: int, groups: int, channels: int,
                          budget: int) -> tuple[int, int, int]:
    """(groups, samples, channels) per chunk of per-sample work, so that one chunk holds about ``budget`` elements.

    ``spectra``: elements per sample and group whatever the channels of the chunk; ``channel``: per sample, group
    and channel (of ``channels`` per group). Whole groups of as many samples and groups as fit (``fit_chunks``),
    else one sample of one group and as many of its channels as fit; never less than one channel
    (``per_sample_chunks`` gives the FFT's per-sample sizes).

    Examples:
        >>> fit_per_sample_chunks(spectra=4, channel=2, batch=4, groups=8, channels=3, budget=100)
        (2, 4, 3)
        >>> fit_per_sample_chunks(spectra=4, channel=2, batch=4, groups=8, channels=3, budget=8)
        (1, 1, 2)
    """
    per = spectra + channels * channel
    if per <= budget:
        g, n = fit_chunks(0, per, batch, groups, budget)
        return g, n, channels
    return 1, 1, max(1, min(channels, (budget - spectra) // channel))


def kernel_rows(sizes: tuple[int, ...], a: int, b: int, batch: int, budget: int) -> tuple[int, int]:
    """(rows, samples) per chunk of the FFT backend: how many of one group's ``a`` kernel rows (y channels) have
    their spectra in memory at once, and how many samples then.

    One group's kernel spectra hold ``a * b`` complex bins per frequency, ``F = prod(sizes[:-1]) *
    (sizes[-1] // 2 + 1)`` frequencies of a real transform of ``sizes``. When they fit ``budget`` reals, all ``a``
    rows and the whole ``batch`` (the chunking over groups and samples, ``fit_chunks``, decides alone); else as many
    rows as fit ``budget`` (at least 1, split evenly), and as many samples as fit it with their spectra of x and of
    y's rows in the slice, ``(rows + b)`` per frequency (at least 1): x's spectra are transformed again for every
    slice unless the batch is one chunk. A grouped or dense layer thus holds a slice of a group's kernel spectra at
    a time, never more than one chunk's budget: the weight's own size is no bound, since a call's peak does not
    count the weight it is given (wav2vec2.posconv: benchmarks/results/chunk_budgets.md).

    Examples:
        >>> kernel_rows((10,), a=8, b=4, batch=3, budget=400)  # 8 * 4 * 12 = 384 fit
        (8, 3)
        >>> kernel_rows((10,), a=8, b=4, batch=3, budget=200)  # 4 rows of 48 = 192
        (4, 2)
        >>> kernel_rows((10,), a=8, b=4, batch=3, budget=100)  # 2 rows of 48 = 96
        (2, 1)
    """
    reals = 2 * rfft_bins(sizes)  # of one spectrum
    if a * b * reals <= budget:
        return a, max(batch, 1)
    rows = equal_chunk(a, max(1, budget // (b * reals)))
    return rows, max(1, min(max(batch, 1), budget // ((rows + b) * reals)))


# ---- over a ConvSpec ------------------------------------------------------------------------------------------------
def chunk_budget(spec: ConvSpec, least: int) -> int:
    """The reals of spectra one chunk of the FFT backend holds (``budget_reals`` of x's and y's elements and the
    kernel rows per group).

    Args:
        spec: the convolution.
        least: the smallest budget in reals (int, >= 1; the fft plans pass ``CHUNK_MIN_REALS``).

    Returns:
        The budget in reals (int, >= ``least``).

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> chunk_budget(ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256), 2**18)
        802816
    """
    return budget_reals(math.prod(spec.x_shape), math.prod(spec.y_shape), spec.y_group_channels, least)


def chunks(spec: ConvSpec, phase_count: int, budget: int) -> tuple[int, int]:
    """(groups, samples) per chunk of the FFT backend, so that one chunk's spectra hold about ``budget`` reals:
    per group the kernel spectra hold (C_y/g)(C_x/g)P complex bins per frequency, per group and sample the
    spectra of x and y (C_x/g)P + C_y/g (P: the live phases); ``fit_chunks`` fits them.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
        >>> chunks(spec, 1, 2**22)
        (64, 8)
        >>> chunks(spec, 1, 2**18)
        (6, 8)
    """
    a, b, reals = _group_reals(spec, phase_count)
    return fit_chunks(a * b * reals, (a + b) * reals, spec.batch, spec.groups, budget)


def weight_chunks(spec: ConvSpec, phase_count: int, budget: int) -> tuple[int, int]:
    """(groups, samples) per grad_weight chunk of the FFT backend, so that what the chunk holds at once is about
    ``budget`` reals: per group and sample 2((C_x/g)P + C_y/g) complex bins, x's and y's spectra, y's conjugate
    resolved and their product before the sum over samples (what the torch profiler saw held at the peak:
    benchmarks/results/chunk_budgets.md).

    Args:
        spec: the convolution.
        phase_count: P, the live phases of x (int, >= 1; ``sizing.phase_count``).
        budget: reals the chunk may hold (int, >= 1).

    Returns:
        ``(groups, samples)`` per chunk, each at least 1 (``fit_chunks`` with no per-group kernel term).

    Examples:
        >>> from convgrad.backends.native import weight_scratch
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96)
        >>> weight_chunks(spec, 1, 2 * weight_scratch(spec)), chunks(spec, 1, spec.side_elements // 4)
        ((1, 16), (19, 16))
    """
    a, b, reals = _group_reals(spec, phase_count)
    return fit_chunks(0, 2 * (a + b) * reals, spec.batch, spec.groups, budget)


def _group_reals(spec: ConvSpec, phase_count: int) -> tuple[int, int, int]:
    """(C_y/g, (C_x/g)P, reals of one complex spectrum of a real transform of the fft sizes)."""
    return spec.y_group_channels, spec.x_group_channels * phase_count, 2 * bins(spec)


def per_sample_chunks(spec: ConvSpec, phase_count: int, budget: int) -> tuple[int, int, int]:
    """(groups, samples, y channels per group) per chunk of per-sample weight gradients by the FFT, so that one
    chunk holds about ``budget`` reals: per sample and group the spectra of x and y, (C_x/g)P + C_y/g complex
    bins; per sample, group and y channel its product with x's spectra ((C_x/g)P complex bins), their inverse
    ((C_x/g)P transforms of V points) and the taps read from it ((C_x/g)T); ``fit_per_sample_chunks`` fits them
    (P: the live phases).

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
        >>> per_sample_chunks(spec, 1, 2**18)
        (3, 8, 1)
        >>> per_sample_chunks(ConvSpec.from_shapes((2, 64, 28, 28), (64, 64, 31, 31), padding=15), 1, 2**22)
        (1, 1, 11)
    """
    volume = math.prod([f.size for f in phases(spec)])
    reals = 2 * bins(spec)
    a, b0 = spec.y_group_channels, spec.x_group_channels
    b = b0 * phase_count
    return fit_per_sample_chunks((a + b) * reals, b * (reals + volume) + b0 * spec.taps, spec.batch, spec.groups, a,
                                 budget)
