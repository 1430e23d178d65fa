"""Chunk sizing: how many samples (or channels, or groups) one chunk of a backward holds. Integers only.

Two byte budgets, because they bound different working sets; the measurements behind them are in
``benchmarks/results/chunk_budgets.md``.
"""

from __future__ import annotations

__all__ = ["CHUNK_BYTES", "PHASE_CHUNK_BYTES", "chunk_ranges", "equal_chunk"]

# What one chunk streams through a kernel call (gemm's columns, the chunked backend's input and grad_output): a few
# MiB stays in the caches, where a whole batch's rows slow oneDNN's backward down (chunk_budgets.md)
CHUNK_BYTES = 4 * 2**20
# fwdconv's memory-bound phases, whose results must still be in cache when interleaved into the big side: within the
# last-level cache of current server CPUs (chunk_budgets.md)
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


def chunk_ranges(total: int, step: int) -> list[tuple[int, int]]:
    """[(start, stop)] of consecutive chunks of ``step`` items (the last one shorter) covering ``total`` items.

    Examples:
        >>> chunk_ranges(7, 3), chunk_ranges(0, 3)
        ([(0, 3), (3, 6), (6, 7)], [])
    """
    return [(j, min(j + step, total)) for j in range(0, total, step)]
