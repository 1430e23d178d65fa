"""``PhaseGeometry``: the polyphase, sub-pixel and space-to-depth geometry of one convolution, a mixin of
``ConvSpec`` (which inherits it): the phases of the big side for grad_input (polyphase, sub-pixel) and the blocks
and phases of x for grad_weight (space-to-depth by the dilation, phases by the stride). The per-dim arithmetic is
in ``formulation``; the properties zip it over the dims of the ``ConvSpec`` they are read on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from convgrad.spec import formulation
from convgrad.spec.arguments import Pair
from convgrad.spec.formulation import PhaseTaps

__all__ = ["PhaseGeometry"]


class PhaseGeometry:
    """The polyphase, sub-pixel and space-to-depth properties of ``ConvSpec``; they read only the ConvSpec
    attributes declared below."""

    if TYPE_CHECKING:  # ConvSpec's fields and properties that the properties read (no runtime attributes here)
        kernel_size: tuple[int, ...]
        stride: tuple[int, ...]
        padding: tuple[Pair, ...]
        dilation: tuple[int, ...]

        @property
        def x_size(self) -> tuple[int, ...]: ...
        @property
        def y_size(self) -> tuple[int, ...]: ...
        @property
        def x_read_pads(self) -> tuple[Pair, ...]: ...
        @property
        def x_read_size(self) -> tuple[int, ...]: ...

    @property
    def phase_rows(self) -> tuple[int, ...]:
        """ceil(i/s) per dim: rows per phase of the big side; interleaving the s phases gives s*ceil(i/s) >= i."""
        return tuple(-(-i // s) for i, s in zip(self.x_size, self.stride))

    @property
    def phases(self) -> tuple[tuple[PhaseTaps | None, ...], ...]:
        """Per dim, for each phase rho = 0..s-1 of the big side, the taps that reach it (None: an empty phase).

        At most s/gcd(s, d) phases per dim receive taps, so at most prod(s/g) of the prod(s) N-d phases
        (``formulation.phase_taps`` has the derivation).
        """
        return tuple(formulation.phase_taps(i, k, s, d, lo, o) for i, k, s, d, (lo, _), o in zip(
            self.x_size, self.kernel_size, self.stride, self.dilation, self.padding, self.y_size))

    @property
    def subpixel_taps(self) -> tuple[tuple[int, Pair, tuple[int, ...]], ...] | None:
        """Per dim (fused taps, pads of y, offset of each phase's taps): every phase in one conv (sub-pixel); None
        when some phase needs dilation > 1 or a dim has no phase with taps (``formulation.subpixel_dim``)."""
        out = []
        for rows, o, dim in zip(self.phase_rows, self.y_size, self.phases):
            fused = formulation.subpixel_dim(rows, o, dim)
            if fused is None:
                return None
            out.append(fused)
        return tuple(out)

    @property
    def dilation_blocks(self) -> tuple[tuple[int, int], ...]:
        """Per dim (U, M): blocks of d rows of the read x and of y for space-to-depth by the dilation d
        (``formulation.dilation_block``)."""
        return tuple(formulation.dilation_block(k, d, o) for k, d, o in zip(self.kernel_size, self.dilation,
                                                                             self.y_size))

    @property
    def stride_phases(self) -> tuple[tuple[int, int, Pair], ...]:
        """Per dim (Q, U, pads): the phases of x for grad_weight by the stride s, with dilation 1
        (``formulation.stride_phase`` has the derivation).

        Returns:
            tuple of (Q, U, (lo, hi)) per spatial dim.

        Examples:
            >>> from convgrad.spec import ConvSpec
            >>> ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1).stride_phases
            ((2, 5, (1, 2)),)
        """
        return tuple(formulation.stride_phase(k, s, o, pads, size) for k, s, o, pads, size in zip(
            self.kernel_size, self.stride, self.y_size, self.x_read_pads, self.x_read_size))
