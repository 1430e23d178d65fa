"""Argument normalisation of a convolution: torch's int-or-tuple arguments to per-dim tuples, with the checks.

Every error names the function (``fn``), the parameter and its value. Integers only, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from convgrad.errors import ConvgradTypeError, ConvgradValueError

Pair = tuple[int, int]
Shape = tuple[int, ...]  # a tensor's sizes, or one size per spatial dim
PaddingArg = int | str | Sequence[Any]
IntOrTuple = int | Sequence[int]

__all__ = ["MAX_SPECS", "SPECS", "IntOrTuple", "Normalised", "PaddingArg", "Pair", "Shape", "check_bias_sizes",
           "check_channels", "check_extents", "check_output_mask", "check_output_padding", "exact", "is_int",
           "is_symbolic", "memo_key", "normalise", "ntuple", "padding_pairs", "remember", "same_padding", "shape_tuple",
           "value_text"]


def is_int(v: object) -> bool:
    return (isinstance(v, int) and not isinstance(v, bool)) or type(v).__name__ in {"int64", "int32"}


def is_symbolic(v: object) -> bool:
    """A symbolic size (``torch.SymInt``, by name: no torch here): a dynamic dim under torch.export. The spec
    computes with it as with an int, each comparison a guard of the trace, and never calls ``int()`` on it, which
    would fix the dim to the example's size (issue 40, item 2)."""
    return type(v).__name__ == "SymInt"


def ntuple(fn: str, name: str, value: Any, n: int, minimum: int, *, broadcast: bool = False,
           symbolic: bool = False) -> tuple[int, ...]:
    """Normalise an int or an n-sequence of ints, checking each is >= minimum.

    ``broadcast``: a one-element sequence stands for every dim, as torch's convolutions read stride, padding,
    dilation and output_padding (``stride=(2,)`` of a 2d conv is ``(2, 2)``); shapes never broadcast.
    ``symbolic``: symbolic sizes (``is_symbolic``) pass as they are: a tensor's shape under torch.export.
    """
    if is_int(value):
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
    kept = tuple(symbolic and is_symbolic(v) for v in values)
    for v, keep in zip(values, kept):
        if not (keep or is_int(v)):
            raise ConvgradTypeError(f"{fn}: {name}={value!r} must contain only ints (got {type(v).__name__})")
        if (v if keep else int(v)) < minimum:
            rule = "positive" if minimum == 1 else f">= {minimum}"
            raise ConvgradValueError(f"{fn}: {name}={value!r} must be {rule}")
    return tuple(v if keep else int(v) for v, keep in zip(values, kept))


def same_padding(size: int, kernel: int, stride: int, dilation: int) -> Pair:
    """'same' padding of one dim: total t = max((ceil(i/s)-1)s + d(k-1) + 1 - i, 0), extra on the high side."""
    # ceil(i/s) as -(-i // s): integers throughout, so a symbolic size (is_symbolic) stays one (it has no true
    # division); for stride 1, t is d(k-1) whatever the size
    total = max((-(-size // stride) - 1) * stride + dilation * (kernel - 1) + 1 - size, 0)
    return total // 2, total - total // 2


def padding_pairs(fn: str, padding: PaddingArg, n: int, transposed: bool) -> tuple[Pair, ...] | str:
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
            lo, hi = ntuple(fn, "padding", tuple(p), 2, 0)
            pairs.append((lo, hi))
        return tuple(pairs)
    return tuple((p, p) for p in ntuple(fn, "padding", padding, n, 0, broadcast=True))


def exact(v: object) -> bool:
    """An argument from_shapes may look up by value: an int or a str, or a tuple (torch.Size) of those.

    Exact types only: equal values of other types (1.0, numpy ints, True for 1) must be validated themselves.
    """
    return type(v) in (int, str) or (isinstance(v, tuple) and all(map(exact, v)))


# from_shapes's validated specs by their arguments: a layer calls it with the same arguments on every forward, and
# validating them took 11-18 us of a 100 us conv (the demo's layers). Bounded; cleared when full.
MAX_SPECS = 4096
SPECS: dict[tuple[Any, ...], Any] = {}


_INT = frozenset((int,))
_BOOL = frozenset((bool,))
_ATOMS = (int, str)


def memo_key(owner: type, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """The ``SPECS`` key of from_shapes's arguments ``(input_shape, weight_shape, stride, padding, dilation,
    transposed, output_padding, groups, fn)``, or None when they must be validated themselves: 1.0 == 1 and
    True == 1, so only exact types share an entry (``exact``); a subclass (``owner``) builds its own class.

    Asked on every call of every layer: the common forms (an int or a str, a tuple or torch.Size of ints) are
    tested by type in C, without a Python call per value; the rest (``(lo, hi)`` pairs) by ``exact``."""
    if type(args[5]) is not bool:
        return None
    for v in args[:5] + args[6:]:
        if not (type(v) in _ATOMS or (isinstance(v, tuple) and (_INT.issuperset(map(type, v)) or exact(v)))):
            return None
    return (owner, *args)


def remember(key: tuple[Any, ...], spec: Any) -> None:
    """Store a validated spec under its ``memo_key``; the memo is cleared when full."""
    if len(SPECS) >= MAX_SPECS:
        SPECS.clear()
    SPECS[key] = spec


def value_text(value: Any) -> str:
    """An argument as an error shows it: an array (a tensor, a NumPy array: anything with a shape and a dtype) by its
    type and shape, since its repr runs to tens of lines of numbers; anything else by its repr.

    Examples:
        >>> import numpy as np
        >>> value_text(np.zeros((1, 3, 5))), value_text((1, 3, 5))
        ('<ndarray of shape (1, 3, 5), float64>', '(1, 3, 5)')
    """
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or isinstance(value, (tuple, list)):
        return repr(value)
    return f"<{type(value).__name__} of shape {tuple(shape)}, {str(dtype).removeprefix('torch.')}>"


def shape_tuple(fn: str, name: str, shape: Any) -> tuple[int, ...]:
    if not isinstance(shape, Sequence) or isinstance(shape, str):
        hint = " (pass its .shape)" if hasattr(shape, "shape") else ""
        raise ConvgradTypeError(f"{fn}: {name}={value_text(shape)} must be a sequence of ints{hint}")
    return ntuple(fn, name, tuple(shape), len(shape), 0, symbolic=True)


def check_channels(fn: str, in_ch: int, out_ch: int, weight_shape: tuple[int, ...], groups: int,
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


def check_output_padding(fn: str, op: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...],
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


def check_extents(fn: str, input_size: tuple[int, ...], kernel: tuple[int, ...], dilation: tuple[int, ...],
                  padding: tuple[Pair, ...], transposed: bool, x_size: tuple[int, ...]) -> None:
    """The kernel fits in the padded input (forward); the output of a transposed conv (``x_size``) is not empty."""
    for dim, (i, k, d, (lo, hi)) in enumerate(zip(input_size, kernel, dilation, padding)):
        if not transposed and d * (k - 1) + 1 > i + lo + hi:
            raise ConvgradValueError(
                f"{fn}: kernel extent dilation*(k-1)+1={d * (k - 1) + 1} is larger than the padded "
                f"input {i}+{lo}+{hi}={i + lo + hi} in spatial dim {dim}"
            )
    if transposed and any(v < 1 for v in x_size):
        raise ConvgradValueError(f"{fn}: the transposed convolution's output size {x_size} must be positive; "
                                 f"padding={padding} crops too much")


def check_bias_sizes(fn: str, bias_sizes: Any, out_channels: int) -> None:
    """bias_sizes must be None or [C_out], as in aten.convolution_backward."""
    if bias_sizes is None:
        return
    if (not isinstance(bias_sizes, Sequence) or isinstance(bias_sizes, str) or list(bias_sizes) != [out_channels]
            or not is_int(bias_sizes[0])):  # [6.0] == [6] in Python
        raise ConvgradValueError(f"{fn}: bias_sizes={bias_sizes!r} must be None or [out_channels]=[{out_channels}]")


def check_output_mask(fn: str, output_mask: Any) -> tuple[bool, bool, bool]:
    """output_mask must be three bools (grad_input, grad_weight, grad_bias)."""
    if type(output_mask) is tuple and len(output_mask) == 3 and _BOOL.issuperset(map(type, output_mask)):
        return output_mask  # the usual form, tested in C (an isinstance of Sequence runs three Python frames)
    if (not isinstance(output_mask, Sequence) or isinstance(output_mask, str) or len(output_mask) != 3
            or not all(isinstance(m, bool) for m in output_mask)):
        raise ConvgradValueError(
            f"{fn}: output_mask={output_mask!r} must be three bools (grad_input, grad_weight, grad_bias)")
    return (output_mask[0], output_mask[1], output_mask[2])


# ``ConvSpec``'s fields but ``fn``, in their order: batch, in_channels, out_channels, input_size, kernel_size, stride,
# padding, dilation, transposed, output_padding, groups, unbatched.
Normalised = tuple[int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[Pair, ...],
                   tuple[int, ...], bool, tuple[int, ...], int, bool]


def normalise(input_shape: Sequence[int], weight_shape: Sequence[int], stride: IntOrTuple = 1,
              padding: PaddingArg = 0, dilation: IntOrTuple = 1, transposed: bool = False,
              output_padding: IntOrTuple = 0, groups: int = 1, fn: str = "ConvSpec") -> Normalised:
    """Validate convolution arguments against the input and weight shapes (``ConvSpec.from_shapes`` documents
    them); 'same' padding resolved from the sizes.

    Raises:
        TypeError: a non-integer where an int is needed.
        ValueError: any value out of range or inconsistent with the shapes.
    """
    weight_shape = shape_tuple(fn, "weight.shape", weight_shape)
    n = len(weight_shape) - 2
    if n not in (1, 2, 3):
        raise ConvgradValueError(f"{fn}: weight.shape={weight_shape} must have 3, 4 or 5 dims (1d, 2d or 3d conv)")
    input_shape = shape_tuple(fn, "input.shape", input_shape)
    if len(input_shape) not in (n + 1, n + 2):
        raise ConvgradValueError(
            f"{fn}: input.shape={input_shape} must have {n + 2} dims (N, C, *spatial) "
            f"or {n + 1} (C, *spatial) for a {n}d weight of shape {weight_shape}"
        )
    unbatched = len(input_shape) == n + 1
    batched = (1, *input_shape) if unbatched else input_shape
    if not isinstance(transposed, bool):
        raise ConvgradTypeError(f"{fn}: transposed={transposed!r} must be a bool")
    if not is_int(groups):
        raise ConvgradTypeError(f"{fn}: groups={groups!r} must be an int")
    if groups < 1:
        raise ConvgradValueError(f"{fn}: groups={groups} must be positive")
    stride_t = ntuple(fn, "stride", stride, n, 1, broadcast=True)
    dilation_t = ntuple(fn, "dilation", dilation, n, 1, broadcast=True)
    op = ntuple(fn, "output_padding", output_padding, n, 0, broadcast=True)
    pads = padding_pairs(fn, padding, n, transposed)
    kernel = weight_shape[2:]
    if any(k < 1 for k in kernel):
        raise ConvgradValueError(f"{fn}: weight.shape={weight_shape} has an empty kernel")
    if any(v < 1 for v in batched[2:]):
        raise ConvgradValueError(f"{fn}: input.shape={input_shape} has an empty spatial dim")
    in_ch = batched[1]
    out_ch = weight_shape[1] * groups if transposed else weight_shape[0]
    check_channels(fn, in_ch, out_ch, weight_shape, int(groups), transposed)
    if isinstance(pads, str):  # 'same', the one string padding_pairs returns
        pads = tuple(same_padding(*a) for a in zip(batched[2:], kernel, stride_t, dilation_t))
    check_output_padding(fn, op, stride_t, dilation_t, transposed)
    return (batched[0], in_ch, out_ch, batched[2:], kernel, stride_t, pads, dilation_t, transposed, op, int(groups),
            unbatched)
