"""``FftSizing``: the FFT backend's sizing of one convolution, a mixin of ``ConvSpec`` (which inherits it): the
polyphase split of every dim, the live-phase count, the transform's bins, the chunk budgets and native's
grad_weight scratch they are weighed against. The per-dim arithmetic is in ``formulation``, the chunk sizing in
``chunks``; the methods zip them over the dims of the ``ConvSpec`` they are read on.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from convgrad.spec import chunks, formulation
from convgrad.spec.arguments import Pair
from convgrad.spec.formulation import FftDim

__all__ = ["FftSizing"]


class FftSizing:
    """The FFT sizing methods of ``ConvSpec``; they read only the ConvSpec attributes declared below."""

    if TYPE_CHECKING:  # ConvSpec's fields and properties that the methods read (no runtime attributes here)
        batch: int
        groups: int
        kernel_size: tuple[int, ...]
        stride: tuple[int, ...]
        dilation: tuple[int, ...]

        @property
        def n(self) -> int: ...
        @property
        def x_size(self) -> tuple[int, ...]: ...
        @property
        def y_size(self) -> tuple[int, ...]: ...
        @property
        def x_shape(self) -> tuple[int, ...]: ...
        @property
        def y_shape(self) -> tuple[int, ...]: ...
        @property
        def weight_shape(self) -> tuple[int, ...]: ...
        @property
        def x_group_channels(self) -> int: ...
        @property
        def y_group_channels(self) -> int: ...
        @property
        def x_read_pads(self) -> tuple[Pair, ...]: ...
        @property
        def x_read_size(self) -> tuple[int, ...]: ...
        @property
        def taps(self) -> int: ...

    @property
    def fft_phases(self) -> tuple[FftDim, ...]:
        """Per dim the polyphase split of the read x into stride-1 correlations, for the FFT backend
        (``formulation.fft_phase`` has the derivation).

        Returns:
            tuple of ``FftDim`` per spatial dim: the live phases, Q, U, the pads of x to s*U rows, the transform
            size L (5-smooth, even in the last dim: ``formulation.fft_size``; >= U less the padding rows that wrap
            onto zeros), each tap's slot p*Q + q and the pads of x to s*L rows.

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> spec = ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1)
            >>> spec.fft_phases[0][1:4] == spec.stride_phases[0]
            True
            >>> ConvSpec.from_shapes((1, 1, 9), (1, 1, 3), stride=2, dilation=2).fft_phases[0]
            FftDim(phases=(0,), taps=3, rows=5, pads=(0, 1), size=6, slots=(0, 1, 2), transform_pads=(0, 3))
        """
        dims = zip(self.x_size, self.kernel_size, self.stride, self.dilation, self.y_size, self.x_read_pads,
                   self.x_read_size)
        return tuple(formulation.fft_phase(i, k, s, d, o, pads, size, last=j == self.n - 1)
                     for j, (i, k, s, d, o, pads, size) in enumerate(dims))

    @property
    def fft_phase_count(self) -> int:
        """P: the live phases of the read x in the FFT backend's polyphase split, the product over dims of the phases
        some tap reaches (``fft_phases``); at most prod(s/gcd(s, d)).

        Returns:
            P (int, >= 1).

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> ConvSpec.from_shapes((1, 1, 9, 9), (1, 1, 3, 3), stride=2).fft_phase_count
            4
            >>> ConvSpec.from_shapes((1, 1, 9, 9), (1, 1, 3, 3), stride=2, dilation=2).fft_phase_count
            1
        """
        return math.prod([len(f.phases) for f in self.fft_phases])

    def fft_budget(self, least: int) -> int:
        """The reals of spectra one chunk of the FFT backend holds (``chunks.fft_budget`` of x's and y's elements and
        the kernel rows per group).

        Args:
            least: the smallest budget in reals (int, >= 1; the fft plans pass ``plans.CHUNK_MIN_REALS``).

        Returns:
            The budget in reals (int, >= ``least``).

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256).fft_budget(2**18)
            802816
        """
        return chunks.fft_budget(math.prod(self.x_shape), math.prod(self.y_shape), self.y_group_channels, least)

    def fft_chunks(self, phase_count: int, budget: int) -> tuple[int, int]:
        """(groups, samples) per chunk of the FFT backend, so that one chunk's spectra hold about ``budget`` reals:
        per group the kernel spectra hold (C_y/g)(C_x/g)P complex bins per frequency, per group and sample the
        spectra of x and y (C_x/g)P + C_y/g (P: the live phases); ``chunks.fft_chunks`` fits them.

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> spec = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
            >>> spec.fft_chunks(1, 2**22)
            (64, 8)
            >>> spec.fft_chunks(1, 2**18)
            (6, 8)
        """
        a, b, bins = self._fft_group_reals(phase_count)
        return chunks.fft_chunks(a * b * bins, (a + b) * bins, self.batch, self.groups, budget)

    def fft_weight_chunks(self, phase_count: int, budget: int) -> tuple[int, int]:
        """(groups, samples) per grad_weight chunk of the FFT backend, so that what the chunk holds at once is about
        ``budget`` reals: per group and sample 2((C_x/g)P + C_y/g) complex bins, x's and y's spectra, y's conjugate
        resolved and their product before the sum over samples (the torch profiler on depthwise layers: 4 spectra
        of a sample and group at the peak, the sum comes after; ``benchmarks/large_kernels.py``'s ``peak_bytes``).

        Args:
            phase_count: P, the live phases of x (int, >= 1; ``fft_phase_count``).
            budget: reals the chunk may hold (int, >= 1).

        Returns:
            ``(groups, samples)`` per chunk, each at least 1 (``chunks.fft_chunks`` with no per-group kernel term).

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> spec = ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96)
            >>> spec.fft_weight_chunks(1, 2 * spec.native_weight_scratch), spec.fft_chunks(1, spec.side_elements // 4)
            ((1, 16), (19, 16))
        """
        a, b, bins = self._fft_group_reals(phase_count)
        return chunks.fft_chunks(0, 2 * (a + b) * bins, self.batch, self.groups, budget)

    def _fft_group_reals(self, phase_count: int) -> tuple[int, int, int]:
        """(C_y/g, (C_x/g)P, reals of one complex spectrum of a real transform of the fft sizes)."""
        return self.y_group_channels, self.x_group_channels * phase_count, 2 * self.fft_bins

    @property
    def fft_bins(self) -> int:
        """The complex bins of one spectrum of the FFT backend: a real transform of the lengths of ``fft_phases``
        (``formulation.rfft_bins``).

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> ConvSpec.from_shapes((4, 256, 28, 28), (256, 1, 31, 31), padding=15, groups=256).fft_bins
            1125
        """
        return formulation.rfft_bins(f.size for f in self.fft_phases)

    @property
    def native_weight_scratch(self) -> int:
        """Reals of scratch that native's grad_weight holds at least on the CPU: one channel's taps over one plane
        of y (the last two dims), ``T * prod(y_size[-2:])``, and 4 weights (oneDNN's GEMM grad_weight; the torch
        profiler on the large suite's depthwise layers: ConvNeXt's 7x7, RepLKNet's, SLaK's and 3D UX-Net's scratch is
        exactly this plus 64 reals, UniRepLKNet's twice it). It does not grow with the batch.

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> ConvSpec.from_shapes((16, 96, 56, 56), (96, 1, 7, 7), padding=3, groups=96).native_weight_scratch
            172480
        """
        return self.taps * math.prod(self.y_size[-2:]) + 4 * math.prod(self.weight_shape)

    def fft_per_sample_chunks(self, phase_count: int, budget: int) -> tuple[int, int, int]:
        """(groups, samples, y channels per group) per chunk of per-sample weight gradients by the FFT, so that one
        chunk holds about ``budget`` reals: per sample and group the spectra of x and y, (C_x/g)P + C_y/g complex
        bins; per sample, group and y channel its product with x's spectra ((C_x/g)P complex bins), their inverse
        ((C_x/g)P transforms of V points) and the taps read from it ((C_x/g)T); ``chunks.fft_per_sample_chunks``
        fits them (P: the live phases).

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> spec = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
            >>> spec.fft_per_sample_chunks(1, 2**18)
            (3, 8, 1)
            >>> ConvSpec.from_shapes((2, 64, 28, 28), (64, 64, 31, 31), padding=15).fft_per_sample_chunks(1, 2**22)
            (1, 1, 11)
        """
        dims = self.fft_phases
        volume = math.prod([f.size for f in dims])
        bins = 2 * self.fft_bins  # reals
        a, b0 = self.y_group_channels, self.x_group_channels
        b = b0 * phase_count
        return chunks.fft_per_sample_chunks((a + b) * bins, b * (bins + volume) + b0 * self.taps, self.batch,
                                            self.groups, a, budget)
