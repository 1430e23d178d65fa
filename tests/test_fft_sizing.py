"""The fft backend's integer arithmetic (backends/fft/sizing.py, chunking.py) against definitions written out here.

Transform lengths, the polyphase split (phases, slots, pads), the bins of a real transform, the chunk budget and the
chunks that fit it: each checked against a brute-force reading of its definition (a search, an enumeration of rows,
numpy's own rfftn) over small grids, and against the worked examples of the docs. These are the tests mutation testing
runs on the fft modules (pyproject.toml's [tool.mutmut], tests/mutation_survivors.md); they call the functions
themselves, never the cached ``plan``, so that a mutant is not hidden by a plan cached before it.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from convgrad.backends.fft import chunking, sizing
from convgrad.backends.fft.sizing import FftDim, fft_phase, fft_size, rfft_bins, smooth_size
from convgrad.backends.native import weight_scratch
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import equal_chunk
from helpers import grid_cases, random_cases


def smooth(m: int) -> bool:
    """Whether m has no prime factor above 5 (written out here, independent of the module's own rule)."""
    for p in (2, 3, 5):
        while m % p == 0:
            m //= p
    return m == 1


# ---- transform lengths and bins -------------------------------------------------------------------------------------
def test_smooth_size_is_the_smallest_5_smooth_not_below_n() -> None:
    for n in range(1, 400):
        want = next(m for m in range(n, 4 * n) if smooth(m))
        assert smooth_size(n) == want, n


def test_fft_size_is_the_smallest_even_5_smooth_not_below_n() -> None:
    """Odd real-transform lengths cost twice as much per point (benchmarks/results/fft_sizes.md): 45 -> 48, 81 -> 90."""
    for n in range(1, 400):
        want = next(m for m in range(n, 4 * n) if smooth(m) and (m % 2 == 0 or m == 1))
        assert fft_size(n) == want, n
    assert all(sizing.phases(case.spec())[-1].size % 2 == 0 or sizing.phases(case.spec())[-1].size == 1
               for case in grid_cases())


def test_rfft_bins_are_numpys_rfftn_output() -> None:
    for sizes in [*((n,) for n in range(1, 12)), *itertools.product(range(1, 7), repeat=2), (3, 4, 5), (2, 5, 6)]:
        assert rfft_bins(sizes) == np.fft.rfftn(np.zeros(sizes)).size, sizes


# ---- the polyphase split of one dim -------------------------------------------------------------------------------
def _dims() -> list[tuple[int, int, int, int, int, int]]:
    """(i, k, s, d, p_lo, p_hi) of 1d convs with at least one output row: every stride and dilation up to 3 with
    leftover rows, crops of the read x (p_hi < 0 in x_read_pads) and kernels longer than the input; and one or two
    rows of x behind so much padding that the conv reads none of them (every read row a zero)."""
    grids = [itertools.product(range(1, 9), range(1, 5), range(1, 4), range(1, 4), range(3), range(3)),
             itertools.product(range(1, 3), range(1, 7), range(1, 5), range(1, 4), range(3, 12), range(2))]
    return [(i, k, s, d, lo, hi) for i, k, s, d, lo, hi in itertools.chain(*grids)
            if i + lo + hi - d * (k - 1) - 1 >= 0]


def _rows_of_x(i: int, lo: int, s: int, rows: int) -> list[bool]:
    """Per row r of the phases (s*rows rows of x padded by lo before), whether some phase's row r holds x's data."""
    return [any(lo <= s * r + phi < lo + i for phi in range(s)) for r in range(rows)]


@pytest.mark.parametrize("last", [True, False])
def test_fft_phase_is_its_definition(last: bool) -> None:
    """Tap t reads padded row j*s + t*d, row j + q of phase phi with t*d = s*q + phi: the live phases, Q, U = o + Q - 1,
    each tap's slot phase*Q + q, the pads of x to s*U and s*L rows, counted from the taps themselves; L the smallest
    5-smooth (even in the last dim) length of at least o, Q and U less the fewer of the leading and trailing rows that
    are zero in every phase (counted by enumerating the rows), and long enough that every read past L wraps a zero
    onto a zero."""
    for i, k, s, d, lo, hi in _dims():
        spec = ConvSpec.from_shapes((1, 1, i), (1, 1, k), stride=s, dilation=d, padding=((lo, hi),))
        o, (pads,), (size,) = spec.y_size[0], spec.x_read_pads, spec.x_read_size
        got = fft_phase(i, k, s, d, o, pads, size, last)
        phases = sorted({t * d % s for t in range(k)})
        q = max(t * d // s for t in range(k)) + 1
        rows = o + q - 1
        assert (got.phases, got.taps, got.rows) == (tuple(phases), q, rows), (i, k, s, d, lo, hi)
        assert got.slots == tuple(phases.index(t * d % s) * q + t * d // s for t in range(k))
        assert got.pads == (pads[0], s * rows - pads[0] - i)
        data = _rows_of_x(i, pads[0], s, rows)
        lead = next((r for r, held in enumerate(data) if held), rows)
        trail = next((r for r, held in enumerate(reversed(data)) if held), rows)
        want = (fft_size if last else smooth_size)(max(rows - min(lead, trail), o, q, 1))
        assert got.size == want, (i, k, s, d, lo, hi)
        assert got.transform_pads == (pads[0], s * got.size - pads[0] - i)
        if last:  # the last dim is the default (the one a real transform halves)
            assert fft_phase(i, k, s, d, o, pads, size) == got
        # every read past the transform length wraps a zero row onto a zero row (all phases alike)
        zero = [not held for held in data]
        for j, t in itertools.product(range(o), range(q)):
            if j + t >= got.size:
                assert zero[j + t] and zero[(j + t) % got.size], (i, k, s, d, lo, hi, j, t)


def _padded(i: int, pads: tuple[int, int]) -> list[int | None]:
    """x's rows 0..i-1 padded by (lo, hi) with None (a negative amount crops)."""
    lo, hi = pads
    rows: list[int | None] = [None] * max(lo, 0) + list(range(max(-lo, 0), i)) + [None] * max(hi, 0)
    return rows[:len(rows) + min(hi, 0)] if hi < 0 else rows


def test_phase_pads_split_the_transform_pads_into_whole_rows_and_zero_rows() -> None:
    """x padded by the first pair, split into its s phases, each padded by the second pair (c, e), is x padded by
    ``transform_pads`` and split: the phases' zero rows go to (c, e) whole, what is left (< s) to the first pair; M
    (``whole_rows``, never negative) rows a phase after the first pair, L after both; where the conv reads none of
    x's rows, no more zero rows than the transform holds."""
    for i, k, s, d, lo, hi in _dims():
        spec = ConvSpec.from_shapes((1, 1, i), (1, 1, k), stride=s, dilation=d, padding=((lo, hi),))
        dim = sizing.phases(spec)[0]
        (a, b), (c, e) = dim.phase_pads(s)
        whole = _padded(i, dim.transform_pads)
        split = _padded(i, (a, b))
        m = dim.whole_rows(s)
        assert len(split) == s * m and m + c + e == dim.size, (i, k, s, d, lo, hi)
        for phi in range(s):
            assert [None] * c + split[phi::s] + [None] * e == whole[phi::s], (i, k, s, d, lo, hi, phi)
        whole_zero = [max(v, 0) // s for v in dim.transform_pads]  # whole zero rows a phase, at most L of them
        assert c == min(whole_zero[0], dim.size) and e == min(whole_zero[1], dim.size - c) and m >= 0


def test_fft_transform_length_drops_the_padding_rows_that_wrap_onto_zeros() -> None:
    """L >= U - min(lead, trail) = 43 for a 31x31 kernel padded 15 on 28 rows (U = 58): 5-smooth (45), even in the
    last dim (48); fft_size(U) when causal."""
    dims = sizing.phases(ConvSpec.from_shapes((1, 1, 28, 28), (1, 1, 31, 31), padding=15))
    assert [(d.rows, d.size) for d in dims] == [(58, 45), (58, 48)]
    (causal,) = sizing.phases(ConvSpec.from_shapes((1, 1, 64), (1, 1, 64), padding=((63, 0),)))
    assert (causal.rows, causal.size) == (127, fft_size(127))
    assert sizing.phases(ConvSpec.from_shapes((1, 1, 9), (1, 1, 3), stride=2, dilation=2))[0] == FftDim(
        phases=(0,), taps=3, rows=5, pads=(0, 1), size=6, slots=(0, 1, 2), transform_pads=(0, 3))


# ---- over a ConvSpec --------------------------------------------------------------------------------------------
def test_phases_count_and_bins_of_a_spec_are_its_dims() -> None:
    """Each dim of ``phases`` is ``fft_phase`` of that dim (only the last one even); P counts the N-d phases some tap
    reaches (enumerated over every tap); the bins are numpy's rfftn output of the transform lengths."""
    for case in grid_cases() + random_cases(40, seed=7):
        spec = case.spec()
        dims = sizing.phases(spec)
        for j, dim in enumerate(dims):
            assert dim == fft_phase(spec.x_size[j], spec.kernel_size[j], spec.stride[j], spec.dilation[j],
                                    spec.y_size[j], spec.x_read_pads[j], spec.x_read_size[j], j == spec.n - 1)
        reached = {tuple(t * d % s for t, s, d in zip(tap, spec.stride, spec.dilation))
                   for tap in itertools.product(*(range(k) for k in spec.kernel_size))}
        assert sizing.phase_count(spec) == len(reached), str(case)
        assert sizing.bins(spec) == np.fft.rfftn(np.zeros([d.size for d in dims])).size, str(case)


def test_fft_phases_reduce_to_stride_phases_with_dilation_1() -> None:
    for case in grid_cases() + random_cases(40, seed=7):
        spec = case.spec()
        if all(d == 1 for d in spec.dilation):
            assert tuple(f[1:4] for f in sizing.phases(spec)) == spec.stride_phases, str(case)


# ---- the chunk budget and the chunks that fit it --------------------------------------------------------------------
def test_budget_reals_is_the_least_that_covers_its_three_floors() -> None:
    """The smallest budget of at least ``least``, a quarter of x and y, and on depthwise layers (one kernel row a
    group) the smaller of x and y; the docs' examples (RepLKNet 31x31, SincNet's y 79x its x)."""
    for x, y, rows, least in itertools.product((0, 3, 40, 97), (0, 5, 64), (1, 2, 48), (1, 8, 30)):
        floors = [least, (x + y) // 4] + ([min(x, y)] if rows == 1 else [])
        want = next(v for v in range(0, 200) if all(v >= f for f in floors))
        assert chunking.budget_reals(x, y, rows, least) == want, (x, y, rows, least)
    assert chunking.budget_reals(802816, 802816, 1, 2**18) == 802816
    assert chunking.budget_reals(802816, 802816, 48, 2**18) == 401408
    assert chunking.budget_reals(128000, 10080000, 1, 2**18) == 2552000


def _most(limit: int, costs: list[int], budget: int) -> int:
    """The largest m in 1..limit whose cost (``costs[m - 1]``) is within the budget, or 1 (at least one of each)."""
    return max((m for m in range(1, limit + 1) if costs[m - 1] <= budget), default=1)


def test_fit_chunks_takes_whole_batches_of_groups_else_samples_of_one_group() -> None:
    for kernel, sample, batch, groups, budget in itertools.product((0, 3, 10), (1, 5), (0, 1, 4), (1, 3, 8),
                                                                   (1, 7, 20, 70, 500)):
        n = max(batch, 1)
        g = _most(groups, [m * (kernel + n * sample) for m in range(1, groups + 1)], budget)
        if g * (kernel + n * sample) <= budget:
            want = (g, n)
        else:
            want = (1, _most(n, [kernel + m * sample for m in range(1, n + 1)], budget))
        assert chunking.fit_chunks(kernel, sample, batch, groups, budget) == want, (kernel, sample, batch, groups,
                                                                                    budget)


def test_fit_per_sample_chunks_cuts_channels_only_when_a_sample_of_a_group_does_not_fit() -> None:
    """Whole groups of samples and groups as fit (``fit_chunks``); else one sample of one group and as many of its
    channels as fit, at least one; what a chunk holds stays within the budget wherever one channel fits."""
    spectra, channel = 40, 30
    for batch, groups, channels in ((1, 1, 1), (4, 8, 3), (7, 5, 16), (32, 64, 1)):
        per = spectra + channels * channel
        exact = [m * per for m in (1, batch, 2 * batch)]  # a whole sample, a whole batch, two groups of it
        for budget in (1, 41, 70, 100, 500, 5000, 50_000, *exact, *(v - 1 for v in exact)):
            got = chunking.fit_per_sample_chunks(spectra, channel, batch, groups, channels, budget)
            if per <= budget:  # whole groups of whole batches, else one group and as many samples as fit
                g = _most(groups, [m * batch * per for m in range(1, groups + 1)], budget)
                n = batch if g * batch * per <= budget else _most(batch, [m * per for m in range(1, batch + 1)], budget)
                want = (g, n, channels)
            else:
                want = (1, 1, _most(channels, [spectra + a * channel for a in range(1, channels + 1)], budget))
            assert got == want, (budget, batch, groups, channels)
            g, n, a = got
            assert 1 <= g <= groups and 1 <= n <= batch and 1 <= a <= channels
            if spectra + channel <= budget:
                assert g * n * (spectra + a * channel) <= budget
    assert chunking.fit_per_sample_chunks(40, 30, 4, 8, 3, 100) == (1, 1, 2)  # 40 + 2 * 30 <= 100 < 40 + 3 * 30


def test_kernel_rows_are_every_row_where_they_fit_else_even_slices_within_the_budget() -> None:
    for sizes, a, b, batch, budget in itertools.product(((10,), (4, 6), (5,)), (1, 3, 8), (1, 4), (0, 1, 3),
                                                        (1, 50, 100, 200, 400, 10_000, "exact")):
        reals = 2 * np.fft.rfftn(np.zeros(sizes)).size
        budget = a * b * reals if budget == "exact" else budget  # every row's spectra just fit
        if a * b * reals <= budget:
            want = (a, max(batch, 1))
        else:
            most = _most(a, [r * b * reals for r in range(1, a + 1)], budget)
            chunks = -(-a // most)
            rows = -(-a // chunks)  # as few slices of at most `most` rows as can be, as even as can be
            want = (rows, _most(max(batch, 1), [m * (rows + b) * reals for m in range(1, max(batch, 1) + 1)], budget))
        assert chunking.kernel_rows(sizes, a, b, batch, budget) == want, (sizes, a, b, batch, budget)
    assert [chunking.kernel_rows((10,), 8, 4, 3, budget) for budget in (400, 200, 100)] == [(8, 3), (4, 2), (2, 1)]
    assert equal_chunk(8, 3) == 3


def test_the_chunks_of_a_spec_count_its_spectra() -> None:
    """Per group the kernel's spectra hold A B complex bins a frequency, per group and sample x's and y's A + B
    (B = C_x/g P); grad_weight's chunk counts 2(A + B) (y's conjugate resolved and the product); the per-sample chunk
    (A + B) spectra and, per channel, B products, their inverse of V points and B0 T taps. Each against the integer
    rule with the counts taken from the spec here, and the docs' examples."""
    for case in grid_cases() + random_cases(40, seed=3):
        spec = case.spec()
        p = sizing.phase_count(spec)
        sizes = [d.size for d in sizing.phases(spec)]
        reals = 2 * np.fft.rfftn(np.zeros(sizes)).size
        a, b0 = spec.y_channels // spec.groups, spec.x_channels // spec.groups
        b = b0 * p
        x, y = math.prod(spec.x_shape), math.prod(spec.y_shape)
        for least in (1, 2**10):
            assert chunking.chunk_budget(spec, least) == chunking.budget_reals(x, y, a, least), str(case)
        one = spec.batch * 2 * (a + b) * reals  # grad_weight's chunk of one group: exactly, and just short
        for budget in (1, 3000, 2**18, a * b * reals + spec.batch * (a + b) * reals, one, 2 * one, one - 1):
            assert chunking.chunks(spec, p, budget) == chunking.fit_chunks(a * b * reals, (a + b) * reals, spec.batch,
                                                                           spec.groups, budget), str(case)
            assert chunking.weight_chunks(spec, p, budget) == chunking.fit_chunks(0, 2 * (a + b) * reals, spec.batch,
                                                                                  spec.groups, budget), str(case)
            channel = b * (reals + math.prod(sizes)) + b0 * math.prod(spec.kernel_size)
            assert chunking.per_sample_chunks(spec, p, budget) == chunking.fit_per_sample_chunks(
                (a + b) * reals, channel, spec.batch, spec.groups, a, budget), str(case)
    depthwise = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
    assert chunking.chunks(depthwise, 1, 2**22) == (64, 8) and chunking.chunks(depthwise, 1, 2**18) == (6, 8)
    convnext = ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96)
    assert chunking.weight_chunks(convnext, 1, 2 * weight_scratch(convnext)) == (1, 16)


def test_the_plans_chunks_come_from_the_budgets() -> None:
    """``plan``'s chunks (uncached: a mutant's plan, not one cached before it): every gradient takes ``chunks`` of
    the budget; grad_weight no more groups or samples than ``WEIGHT_SCRATCH_RATIO`` times native's scratch allows (at
    least CHUNK_MIN_REALS); a group's kernel rows in slices where its spectra pass the budget, one group a chunk."""
    from convgrad.backends.fft.plans import plan

    build = plan.__wrapped__
    layers = [ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96),
              ConvSpec.from_shapes((1, 48, 48, 48, 48), (48, 1, 7, 7, 7), padding=3, groups=48),
              ConvSpec.from_shapes((4, 512, 200), (512, 256, 16), stride=8, padding=4, transposed=True),
              ConvSpec.from_shapes((2, 8, 28, 28), (8, 1, 31, 31), stride=2, padding=15, groups=8)]
    for spec in layers:
        p = sizing.phase_count(spec)
        budget = chunking.chunk_budget(spec, chunking.CHUNK_MIN_REALS)
        side = chunking.chunks(spec, p, budget)
        a, b = spec.y_channels // spec.groups, spec.x_channels // spec.groups * p
        rows, samples = chunking.kernel_rows(tuple(d.size for d in sizing.phases(spec)), a, b, spec.batch, budget)
        most = chunking.weight_chunks(spec, p, max(chunking.CHUNK_MIN_REALS,
                                                   chunking.WEIGHT_SCRATCH_RATIO * weight_scratch(spec)))
        for gradient in ("output", "grad_input", "grad_weight"):
            want = side if gradient != "grad_weight" else (min(side[0], most[0]), min(side[1], most[1]))
            got = build(spec, gradient)
            assert got.rows == rows and got.chunks == (want if rows == a else (1, samples)), (spec, gradient)
    assert build(layers[0], "grad_weight").chunks == (1, 16) and build(layers[1], "grad_weight").chunks == (2, 1)
