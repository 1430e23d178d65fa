"""Chunk sizing: how many samples (or channels, or groups) one chunk of a backward holds. Integers only.

Two byte budgets, because they bound different working sets:

* ``CHUNK_BYTES`` (4 MiB): what one chunk streams through a kernel call, the gemm backend's columns and the
  chunked backend's input and grad_output; chosen as measured best on the CPU (gemm's and chunked's module
  docstrings).
* ``PHASE_CHUNK_BYTES`` (16 MiB): the fwdconv phases' results, which must still be in cache when they are
  interleaved into the big side: within the last-level cache of current server CPUs.
"""

from __future__ import annotations

__all__ = ["CHUNK_BYTES", "PHASE_CHUNK_BYTES", "equal_chunk", "fft_chunks"]

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
