"""Chunk sizing: how many samples (or channels, or groups) one chunk of a backward holds. Integers only.

Two byte budgets, because they bound different working sets:

* ``CHUNK_BYTES`` (4 MiB): what one chunk streams through a kernel call, the gemm backend's columns and the
  chunked backend's input and grad_output; chosen as measured best on the CPU (gemm's and chunked's module
  docstrings).
* ``PHASE_CHUNK_BYTES`` (16 MiB): the fwdconv phases' results, which must still be in cache when they are
  interleaved into the big side: within the last-level cache of current server CPUs.
"""

from __future__ import annotations

from convgrad.spec.formulation import rfft_bins

__all__ = ["CHUNK_BYTES", "PHASE_CHUNK_BYTES", "chunk_ranges", "equal_chunk", "fft_budget", "fft_chunks",
           "fft_kernel_rows", "fft_per_sample_chunks"]

CHUNK_BYTES = 4 * 2**20
PHASE_CHUNK_BYTES = 16 * 2**20


def equal_chunk(total: int, most: int) -> int:
    """The chunk size that splits ``total`` into as few chunks of at most ``most`` as possible, evenly.

    Args:
        total: items to split (int, >= 1).
        most: the largest chunk allowed (int, >= 1).

    Returns:
        ``ceil(total / count)`` with ``count = ceil(total / min(most, total))``: the last chunk is at most one
        smaller than the others.

    Examples:
        >>> equal_chunk(33, 8), equal_chunk(30, 8), equal_chunk(4, 100)
        (7, 8, 4)
    """
    count = -(-total // min(most, total))
    return -(-total // count)


def fft_budget(x_elements: int, y_elements: int, rows: int, least: int) -> int:
    """The reals of spectra one chunk of the FFT backend holds: ``max(least, (x + y) // 4)``, and at least
    ``min(x, y)`` where a group has one kernel row (``rows == 1``: depthwise).

    fft's peak is its result plus about 8 bytes per budget real (float32: a chunk's spectra and their product or
    inverse), native's about twice its result (forward) or more, so the smaller side keeps a depthwise layer's calls
    within 1.7x native's (UniRepLKNet 13x13's forward: 1.68x; benchmarks/results/fft_memory.md). With several rows
    a group's kernel spectra are held a slice at a time (``fft_kernel_rows``), up to a budget beside the samples'
    spectra: a quarter of x and y (wav2vec 2.0's forward at the smaller side: 1.87x). Where x and y differ (SincNet's
    y is 79x its x) a quarter of both is the larger. Twice the groups a chunk ran RepLKNet's, SLaK's, UniRepLKNet's
    and Hyena's fft calls 1.05-1.29x faster (2 threads, quiet, interleaved with the quarter); 3D UX-Net's no faster.

    Args:
        x_elements: elements of the big side x, whole batch (int, >= 0).
        y_elements: elements of the small side y, whole batch (int, >= 0).
        rows: kernel rows (y channels) per group (int, >= 1).
        least: the smallest budget (int, >= 1): chunks of tiny layers are not worth splitting further.

    Returns:
        The budget in reals (int, >= ``least``).

    Examples:
        >>> fft_budget(802816, 802816, 1, 2**18), fft_budget(802816, 802816, 48, 2**18)
        (802816, 401408)
        >>> fft_budget(128000, 10080000, 1, 2**18), fft_budget(10, 10, 1, 2**18)
        (2552000, 262144)
    """
    return max(least, (x_elements + y_elements) // 4, min(x_elements, y_elements) if rows == 1 else 0)


def fft_chunks(kernel: int, sample: int, batch: int, groups: int, budget: int) -> tuple[int, int]:
    """(groups, samples) per chunk, so that one chunk holds about ``budget`` elements.

    ``kernel``: elements per group independent of the batch; ``sample``: per group and sample. Whole batches of as
    many groups as fit, else one group at a time and as many samples as fit; never less than one sample of one
    group (``ConvSpec.fft_chunks`` gives the FFT backend's sizes).

    Examples:
        >>> fft_chunks(kernel=10, sample=5, batch=4, groups=8, budget=70)
        (2, 4)
        >>> fft_chunks(kernel=10, sample=5, batch=4, groups=8, budget=20)
        (1, 2)
    """
    n = max(batch, 1)
    fit = budget // (kernel + n * sample)
    if fit >= 1:
        return min(fit, groups), n
    return 1, max(1, min(n, (budget - kernel) // sample))


def fft_per_sample_chunks(spectra: int, channel: int, batch: int, groups: int, channels: int,
                          budget: int) -> tuple[int, int, int]:
    """(groups, samples, channels) per chunk of per-sample work, so that one chunk holds about ``budget`` elements.

    ``spectra``: elements per sample and group whatever the channels of the chunk; ``channel``: per sample, group
    and channel (of ``channels`` per group). Whole groups of as many samples and groups as fit (``fft_chunks``),
    else one sample of one group and as many of its channels as fit; never less than one channel
    (``ConvSpec.fft_per_sample_chunks`` gives the FFT's per-sample sizes).

    Examples:
        >>> fft_per_sample_chunks(spectra=4, channel=2, batch=4, groups=8, channels=3, budget=100)
        (2, 4, 3)
        >>> fft_per_sample_chunks(spectra=4, channel=2, batch=4, groups=8, channels=3, budget=8)
        (1, 1, 2)
    """
    per = spectra + channels * channel
    if per <= budget:
        g, n = fft_chunks(0, per, batch, groups, budget)
        return g, n, channels
    return 1, 1, max(1, min(channels, (budget - spectra) // channel))


def chunk_ranges(total: int, step: int) -> list[tuple[int, int]]:
    """[(start, stop)] of consecutive chunks of ``step`` items (the last one shorter) covering ``total`` items.

    Examples:
        >>> chunk_ranges(7, 3), chunk_ranges(0, 3)
        ([(0, 3), (3, 6), (6, 7)], [])
    """
    return [(j, min(j + step, total)) for j in range(0, total, step)]


def fft_kernel_rows(sizes: tuple[int, ...], a: int, b: int, batch: int, budget: int) -> tuple[int, int]:
    """(rows, samples) per chunk of the FFT backend: how many of one group's ``a`` kernel rows (y channels) have
    their spectra in memory at once, and how many samples then.

    One group's kernel spectra hold ``a * b`` complex bins per frequency, ``F = prod(sizes[:-1]) *
    (sizes[-1] // 2 + 1)`` frequencies of a real transform of ``sizes``. When they fit ``budget`` reals, all ``a``
    rows and the whole ``batch`` (the chunking over groups and samples, ``fft_chunks``, decides alone); else as many
    rows as fit ``budget`` (at least 1, split evenly), and as many samples as fit it with their spectra of x and of
    y's rows in the slice, ``(rows + b)`` per frequency (at least 1): x's spectra are transformed again for every
    slice unless the batch is one chunk. A grouped or dense layer thus holds a slice of a group's kernel spectra at
    a time, never more than one chunk's budget: the weight's own size is no bound, since a call's peak does not
    count the weight it is given (wav2vec2.posconv's forward: a group's spectra 1.7x its output, the weight 6x).

    Examples:
        >>> fft_kernel_rows((10,), a=8, b=4, batch=3, budget=400)  # 8 * 4 * 12 = 384 fit
        (8, 3)
        >>> fft_kernel_rows((10,), a=8, b=4, batch=3, budget=200)  # 4 rows of 48 = 192
        (4, 2)
        >>> fft_kernel_rows((10,), a=8, b=4, batch=3, budget=100)  # 2 rows of 48 = 96
        (2, 1)
    """
    bins = 2 * rfft_bins(sizes)  # reals
    if a * b * bins <= budget:
        return a, max(batch, 1)
    rows = equal_chunk(a, max(1, budget // (b * bins)))
    return rows, max(1, min(max(batch, 1), budget // ((rows + b) * bins)))
