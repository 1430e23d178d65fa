"""ConvSpec: the normalised hyperparameters of one convolution and all its shape maths.

This is the only module that does shape or padding arithmetic. It holds integers
only and imports no torch, so the NumPy path can use it too.

Geometry. Every convolution, forward or transposed, is described through the
*forward geometry*: a big side ``x`` (extent ``i`` per dim) read by a kernel of
extent ``k`` with stride ``s`` and dilation ``d`` after padding ``(p_lo, p_hi)``,
and a small side ``y`` (extent ``o``) where

    y[j] = sum_t x_pad[j*s + t*d] * w[t],   j = 0 .. o-1.

A forward conv maps x -> y (x is its input). A transposed conv is the adjoint,
y -> x (y is its input, x its output). The leftover

    r = i + p_lo + p_hi - d(k-1) - 1 - (o-1)s  >= 0

counts the trailing rows of ``x_pad`` that no output reads. For a forward conv
``r < s``; for a transposed conv ``r`` equals ``output_padding`` (which may reach
``s`` or more when ``d > s``). The derivations are in the docs' "Derivation" page.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from convgrad.errors import ConvgradTypeError, ConvgradValueError

Pair = tuple[int, int]
PaddingArg = int | str | Sequence[Any]
IntOrTuple = int | Sequence[int]

__all__ = ["ConvSpec", "FftDim", "PhaseTaps", "check_bias_sizes", "check_output_mask", "same_padding", "smooth_size",
           "tap_rows"]


class PhaseTaps(NamedTuple):
    """The kernel taps that reach one phase of the big side along one dim (polyphase grad of x).

    Phase rho holds the rows x[rho], x[rho + s], x[rho + 2s], ... (``ConvSpec.phase_rows`` of them).
    They are a stride-1 convolution, dilation ``dilation`` = d/g (g = gcd(s, d)), of y padded by
    ``pads`` with the taps flipped[first], flipped[first + step], ... (``count`` of them, step = s/g)
    of the kernel flipped in that dim. See ``phase_taps`` for the derivation.
    """

    first: int
    step: int
    count: int
    pads: Pair
    dilation: int


class FftDim(NamedTuple):
    """One dim of the FFT backend's polyphase split (``ConvSpec.fft_phases``).

    x padded by ``pads`` has s*``rows`` rows; its phase ``phases[p]`` (rows phi::s) is correlated, stride 1, with a
    kernel of ``taps`` slots in which tap t sits at slot ``slots[t]`` - p*taps; ``size`` is the transform length.
    """

    phases: tuple[int, ...]
    taps: int
    rows: int
    pads: Pair
    size: int
    slots: tuple[int, ...]


def smooth_size(n: int) -> int:
    """The smallest 5-smooth integer (2^a 3^b 5^c) >= n: a transform length FFT libraries compute fastest.

    Examples:
        >>> [smooth_size(n) for n in (1, 7, 11, 58, 97, 1025)]
        [1, 8, 12, 60, 100, 1080]
    """
    best, p2 = None, 1
    while True:
        p3 = p2
        while True:
            p5 = p3
            while p5 < n:
                p5 *= 5
            best = p5 if best is None else min(best, p5)
            if p3 >= n:
                break
            p3 *= 3
        if p2 >= n:
            return best
        p2 *= 2


def phase_taps(i: int, k: int, s: int, d: int, p_lo: int, o: int) -> tuple[PhaseTaps | None, ...]:
    """For each phase rho = 0..s-1 of one dim of the big side, its taps, or None when no tap reaches it.

    Row u = rho + s*b of x sits at m = u + p_lo in x_pad, whose gradient is the sum of y[j] w[t]
    over j*s + t*d = m. Write m = phi + s*(b + e) with phi = (rho + p_lo) mod s, e = (rho + p_lo) div s.
    Then t*d = phi (mod s): with g = gcd(s, d), S = s/g, D = d/g this needs g | phi and
    t = t0 (mod S), t0 = (phi/g) * D^-1 (mod S); so t = t0 + S*q, q < count = ceil((k - t0)/S), and
    j = b + e - c0 - q*D with c0 = (t0*d - phi)/s. Flipping q (q' = count-1-q, flipped tap
    first + S*q', first = k-1-t0-S*(count-1)) turns this into a stride-1 conv with dilation D of y
    padded by lo = c0 + (count-1)*D - e, and hi such that it yields ceil(i/s) rows. A phase is empty
    when no tap reaches it, or when its window of y lies wholly in the padding.
    """
    g = math.gcd(s, d)
    step, dil, rows = s // g, d // g, -(-i // s)
    out: list[PhaseTaps | None] = []
    for rho in range(s):
        phi, e = (rho + p_lo) % s, (rho + p_lo) // s
        t0 = (phi // g) * pow(dil, -1, step) % step if step > 1 else 0
        count = -(-(k - t0) // step)
        if phi % g or rho >= i or count < 1:
            out.append(None)
            continue
        lo = (t0 * d - phi) // s + (count - 1) * dil - e
        hi = rows + (count - 1) * dil - o - lo
        out.append(None if -lo >= o or o + hi <= 0 else PhaseTaps(k - 1 - t0 - step * (count - 1), step, count,
                                                                   (lo, hi), dil))
    return tuple(out)


def tap_rows(size: int, rows: int, offset: int, reach: int) -> tuple[int, int, int]:
    """A stride-1 conv evaluated tap by tap, along one dim: output row r reads data row r + offset + reach
    (reach = tap * dilation), which exists for 0 <= r + offset + reach < size.

    Args:
        size: rows of the data (int). rows: rows of the output (int).
        offset: data row read by output row 0 at tap 0 (int; negative: that row is padding).
        reach: tap * dilation (int, >= 0).

    Returns:
        ``(first, stop, data_first)``: the output rows first..stop-1 read a data row, the first of them
        row data_first. ``first >= stop`` when the tap reads no data row at all.

    Source: the polyphase form in the docs' "Derivation" page (fwdconv's ``DepthwiseTaps`` sums the taps this way).

    Examples:
        >>> tap_rows(size=4, rows=4, offset=-1, reach=0)   # padding 1 before: row 0 reads nothing
        (1, 4, 0)
        >>> tap_rows(size=4, rows=4, offset=-1, reach=2)   # tap 1 at dilation 2: the last row reads nothing
        (0, 3, 1)
    """
    first, stop = max(0, -(offset + reach)), min(rows, size - offset - reach)
    return first, stop, first + offset + reach


def _is_int(v: object) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or type(v).__name__ in {"int64", "int32"}


def _ntuple(fn: str, name: str, value: Any, n: int, minimum: int, *, broadcast: bool = False) -> tuple[int, ...]:
    """Normalise an int or an n-sequence of ints, checking each is >= minimum.

    ``broadcast``: a one-element sequence stands for every dim, as torch's convolutions read stride, padding,
    dilation and output_padding (``stride=(2,)`` of a 2d conv is ``(2, 2)``); shapes never broadcast.
    """
    if _is_int(value):
        values: tuple[Any, ...] = (int(value),) * n
    elif isinstance(value, Sequence) and not isinstance(value, str):
        values = tuple(value)
        if broadcast and len(values) == 1:
            values *= n
        if len(values) != n:
            rule = f"1 or {n}" if broadcast and n > 1 else f"{n}"
            raise ConvgradValueError(f"{fn}: {name}={value!r} must have {rule} entries, one per spatial dim "
                                     f"(got {len(values)})")
    else:
        raise ConvgradTypeError(f"{fn}: {name}={value!r} must be an int or a tuple of {n} ints")
    for v in values:
        if not _is_int(v):
            raise ConvgradTypeError(f"{fn}: {name}={value!r} must contain only ints (got {type(v).__name__})")
        if int(v) < minimum:
            rule = "positive" if minimum == 1 else f">= {minimum}"
            raise ConvgradValueError(f"{fn}: {name}={value!r} must be {rule}")
    return tuple(int(v) for v in values)


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> Pair:
    """'same' padding of one dim: total t = max((ceil(i/s)-1)s + d(k-1) + 1 - i, 0), extra on the high side."""
    total = max((math.ceil(size / stride) - 1) * stride + dilation * (kernel - 1) + 1 - size, 0)
    return total // 2, total - total // 2


def _padding_pairs(fn: str, padding: PaddingArg, n: int, transposed: bool) -> tuple[Pair, ...] | str:
    """Normalise padding to n (lo, hi) pairs, or return 'same' to be resolved from the sizes."""
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0),) * n
        if padding == "same":
            if transposed:
                raise ConvgradValueError(f"{fn}: padding='same' is not defined for a transposed convolution")
            return "same"
        raise ConvgradValueError(f"{fn}: padding={padding!r} must be an int, a tuple, 'same' or 'valid'")
    if isinstance(padding, Sequence) and any(isinstance(p, Sequence) and not isinstance(p, str) for p in padding):
        if len(padding) != n:
            raise ConvgradValueError(f"{fn}: padding={padding!r} must have {n} (lo, hi) pairs, one per spatial dim")
        pairs = []
        for p in padding:
            if not isinstance(p, Sequence) or isinstance(p, str) or len(p) != 2:
                raise ConvgradValueError(f"{fn}: padding={padding!r} must mix no ints with (lo, hi) pairs")
            lo, hi = _ntuple(fn, "padding", tuple(p), 2, 0)
            pairs.append((lo, hi))
        return tuple(pairs)
    return tuple((p, p) for p in _ntuple(fn, "padding", padding, n, 0, broadcast=True))


def _exact(v: object) -> bool:
    """An argument from_shapes may look up by value: an int or a str, or a tuple (torch.Size) of those.

    Exact types only: equal values of other types (1.0, numpy ints, True for 1) must be validated themselves.
    """
    return type(v) in (int, str) or (isinstance(v, tuple) and all(map(_exact, v)))


def _shape(fn: str, name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        raise ConvgradTypeError(f"{fn}: {name}={shape!r} must be a sequence of ints")
    return _ntuple(fn, name, tuple(shape), len(shape), 0)


# from_shapes's validated specs by their arguments: a layer calls it with the same arguments on every forward, and
# validating them took 11-18 us of a 100 us conv (the demo's layers). Bounded; cleared when full.
_MAX_SPECS = 4096
_SPECS: dict[tuple[Any, ...], ConvSpec] = {}


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

    # ---- construction -------------------------------------------------------------
    @classmethod
    def from_shapes(
        cls,
        input_shape: Sequence[int],
        weight_shape: Sequence[int],
        stride: IntOrTuple = 1,
        padding: PaddingArg = 0,
        dilation: IntOrTuple = 1,
        transposed: bool = False,
        output_padding: IntOrTuple = 0,
        groups: int = 1,
        *,
        fn: str = "ConvSpec",
    ) -> ConvSpec:
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

        Raises:
            TypeError: a non-integer where an int is needed.
            ValueError: any value out of range or inconsistent with the shapes.
        """
        args = (input_shape, weight_shape, stride, padding, dilation, transposed, output_padding, groups, fn)
        # 1.0 == 1 and True == 1: only exact types share an entry; a subclass builds its own class
        key = (cls, *args) if type(transposed) is bool and all(map(_exact, args[:5] + args[6:])) else None
        remembered = None if key is None else _SPECS.get(key)  # one lookup: another thread may clear it
        if remembered is not None:
            return remembered
        spec = cls._validated(*args)
        if key is not None:
            if len(_SPECS) >= _MAX_SPECS:
                _SPECS.clear()
            _SPECS[key] = spec
        return spec

    @classmethod
    def _validated(cls, input_shape: Sequence[int], weight_shape: Sequence[int], stride: IntOrTuple = 1,
                   padding: PaddingArg = 0, dilation: IntOrTuple = 1, transposed: bool = False,
                   output_padding: IntOrTuple = 0, groups: int = 1, fn: str = "ConvSpec") -> ConvSpec:
        """from_shapes without its memo (what torch.compile traces)."""
        weight_shape = _shape(fn, "weight.shape", weight_shape)
        n = len(weight_shape) - 2
        if n not in (1, 2, 3):
            raise ConvgradValueError(f"{fn}: weight.shape={weight_shape} must have 3, 4 or 5 dims (1d, 2d or 3d conv)")
        input_shape = _shape(fn, "input.shape", input_shape)
        if len(input_shape) not in (n + 1, n + 2):
            raise ConvgradValueError(
                f"{fn}: input.shape={input_shape} must have {n + 2} dims (N, C, *spatial) "
                f"or {n + 1} (C, *spatial) for a {n}d weight of shape {weight_shape}"
            )
        unbatched = len(input_shape) == n + 1
        batched = (1, *input_shape) if unbatched else input_shape
        if not isinstance(transposed, bool):
            raise ConvgradTypeError(f"{fn}: transposed={transposed!r} must be a bool")
        if not _is_int(groups):
            raise ConvgradTypeError(f"{fn}: groups={groups!r} must be an int")
        if groups < 1:
            raise ConvgradValueError(f"{fn}: groups={groups} must be positive")
        stride_t = _ntuple(fn, "stride", stride, n, 1, broadcast=True)
        dilation_t = _ntuple(fn, "dilation", dilation, n, 1, broadcast=True)
        op = _ntuple(fn, "output_padding", output_padding, n, 0, broadcast=True)
        pads = _padding_pairs(fn, padding, n, transposed)
        kernel = weight_shape[2:]
        if any(k < 1 for k in kernel):
            raise ConvgradValueError(f"{fn}: weight.shape={weight_shape} has an empty kernel")
        if any(v < 1 for v in batched[2:]):
            raise ConvgradValueError(f"{fn}: input.shape={input_shape} has an empty spatial dim")
        in_ch = batched[1]
        out_ch = weight_shape[1] * groups if transposed else weight_shape[0]
        _check_channels(fn, in_ch, out_ch, weight_shape, int(groups), transposed)
        if pads == "same":
            pads = tuple(same_padding(*a) for a in zip(batched[2:], kernel, stride_t, dilation_t))
        _check_output_padding(fn, op, stride_t, dilation_t, transposed)
        spec = cls(batched[0], in_ch, out_ch, batched[2:], kernel, stride_t, pads, dilation_t,
                   transposed, op, int(groups), unbatched, fn)
        spec._check_extents()
        return spec

    def _check_extents(self) -> None:
        for dim, (i, k, d, (lo, hi)) in enumerate(zip(self.input_size, self.kernel_size, self.dilation, self.padding)):
            if not self.transposed and d * (k - 1) + 1 > i + lo + hi:
                raise ConvgradValueError(
                    f"{self.fn}: kernel extent dilation*(k-1)+1={d * (k - 1) + 1} is larger than the padded "
                    f"input {i}+{lo}+{hi}={i + lo + hi} in spatial dim {dim}"
                )
        if self.transposed and any(v < 1 for v in self.x_size):
            raise ConvgradValueError(
                f"{self.fn}: the transposed convolution's output size {self.x_size} must be positive; "
                f"padding={self.padding} crops too much")

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
    def y_size(self) -> tuple[int, ...]:
        """Spatial extent o of the small side."""
        if self.transposed:
            return self.input_size
        return tuple(
            (i + lo + hi - d * (k - 1) - 1) // s + 1
            for i, k, s, d, (lo, hi) in zip(self.input_size, self.kernel_size, self.stride, self.dilation, self.padding)
        )

    @property
    def x_size(self) -> tuple[int, ...]:
        """Spatial extent i of the big side (for a transposed conv, its output size)."""
        if not self.transposed:
            return self.input_size
        return tuple(
            (o - 1) * s + d * (k - 1) + 1 + op - lo - hi
            for o, k, s, d, op, (lo, hi) in zip(
                self.input_size, self.kernel_size, self.stride, self.dilation, self.output_padding, self.padding
            )
        )

    @property
    def leftover(self) -> tuple[int, ...]:
        """r per dim: trailing rows of the padded big side that no output position reads."""
        return tuple(
            i + lo + hi - d * (k - 1) - 1 - (o - 1) * s
            for i, o, k, s, d, (lo, hi) in zip(
                self.x_size, self.y_size, self.kernel_size, self.stride, self.dilation, self.padding
            )
        )

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
        return (self.batch, self.in_channels, *self.input_size)

    @property
    def output_shape(self) -> tuple[int, ...]:
        """Batched output shape (N, C_out, *output_size), also the shape of grad_output."""
        return (self.batch, self.out_channels, *self.output_size)

    @property
    def weight_shape(self) -> tuple[int, ...]:
        """(C_y, C_x/groups, *k): (C_out, C_in/g, *k) forward, (C_in, C_out/g, *k) transposed."""
        return (self.y_channels, self.x_channels // self.groups, *self.kernel_size)

    @property
    def x_shape(self) -> tuple[int, ...]:
        return (self.batch, self.x_channels, *self.x_size)

    @property
    def y_shape(self) -> tuple[int, ...]:
        return (self.batch, self.y_channels, *self.y_size)

    @property
    def side_elements(self) -> int:
        """Elements of x and y together, the whole batch (a layer's input and grad_output)."""
        return math.prod(self.x_shape) + math.prod(self.y_shape)

    @property
    def is_symmetric(self) -> bool:
        """True when every dim pads equally on both sides (expressible as one int per dim in torch)."""
        return all(lo == hi for lo, hi in self.padding)

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
    def reads_only_padding(self) -> bool:
        """Whether some kernel tap meets padding alone at every output position (in some dim): its grad_weight is
        exactly 0. Tap t reads x row t*d - p_lo + m*s at output m (m < o); False when x or y is empty."""
        for i, o, k, s, d, (lo, _) in zip(self.x_size, self.y_size, self.kernel_size, self.stride, self.dilation,
                                          self.padding):
            if i == 0 or o == 0:
                continue
            for t in range(k):
                first = t * d - lo  # the row tap t reads at output 0 (negative: padding)
                m = max(0, -(first // s))  # the first output at which it reads a row >= 0
                if m >= o or first + m * s >= i:
                    return True
        return False

    @property
    def positions(self) -> int:
        """P = prod(y_size): positions of the small side, the per-sample contraction length of grad_weight."""
        return math.prod(self.y_size)

    @property
    def taps(self) -> int:
        """T = prod(k): kernel taps."""
        return math.prod(self.kernel_size)

    def fit_output_size(self, output_size: Sequence[int]) -> ConvSpec:
        """This transposed conv with the output_padding that yields output_size (ConvTranspose's output_size=)."""
        op = tuple(want - (x - p) for want, x, p in zip(output_size, self.x_size, self.output_padding))
        return ConvSpec.from_shapes(self.input_shape, self.weight_shape, self.stride, self.padding, self.dilation,
                                    self.transposed, op, self.groups, fn=self.fn)

    @property
    def symmetric_padding(self) -> tuple[int, ...]:
        """min(p_lo, p_hi) per dim: the part of the padding torch can express as one int."""
        return tuple(min(lo, hi) for lo, hi in self.padding)

    @property
    def aten_args(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], bool, tuple[int, ...], int]:
        """(stride, padding, dilation, transposed, output_padding, groups) as aten.convolution takes them, with
        symmetric_padding (the rest of the padding is applied explicitly, see padding_excess)."""
        return (self.stride, self.symmetric_padding, self.dilation, self.transposed, self.output_padding,
                self.groups)

    @property
    def padding_excess(self) -> tuple[Pair, ...]:
        """Padding beyond symmetric_padding on each side, applied explicitly to the big side."""
        return tuple((lo - m, hi - m) for (lo, hi), m in zip(self.padding, self.symmetric_padding))

    # ---- polyphase, sub-pixel and space-to-depth geometry ----------------------------
    @property
    def phase_rows(self) -> tuple[int, ...]:
        """ceil(i/s) per dim: rows per phase of the big side; interleaving the s phases gives s*ceil(i/s) >= i."""
        return tuple(-(-i // s) for i, s in zip(self.x_size, self.stride))

    @property
    def phases(self) -> tuple[tuple[PhaseTaps | None, ...], ...]:
        """Per dim, for each phase rho = 0..s-1 of the big side, the taps that reach it (None: an empty phase).

        At most s/gcd(s, d) phases per dim receive taps, so at most prod(s/g) of the prod(s) N-d phases.
        """
        return tuple(phase_taps(i, k, s, d, lo, o) for i, k, s, d, (lo, _), o in zip(
            self.x_size, self.kernel_size, self.stride, self.dilation, self.padding, self.y_size))

    @property
    def subpixel_taps(self) -> tuple[tuple[int, Pair, tuple[int, ...]], ...] | None:
        """Per dim (fused taps, pads of y, offset of each phase's taps): every phase in one conv (sub-pixel).

        Each phase's taps are shifted by lo - lo_rho inside a common kernel of max(lo - lo_rho + count)
        taps, and y is padded once by (lo, hi) with lo = max(lo_rho). None when some phase needs
        dilation > 1 (d does not divide s) or a dim has no phase with taps (grad_input is then zero).
        Empty phases get offset 0.
        """
        out = []
        for rows, o, dim in zip(self.phase_rows, self.y_size, self.phases):
            live = [p for p in dim if p is not None]
            if not live or any(p.dilation != 1 for p in live):
                return None
            lo = max(p.pads[0] for p in live)
            taps = max(lo - p.pads[0] + p.count for p in live)
            offsets = tuple(0 if p is None else lo - p.pads[0] for p in dim)
            out.append((taps, (lo, rows + taps - 1 - o - lo), offsets))
        return tuple(out)

    @property
    def dilation_blocks(self) -> tuple[tuple[int, int], ...]:
        """Per dim (U, M): blocks of d rows of the read x and of y for space-to-depth by the dilation d.

        With stride 1, grad_weight[t] = sum_j x_read[t*d + j] y[j]; splitting j = d*m + phi makes it a
        stride-1 conv of the d phases x_phi[u] = x_read[d*u + phi] (U = k - 1 + M blocks) with the
        phases of y (M = ceil(o/d) blocks), phases folded into channels. y is zero-padded to M*d rows
        and x_read to U*d rows.
        """
        return tuple((k - 1 + -(-o // d), -(-o // d)) for k, d, o in zip(self.kernel_size, self.dilation, self.y_size))

    @property
    def stride_phases(self) -> tuple[tuple[int, int, Pair], ...]:
        """Per dim (Q, U, pads): the phases of x for grad_weight by the stride s (with dilation 1).

        Tap t = s*q + rho meets x_read[s*(j + q) + rho], which is row j + q of phase rho (the rows rho::s):
        each of the s phases is read by a stride-1 conv with Q = ceil(k/s) taps over U = o + Q - 1 rows, so
        x is padded by ``pads``, x_read_pads with the high side grown to s*U rows (the docs' "Derivation" page).

        Returns:
            tuple of (Q, U, (lo, hi)) per spatial dim.

        Examples:
            >>> ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1).stride_phases
            ((2, 5, (1, 2)),)
        """
        out = []
        for k, s, o, (lo, hi), size in zip(self.kernel_size, self.stride, self.y_size, self.x_read_pads,
                                           self.x_read_size):
            q = -(-k // s)
            out.append((q, o + q - 1, (lo, hi + s * (o + q - 1) - size)))
        return tuple(out)

    @property
    def fft_phases(self) -> tuple[FftDim, ...]:
        """Per dim the polyphase split of the read x into stride-1 correlations, for the FFT backend.

        Tap t reads x_pad[j*s + t*d]; with t*d = s*q + phi it is row j + q of phase phi (the rows phi::s), so each
        phase is read by a stride-1 correlation with the taps whose t*d = phi (mod s), at offsets q = t*d div s.
        Only the phases some tap reaches take part (the multiples of gcd(s, d) below s). With dilation 1 this is
        ``stride_phases`` (Q = ceil(k/s), U = o + Q - 1, the same pads); with stride 1 it is the dilated kernel.

        Returns:
            tuple of ``FftDim`` per spatial dim: the live phases, Q, U, the pads of x to s*U rows, the transform
            size L (5-smooth, >= U, so the circular products do not wrap) and each tap's slot p*Q + q.

        Examples:
            >>> spec = ConvSpec.from_shapes((1, 1, 7), (1, 1, 3), stride=2, padding=1)
            >>> spec.fft_phases[0][1:4] == spec.stride_phases[0]
            True
            >>> ConvSpec.from_shapes((1, 1, 9), (1, 1, 3), stride=2, dilation=2).fft_phases[0]
            FftDim(phases=(0,), taps=3, rows=5, pads=(0, 1), size=5, slots=(0, 1, 2))
        """
        out = []
        for k, s, d, o, (lo, hi), size in zip(self.kernel_size, self.stride, self.dilation, self.y_size,
                                              self.x_read_pads, self.x_read_size):
            q = d * (k - 1) // s + 1
            rows = o + q - 1
            phases = tuple(sorted({t * d % s for t in range(k)}))
            slots = tuple(phases.index(t * d % s) * q + t * d // s for t in range(k))
            out.append(FftDim(phases, q, rows, (lo, hi + s * rows - size), smooth_size(rows), slots))
        return tuple(out)

    def fft_chunks(self, phase_count: int, budget: int) -> tuple[int, int]:
        """(groups, samples) per chunk of the FFT backend, so that one chunk's spectra hold about ``budget`` reals.

        Per group the kernel spectra hold (C_y/g)(C_x/g)P complex bins per frequency; per group and sample the
        spectra of x and y hold (C_x/g)P + C_y/g (P: the live phases). Whole batches of as many groups as fit,
        else one group at a time and as many samples as fit; never less than one sample of one group.

        Examples:
            >>> spec = ConvSpec.from_shapes((8, 64, 28, 28), (64, 1, 31, 31), padding=15, groups=64)
            >>> spec.fft_chunks(1, 2**22)
            (64, 8)
            >>> spec.fft_chunks(1, 2**18)
            (4, 8)
        """
        bins = 2 * math.prod(f.size for f in self.fft_phases[:-1]) * (self.fft_phases[-1].size // 2 + 1)
        a, b = self.y_channels // self.groups, self.x_channels // self.groups * phase_count
        kernel, sample = a * b * bins, (a + b) * bins
        n = max(self.batch, 1)
        groups = budget // (kernel + n * sample)
        if groups >= 1:
            return min(groups, self.groups), n
        return 1, max(1, min(n, (budget - kernel) // sample))

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
        return self.batch * self.y_channels * math.prod(self.y_size) * (self.x_channels // self.groups) * math.prod(
            self.kernel_size
        )

    def describe(self) -> str:
        """One line: the configuration in torch's argument names; an unbatched input as given, (C_in, *spatial)."""
        kind = "conv_transpose" if self.transposed else "conv"
        given = f"{self.input_shape[1:]} (unbatched)" if self.unbatched else f"{self.input_shape}"
        parts = [f"{kind}{self.n}d input={given} weight={self.weight_shape}"]
        for name, value, default in (
            ("stride", self.stride, (1,) * self.n),
            ("padding", self.padding, ((0, 0),) * self.n),
            ("dilation", self.dilation, (1,) * self.n),
            ("output_padding", self.output_padding, (0,) * self.n),
        ):
            if value != default:
                parts.append(f"{name}={value}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        return " ".join(parts)


def _check_channels(fn: str, in_ch: int, out_ch: int, weight_shape: tuple[int, ...], groups: int,
                    transposed: bool) -> None:
    if in_ch < 1 or out_ch < 1:
        raise ConvgradValueError(f"{fn}: channels must be positive (in_channels={in_ch}, out_channels={out_ch})")
    if in_ch % groups:
        raise ConvgradValueError(f"{fn}: groups={groups} must divide in_channels={in_ch}")
    if out_ch % groups:
        raise ConvgradValueError(f"{fn}: groups={groups} must divide out_channels={out_ch}")
    if transposed:
        if weight_shape[0] != in_ch:
            raise ConvgradValueError(
                f"{fn}: weight.shape={weight_shape} expects in_channels={weight_shape[0]} for a transposed conv, "
                f"but input has {in_ch} channels"
            )
    elif weight_shape[1] * groups != in_ch:
        raise ConvgradValueError(
            f"{fn}: weight.shape={weight_shape} with groups={groups} expects in_channels="
            f"{weight_shape[1] * groups}, but input has {in_ch} channels"
        )


def _check_output_padding(fn: str, op: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
                          transposed: bool) -> None:
    if not transposed:
        if any(op):
            raise ConvgradValueError(f"{fn}: output_padding={op} is only allowed for a transposed convolution")
        return
    for p, s, d in zip(op, stride, dilation):
        if p >= max(s, d):
            raise ConvgradValueError(
                f"{fn}: output_padding={op} must be smaller than max(stride, dilation) in every dim "
                f"(stride={stride}, dilation={dilation})"
            )


def check_bias_sizes(fn: str, bias_sizes: Any, out_channels: int) -> None:
    """bias_sizes must be None or [C_out], as in aten.convolution_backward."""
    if bias_sizes is None:
        return
    if (not isinstance(bias_sizes, Sequence) or isinstance(bias_sizes, str) or list(bias_sizes) != [out_channels]
            or not _is_int(bias_sizes[0])):  # [6.0] == [6] in Python
        raise ConvgradValueError(f"{fn}: bias_sizes={bias_sizes!r} must be None or [out_channels]=[{out_channels}]")


def check_output_mask(fn: str, output_mask: Any) -> tuple[bool, bool, bool]:
    """output_mask must be three bools (grad_input, grad_weight, grad_bias)."""
    if (not isinstance(output_mask, Sequence) or isinstance(output_mask, str) or len(output_mask) != 3
            or not all(isinstance(m, bool) for m in output_mask)):
        raise ConvgradValueError(
            f"{fn}: output_mask={output_mask!r} must be three bools (grad_input, grad_weight, grad_bias)")
    return (output_mask[0], output_mask[1], output_mask[2])
