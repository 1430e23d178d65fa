"""``ConvSpec``: one convolution's validated hyperparameters, its forward geometry (the package docstring), its
shapes, the pads of the backward's formulations and the specs derived from it. The per-dim arithmetic is in
``formulation``, the argument checks in ``arguments``; the properties zip them over dims, the polyphase, sub-pixel
and space-to-depth geometry of the backward's formulations included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from convgrad.errors import ConvgradValueError
from convgrad.spec import formulation
from convgrad.spec.arguments import SPECS, IntOrTuple, PaddingArg, Pair, check_extents, memo_key, normalise, remember
from convgrad.spec.formulation import PhaseTaps

__all__ = ["ConvSpec"]


@dataclass(frozen=True)
class ConvSpec:
    """Validated hyperparameters and shapes of one (forward or transposed) convolution.

    Build it with ``ConvSpec.from_shapes``. All sizes are user-facing: ``input``
    is what the convolution reads, ``output`` what it produces; for a transposed
    conv these are the small and the big side respectively.
    """

    batch: int
    in_channels: int
    out_channels: int
    input_size: tuple[int, ...]
    kernel_size: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[Pair, ...]
    dilation: tuple[int, ...]
    transposed: bool
    output_padding: tuple[int, ...]
    groups: int
    unbatched: bool = False
    fn: str = field(default="convgrad", compare=False, repr=False)
    # derived values every call reads (the call path, native's forward and backward, the checks): computed once per
    # spec in __post_init__, so that a read costs an attribute, not a Python frame per dim (validated specs are
    # memoised, so a layer's calls share one); the properties below name and document them
    _x_size: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _y_size: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _is_symmetric: bool = field(init=False, repr=False, compare=False)
    _symmetric_padding: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _aten_args: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool, tuple[int, ...], int] = field(
        init=False, repr=False, compare=False)
    _padding_excess: tuple[Pair, ...] = field(init=False, repr=False, compare=False)
    _input_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _output_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _weight_shape: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.transposed:
            y_size = self.input_size
            x_size = tuple(formulation.transposed_output_rows(o, k, s, d, op, pads) for o, k, s, d, op, pads in zip(
                self.input_size, self.kernel_size, self.stride, self.dilation, self.output_padding, self.padding))
        else:
            x_size = self.input_size
            y_size = tuple(formulation.output_rows(i, k, s, d, pads) for i, k, s, d, pads in zip(
                self.input_size, self.kernel_size, self.stride, self.dilation, self.padding))
        symmetric = tuple(min(lo, hi) for lo, hi in self.padding)
        derived = {
            "_x_size": x_size,
            "_y_size": y_size,
            "_is_symmetric": all(lo == hi for lo, hi in self.padding),
            "_symmetric_padding": symmetric,
            "_aten_args": (self.stride, symmetric, self.dilation, self.transposed, self.output_padding, self.groups),
            "_padding_excess": tuple((lo - m, hi - m) for (lo, hi), m in zip(self.padding, symmetric)),
            "_input_shape": (self.batch, self.in_channels, *self.input_size),
            "_output_shape": (self.batch, self.out_channels, *(x_size if self.transposed else y_size)),
            "_weight_shape": (self.y_channels, self.x_group_channels, *self.kernel_size),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)  # frozen: as dataclasses' own __init__ sets fields

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_shapes(cls, input_shape: Sequence[int], weight_shape: Sequence[int], stride: IntOrTuple = 1,
                    padding: PaddingArg = 0, dilation: IntOrTuple = 1, transposed: bool = False,
                    output_padding: IntOrTuple = 0, groups: int = 1, *, fn: str = "ConvSpec",
                    memo: bool = True) -> ConvSpec:
        """Validate convolution arguments against the input and weight shapes.

        Args:
            input_shape: ``(N, C_in, *spatial)`` or unbatched ``(C_in, *spatial)``.
            weight_shape: ``(C_out, C_in/groups, *k)`` for a forward conv,
                ``(C_in, C_out/groups, *k)`` for a transposed conv.
            stride, dilation: int or N-tuple, each >= 1.
            padding: int, N-tuple, N-tuple of ``(lo, hi)`` pairs, ``'valid'`` or ``'same'``.
            transposed: describe a transposed convolution.
            output_padding: int or N-tuple; only for transposed convs, each < max(stride, dilation).
            groups: int >= 1 dividing both channel counts.
            fn: the public function name used in error messages.
            memo: look the arguments up in the memo of validated specs, and remember the result there (default
                True); False validates afresh and leaves the memo alone (what torch.compile traces: Dynamo breaks
                its graph on the memo's lookup).

        Raises:
            TypeError: a non-integer where an int is needed.
            ValueError: any value out of range or inconsistent with the shapes.
        """
        args = (input_shape, weight_shape, stride, padding, dilation, transposed, output_padding, groups, fn)
        if not memo:
            return cls._validated(*args)
        key = memo_key(cls, args)
        remembered = None if key is None else SPECS.get(key)  # one lookup: another thread may clear it
        if remembered is not None:
            return remembered  # type: ignore[no-any-return]  # SPECS holds only ConvSpecs, keyed by their class
        spec = cls._validated(*args)
        if key is not None:
            remember(key, spec)
        return spec

    @classmethod
    def _validated(cls, input_shape: Sequence[int], weight_shape: Sequence[int], stride: IntOrTuple = 1,
                   padding: PaddingArg = 0, dilation: IntOrTuple = 1, transposed: bool = False,
                   output_padding: IntOrTuple = 0, groups: int = 1, fn: str = "ConvSpec") -> ConvSpec:
        """from_shapes without its memo (what torch.compile traces)."""
        spec = cls(*normalise(input_shape, weight_shape, stride, padding, dilation, transposed, output_padding, groups,
                              fn), fn)
        check_extents(fn, spec.input_size, spec.kernel_size, spec.dilation, spec.padding, spec.transposed,
                      spec.x_size)
        return spec

    # ---- the forward geometry ----------------------------------------------------
    @property
    def n(self) -> int:
        """Number of spatial dims."""
        return len(self.kernel_size)

    @property
    def x_channels(self) -> int:
        """Channels of the big side (forward: input; transposed: output)."""
        return self.out_channels if self.transposed else self.in_channels

    @property
    def y_channels(self) -> int:
        """Channels of the small side (forward: output; transposed: input)."""
        return self.in_channels if self.transposed else self.out_channels

    @property
    def x_group_channels(self) -> int:
        """Channels of the big side per group, C_x/g: the weight's second dim.

        Examples:
            >>> spec = ConvSpec.from_shapes((2, 8, 9), (6, 4, 3), groups=2)
            >>> spec.x_group_channels, spec.y_group_channels
            (4, 3)
            >>> spec = ConvSpec.from_shapes((2, 6, 9), (6, 4, 3), groups=2, transposed=True)   # x is the output
            >>> spec.x_group_channels, spec.y_group_channels
            (4, 3)
        """
        return self.x_channels // self.groups

    @property
    def y_group_channels(self) -> int:
        """Channels of the small side per group, C_y/g (``x_group_channels`` has examples)."""
        return self.y_channels // self.groups

    @property
    def y_size(self) -> tuple[int, ...]:
        """Spatial extent o of the small side."""
        return self._y_size

    @property
    def x_size(self) -> tuple[int, ...]:
        """Spatial extent i of the big side (for a transposed conv, its output size)."""
        return self._x_size

    @property
    def leftover(self) -> tuple[int, ...]:
        """r per dim: trailing rows of the padded big side that no output position reads."""
        return tuple(formulation.leftover_rows(i, o, k, s, d, pads) for i, o, k, s, d, pads in zip(
            self.x_size, self.y_size, self.kernel_size, self.stride, self.dilation, self.padding))

    @property
    def unread_input_rows(self) -> tuple[int, ...]:
        """How many of the leftover rows are real rows of the big side (not padding): max(0, r - p_hi)."""
        return tuple(max(0, r - hi) for r, (_, hi) in zip(self.leftover, self.padding))

    # ---- user-facing shapes ------------------------------------------------------
    @property
    def output_size(self) -> tuple[int, ...]:
        """Spatial size of the convolution's output."""
        return self.x_size if self.transposed else self.y_size

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Batched input shape (N, C_in, *input_size)."""
        return self._input_shape

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Batched output shape (N, C_out, *output_size), also the shape of grad_output."""
        return self._output_shape

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """(C_y, C_x/groups, *k): (C_out, C_in/g, *k) forward, (C_in, C_out/g, *k) transposed."""
        return self._weight_shape

    @property
    def x_shape(self) -> tuple[int, ...]:
        """Batched shape of the big side (N, C_x, *x_size): the input forward, the output transposed."""
        return self.output_shape if self.transposed else self.input_shape

    @property
    def y_shape(self) -> tuple[int, ...]:
        """Batched shape of the small side (N, C_y, *y_size): the output forward, the input transposed."""
        return self.input_shape if self.transposed else self.output_shape

    @property
    def side_elements(self) -> int:
        """Elements of x and y together, the whole batch (a layer's input and grad_output)."""
        return math.prod(self.x_shape) + math.prod(self.y_shape)

    @property
    def is_symmetric(self) -> bool:
        """True when every dim pads equally on both sides (expressible as one int per dim in torch)."""
        return self._is_symmetric

    # ---- the pads of the backward formulations -----------------------------------
    @property
    def x_read_pads(self) -> tuple[Pair, ...]:
        """Pads of x so that a stride-s conv reads it exactly: (p_lo, p_hi - r); negative = crop."""
        return tuple((lo, hi - r) for (lo, hi), r in zip(self.padding, self.leftover))

    @property
    def zero_inserted_size(self) -> tuple[int, ...]:
        """Extent of y after inserting s-1 zeros between entries: (o-1)s + 1."""
        return tuple((o - 1) * s + 1 for o, s in zip(self.y_size, self.stride))

    @property
    def transpose_pads(self) -> tuple[Pair, ...]:
        """Pads of the zero-inserted y for the grad-of-x conv: (d(k-1)-p_lo, d(k-1)-p_hi+r); negative = crop."""
        return tuple(
            (d * (k - 1) - lo, d * (k - 1) - hi + r)
            for k, d, (lo, hi), r in zip(self.kernel_size, self.dilation, self.padding, self.leftover)
        )

    @property
    def transpose_padded_size(self) -> tuple[int, ...]:
        """Extent of the zero-inserted, padded y: i + d(k-1), which a stride-1 conv maps back to i."""
        return tuple(i + d * (k - 1) for i, k, d in zip(self.x_size, self.kernel_size, self.dilation))

    @property
    def x_read_size(self) -> tuple[int, ...]:
        """Extent of x after x_read_pads: (o-1)s + d(k-1) + 1, exactly what the conv reads."""
        return tuple((o - 1) * s + d * (k - 1) + 1
                     for o, k, s, d in zip(self.y_size, self.kernel_size, self.stride, self.dilation))

    @property
    def kernel_extent(self) -> tuple[int, ...]:
        """d(k-1) + 1 per dim: the span of x that one position of y reads (im2col's window)."""
        return tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))

    def tap_window(self, tap: Sequence[int]) -> tuple[slice, ...]:
        """Slices of the read x (x_read_size) that kernel tap t meets at the o positions: t*d : t*d+(o-1)s+1 : s.

        col2im adds the columns of tap t into exactly these slices.
        """
        return tuple(slice(t * d, t * d + (o - 1) * s + 1, s)
                     for t, d, s, o in zip(tap, self.dilation, self.stride, self.y_size))

    @property
    def padding_only_taps(self) -> tuple[tuple[int, ...], ...]:
        """Per dim, the kernel taps that meet padding alone at every output position: their grad_weight is exactly 0
        (``formulation.padding_only_taps``); none when x or y is empty.

        Returns:
            A tuple of ascending tap indices per spatial dim.

        Examples:
            >>> ConvSpec.from_shapes((1, 1, 1, 8), (1, 1, 3, 3), padding=1).padding_only_taps  # one row of x
            ((0, 2), ())
        """
        return tuple(formulation.padding_only_taps(i, o, k, s, d, lo) for i, o, k, s, d, (lo, _) in zip(
            self.x_size, self.y_size, self.kernel_size, self.stride, self.dilation, self.padding))

    @property
    def reads_only_padding(self) -> bool:
        """Whether some kernel tap meets padding alone at every output position (in some dim): its grad_weight is
        exactly 0 (``padding_only_taps``); False when x or y is empty."""
        return any(self.padding_only_taps)

    @property
    def positions(self) -> int:
        """P = prod(y_size): positions of the small side, the per-sample contraction length of grad_weight."""
        return math.prod(self.y_size)

    @property
    def taps(self) -> int:
        """T = prod(k): kernel taps."""
        return math.prod(self.kernel_size)

    # ---- the phases of the big side (polyphase, sub-pixel) and of x (space-to-depth, stride phases) ------------
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
            >>> ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1).stride_phases
            ((2, 5, (1, 2)),)
        """
        return tuple(formulation.stride_phase(k, s, o, pads, size) for k, s, o, pads, size in zip(
            self.kernel_size, self.stride, self.y_size, self.x_read_pads, self.x_read_size))

    def fit_output_size(self, output_size: Sequence[int]) -> ConvSpec:
        """This transposed conv with the output_padding that yields output_size (ConvTranspose's output_size=)."""
        op = tuple(want - (x - p) for want, x, p in zip(output_size, self.x_size, self.output_padding))
        return ConvSpec.from_shapes(self.input_shape, self.weight_shape, self.stride, self.padding, self.dilation,
                                    self.transposed, op, self.groups, fn=self.fn)

    @property
    def symmetric_padding(self) -> tuple[int, ...]:
        """min(p_lo, p_hi) per dim: the part of the padding torch can express as one int."""
        return self._symmetric_padding

    @property
    def aten_args(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool, tuple[int, ...], int]:
        """(stride, padding, dilation, transposed, output_padding, groups) as aten.convolution takes them, with
        symmetric_padding (the rest of the padding is applied explicitly, see padding_excess)."""
        return self._aten_args

    @property
    def padding_excess(self) -> tuple[Pair, ...]:
        """Padding beyond symmetric_padding on each side, applied explicitly to the big side."""
        return self._padding_excess

    def with_batch_in_groups(self) -> ConvSpec:
        """The N per-sample convolutions as one: a batch of 1 whose channels and groups are N times as many.

        Sample n's channels become group block n, so the weight gradient of this conv, ``(N*w0, *w[1:])``, is the
        N per-sample weight gradients stacked (the fold torch.func's vmap applies to a convolution).

        Returns:
            ConvSpec: batch 1, ``N*C_in`` and ``N*C_out`` channels, ``N*groups`` groups; the spatial sizes, stride,
            padding and dilation unchanged.

        Raises:
            ValueError: a batch of 0 (there is no conv to fold into).

        Examples:
            >>> folded = ConvSpec.from_shapes((3, 4, 9, 8), (6, 2, 3, 2), stride=2, groups=2).with_batch_in_groups()
            >>> folded.input_shape, folded.weight_shape, folded.groups
            ((1, 12, 9, 8), (18, 2, 3, 2), 6)
        """
        if self.batch < 1:
            raise ConvgradValueError(f"{self.fn}: with_batch_in_groups needs batch >= 1, got batch={self.batch}")
        n = self.batch
        return replace(self, batch=1, in_channels=n * self.in_channels, out_channels=n * self.out_channels,
                       groups=n * self.groups, unbatched=False)

    def with_leading_unit_dim(self) -> ConvSpec:
        """The same convolution with one more spatial dim in front, of extent 1 everywhere (a 1d conv as a 2d one
        over rows of height 1): kernel 1, stride 1, no padding, dilation 1, output_padding 0 in the new dim."""
        return replace(self, input_size=(1, *self.input_size), kernel_size=(1, *self.kernel_size),
                       stride=(1, *self.stride), padding=((0, 0), *self.padding),
                       dilation=(1, *self.dilation), output_padding=(0, *self.output_padding))

    def with_batch(self, batch: int) -> ConvSpec:
        """The same convolution on ``batch`` samples (a chunk or slice of the batch, a batch bucket); itself when
        the batch is unchanged.

        Raises:
            ValueError: a negative batch.

        Examples:
            >>> spec = ConvSpec.from_shapes((32, 4, 9, 9), (6, 4, 3, 3))
            >>> spec.with_batch(8).input_shape, spec.with_batch(32) is spec
            ((8, 4, 9, 9), True)
        """
        if batch < 0:
            raise ConvgradValueError(f"{self.fn}: batch={batch} must be >= 0")
        return self if batch == self.batch else replace(self, batch=batch)

    def with_merged_groups(self, merge: int) -> ConvSpec:
        """The same operands as a convolution with ``merge`` consecutive groups merged into one, ``groups // merge``
        groups: its weight is ``(C_out, merge * C_in/groups, *k)`` (transposed: ``(C_in, merge * C_out/groups, *k)``).
        With block-diagonal weights it computes the same convolution.

        Raises:
            ValueError: merge does not divide groups.
        """
        if merge < 1 or self.groups % merge:
            raise ConvgradValueError(f"{self.fn}: merge={merge} must divide groups={self.groups}")
        return replace(self, groups=self.groups // merge)

    def macs(self) -> int:
        """Multiply-accumulates of the forward conv (= of each of its two gradients)."""
        return self.batch * self.y_channels * self.positions * self.x_group_channels * self.taps

    def describe(self) -> str:
        """One line: the configuration in torch's argument names, the arguments that differ from their defaults; an
        unbatched input as given, (C_in, *spatial).

        Examples:
            >>> ConvSpec.from_shapes((3, 9, 8), (4, 3, 2, 2), stride=2).describe()
            'conv2d input=(3, 9, 8) (unbatched) weight=(4, 3, 2, 2) stride=(2, 2)'
        """
        kind = "conv_transpose" if self.transposed else "conv"
        given = f"{self.input_shape[1:]} (unbatched)" if self.unbatched else f"{self.input_shape}"
        parts = [f"{kind}{self.n}d input={given} weight={self.weight_shape}"]
        for name, value, default in (("stride", self.stride, (1,) * self.n),
                                     ("padding", self.padding, ((0, 0),) * self.n),
                                     ("dilation", self.dilation, (1,) * self.n),
                                     ("output_padding", self.output_padding, (0,) * self.n)):
            if value != default:
                parts.append(f"{name}={value}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        return " ".join(parts)
