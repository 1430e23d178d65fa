"""Convolutions and their gradients in NumPy alone: N-d, every hyperparameter, transposed; no torch.

Contractions, per group g (forward geometry of spec/geometry.py; x: big side, y: small side;
A = C_y/g, B = (C_x/g)*T with T = prod(k) taps, M = N*P with P = prod(o) positions):
    cols        sliding_window_view(x_pad)[..., ::s, ::d] -> [g, B, M]          (im2col, one copy)
    y           einsum('gab,gbm->gam', w, cols)        [g, A, B] @ [g, B, M]   (forward conv; grad of y)
    grad of w   einsum('gam,gbm->gab', y, cols)        [g, A, M] @ [g, M, B]
    grad of x   einsum('gab,gam->gbm', w, y)           [g, B, A] @ [g, A, M], then fold (col2im) into x
Each einsum runs as np.matmul on the stacked (g, ., .) matrices, so BLAS does the work.
A forward conv maps x -> y; a transposed conv maps y -> x, so its output is the
"grad of x" contraction of its input (the docs' "Derivation" page).

Shapes come from ``convgrad.spec.ConvSpec``, which imports no torch either, so
this module runs where torch is not installed. The public functions mirror
torch's names and argument order (DESIGN.md, section 6); ``forward`` and
``backward`` take a ready ConvSpec and batched arrays (the "numpy" backend uses them).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.spec import ConvSpec, IntOrTuple, PaddingArg, check_bias_sizes, check_output_mask, pad_then_crop

__all__ = ["DTYPES", "backward", "conv", "conv_backward", "conv_transpose", "forward"]

DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
Array = np.ndarray
Grads = tuple[Array | None, Array | None, Array | None]


# ---- the public API -----------------------------------------------------------------------------------------------

def conv(input: Array, weight: Array, bias: Array | None = None, stride: IntOrTuple = 1, padding: PaddingArg = 0,
         dilation: IntOrTuple = 1, groups: int = 1) -> Array:
    """N-d convolution of NumPy arrays (torch.nn.functional.conv{1,2,3}d semantics, from the weight's rank).

    Args:
        input: ``(N, C_in, *spatial)`` or unbatched ``(C_in, *spatial)``; float32 or float64.
        weight: ``(C_out, C_in/groups, *k)``, same dtype.
        bias: ``(C_out,)`` or None (default).
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple, ``(lo, hi)`` pairs, ``'same'`` or ``'valid'`` (default 0).
        groups: int dividing both channel counts (default 1).

    Returns:
        ``(N, C_out, *out)`` (``(C_out, *out)`` if unbatched), ``out = floor((i + p_lo + p_hi - d(k-1) - 1)/s) + 1``.

    Raises:
        TypeError: a non-array, a dtype other than float32/float64, mismatched dtypes.
        ValueError: invalid hyperparameters or shapes that do not fit.

    Source: K. Chellapilla, S. Puri, P. Simard, "High Performance Convolutional Neural Networks for
    Document Processing" (2006): unfolded into columns, the input makes the convolution one matrix
    product; the docs' "Derivation" page, "Notation: the forward geometry", for the shapes.

    Examples:
        >>> import numpy as np, convgrad.numpy as cgn
        >>> x, w = np.ones((2, 4, 9, 9)), np.ones((6, 2, 3, 3))
        >>> y = cgn.conv(x, w, stride=2, padding=1, groups=2)
        >>> y.shape, float(y[0, 0, 1, 1])
        ((2, 6, 5, 5), 18.0)
    """
    return _apply("conv", input, weight, bias, stride, padding, dilation, False, 0, groups)


def conv_transpose(input: Array, weight: Array, bias: Array | None = None, stride: IntOrTuple = 1,
                   padding: PaddingArg = 0, output_padding: IntOrTuple = 0, groups: int = 1,
                   dilation: IntOrTuple = 1) -> Array:
    """N-d transposed convolution of NumPy arrays (torch.nn.functional.conv_transpose{1,2,3}d order).

    Args:
        input: ``(N, C_in, *spatial)`` or unbatched ``(C_in, *spatial)``; float32 or float64.
        weight: ``(C_in, C_out/groups, *k)``, same dtype.
        bias: ``(C_out,)`` or None (default).
        stride, dilation: int or N-tuple (default 1).
        padding: int, N-tuple or ``(lo, hi)`` pairs cropped from the output (default 0); 'same' is rejected.
        output_padding: int or N-tuple, each < max(stride, dilation) (default 0).
        groups: int (default 1).

    Returns:
        ``(N, C_out, *out)`` (``(C_out, *out)`` if unbatched), ``out = (i-1)s - p_lo - p_hi + d(k-1) + op + 1``.

    Raises:
        TypeError, ValueError: as ``conv``.

    Source: the docs' "Derivation" page, "Transposed convolutions": the adjoint of the forward conv, here
    w^T times the input's matrix folded back (col2im) as in Chellapilla et al. (2006).

    Examples:
        >>> import numpy as np, convgrad.numpy as cgn
        >>> x, w = np.ones((1, 4, 5, 5), np.float32), np.ones((4, 3, 3, 3), np.float32)
        >>> y = cgn.conv_transpose(x, w, stride=2, padding=1, output_padding=1)
        >>> y.shape, y.dtype
        ((1, 3, 10, 10), dtype('float32'))
    """
    return _apply("conv_transpose", input, weight, bias, stride, padding, dilation, True, output_padding, groups)


def conv_backward(grad_output: Array, input: Array, weight: Array, bias_sizes: Sequence[int] | None = None,
                  stride: IntOrTuple = 1, padding: PaddingArg = 0, dilation: IntOrTuple = 1,
                  transposed: bool = False, output_padding: IntOrTuple = 0, groups: int = 1,
                  output_mask: Sequence[bool] = (True, True, True)) -> Grads:
    """All three gradients of a (transposed) convolution, in aten.convolution_backward's argument order.

    Args:
        grad_output: ``(N, C_out, *out_spatial)`` or unbatched ``(C_out, *out_spatial)``; float32 or float64.
        input: ``(N, C_in, *spatial)`` or ``(C_in, *spatial)``, same dtype.
        weight: ``(C_out, C_in/groups, *k)``, or ``(C_in, C_out/groups, *k)`` when ``transposed``.
        bias_sizes: None or ``[C_out]`` (default None); grad_bias is returned whenever ``output_mask[2]``.
        stride, padding, dilation, transposed, output_padding, groups: as in ``conv`` and
            ``conv_transpose`` (defaults 1, 0, 1, False, 0, 1).
        output_mask: three bools (default all True); a masked gradient is None and not computed.

    Returns:
        ``(grad_input, grad_weight, grad_bias)`` of shapes ``input.shape``, ``weight.shape`` and ``(C_out,)``.

    Raises:
        TypeError, ValueError: as ``conv``; also a grad_output whose shape is not the output's.

    Source: the docs' "Derivation" page, "grad_input of a forward convolution", "grad_weight" and "Transposed
    convolutions", in the matrix form of Chellapilla et al. (2006): grad_weight = y x cols^T,
    grad_input = col2im(w^T x y).

    Examples:
        >>> import numpy as np, convgrad.numpy as cgn
        >>> x, w = np.ones((2, 4, 9, 9)), np.ones((6, 2, 3, 3))
        >>> gy = np.ones((2, 6, 4, 4))
        >>> gi, gw, gb = cgn.conv_backward(gy, x, w, [6], stride=2, groups=2)
        >>> gi.shape, gw.shape, gb.shape, float(gw[0, 0, 0, 0]), float(gb[0])
        ((2, 4, 9, 9), (6, 2, 3, 3), (6,), 32.0, 32.0)
    """
    fn = "convgrad.numpy.conv_backward"
    _check_arrays(fn, grad_output=grad_output, input=input, weight=weight)
    spec = ConvSpec.from_shapes(input.shape, weight.shape, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    expected = spec.output_shape[1:] if spec.unbatched else spec.output_shape
    if tuple(grad_output.shape) != expected:
        raise ConvgradValueError(f"{fn}: grad_output.shape={tuple(grad_output.shape)} does not match the output shape "
                                 f"{expected} of {spec.describe()}")
    check_bias_sizes(fn, bias_sizes, spec.out_channels)
    mask = check_output_mask(fn, output_mask)
    if spec.unbatched:
        grad_output, input = grad_output[None], input[None]  # (1, C, *spatial)
    gi, gw = backward(spec, grad_output, input, weight, mask[0], mask[1])
    gb = grad_output.sum(axis=(0, *range(2, grad_output.ndim))) if mask[2] else None  # (C_out,)
    if spec.unbatched and gi is not None:
        gi = gi[0]  # (C_in, *spatial)
    return gi, gw, gb


# ---- the spec-level entry points ----------------------------------------------------------------------------------

def forward(spec: ConvSpec, input: Array, weight: Array, bias: Array | None = None) -> Array:
    """The convolution that spec describes, on batched arrays already checked against it.

    Args:
        spec: a validated ``ConvSpec`` (forward or transposed).
        input: ``spec.input_shape``, float32 or float64.
        weight: ``spec.weight_shape``, same dtype.
        bias: ``(C_out,)`` or None (default).

    Returns:
        ``spec.output_shape``, a new contiguous array of the input's dtype.

    Source: as ``conv`` and ``conv_transpose``, which check their
    arguments and call this.

    Examples:
        >>> import numpy as np
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((1, 2, 4), (2, 3, 3), stride=2, transposed=True)
        >>> forward(spec, np.ones((1, 2, 4)), np.ones((2, 3, 3))).shape
        (1, 3, 9)
    """
    if spec.transposed:  # y -> x: the adjoint of the forward conv
        out = _fold(spec, _wmat(spec, weight).transpose(0, 2, 1) @ _ymat(spec, input), spec.batch)
    else:  # x -> y
        out = _y_array(spec, _wmat(spec, weight) @ _cols(spec, input), spec.batch)
    if bias is not None:
        out += bias.reshape(-1, *(1,) * spec.n)  # broadcast over (N, ., *spatial)
    return out


def backward(spec: ConvSpec, grad_output: Array, input: Array | None, weight: Array | None, need_input: bool,
             need_weight: bool) -> tuple[Array | None, Array | None]:
    """grad_input and grad_weight of the convolution that spec describes, on batched arrays.

    Args:
        spec: a validated ``ConvSpec`` (forward or transposed).
        grad_output: ``spec.output_shape``, float32 or float64.
        input: ``spec.input_shape``, same dtype; only read when ``need_weight``.
        weight: ``spec.weight_shape``, same dtype; only read when ``need_input``.
        need_input, need_weight: which gradients to compute.

    Returns:
        ``(grad_input, grad_weight)`` of shapes ``spec.input_shape`` and ``spec.weight_shape``; None where
        not needed.

    Source: as ``conv_backward``, which checks its arguments and calls this.

    Examples:
        >>> import numpy as np
        >>> from convgrad.spec import ConvSpec
        >>> spec = ConvSpec.from_shapes((2, 4, 6), (6, 2, 3), groups=2)
        >>> gi, gw = backward(spec, np.ones((2, 6, 4)), None, np.ones((6, 2, 3)), True, False)
        >>> gi.shape, gw, gi[0, 0].tolist()
        ((2, 4, 6), None, [3.0, 6.0, 9.0, 9.0, 6.0, 3.0])
    """
    gi = gw = None
    if spec.transposed:  # x = grad_output, y = input: both gradients read the columns of grad_output
        cols = _cols(spec, grad_output) if (need_input or need_weight) else None
        if need_input:
            gi = _y_array(spec, _wmat(spec, weight) @ cols, spec.batch)  # type: ignore[arg-type]
        if need_weight:
            gw = _ymat(spec, input) @ cols.transpose(0, 2, 1)  # type: ignore[arg-type, union-attr]
    else:  # x = input, y = grad_output
        ymat = _ymat(spec, grad_output)
        if need_input:
            gi = _fold(spec, _wmat(spec, weight).transpose(0, 2, 1) @ ymat, spec.batch)  # type: ignore[arg-type]
        if need_weight:
            gw = ymat @ _cols(spec, input).transpose(0, 2, 1)  # type: ignore[arg-type]
    return gi, None if gw is None else gw.reshape(spec.weight_shape)  # (C_y, C_x/g, *k)


# ---- the contraction's pieces -------------------------------------------------------------------------------------

def _wmat(spec: ConvSpec, weight: Array) -> Array:
    """(C_y, C_x/g, *k) -> (g, A, B)."""
    return weight.reshape(spec.groups, spec.y_group_channels, -1)


def _cols(spec: ConvSpec, x: Array) -> Array:
    """im2col: x (N, C_x, *i) -> (g, B, N*P), the dilated windows each position of y reads."""
    n, g, nb = spec.n, spec.groups, x.shape[0]
    xr = _pad(x, spec.x_read_pads)  # (N, C_x, *x_read_size)
    win = sliding_window_view(xr, spec.kernel_extent, axis=tuple(range(2, 2 + n)))  # (N, C_x, *pos, *extent)
    win = win[(..., *(slice(None, None, s) for s in spec.stride), *(slice(None, None, d) for d in spec.dilation))]
    win = win.reshape(nb, g, spec.x_group_channels, *win.shape[2:])  # (N, g, C_x/g, *o, *k)
    win = win.transpose(1, 2, *range(3 + n, 3 + 2 * n), 0, *range(3, 3 + n))  # (g, C_x/g, *k, N, *o)
    return win.reshape(g, spec.x_group_channels * spec.taps, nb * spec.positions)


def _fold(spec: ConvSpec, cols: Array, nb: int) -> Array:
    """col2im, the adjoint of ``_cols``: (g, B, N*P) -> x (N, C_x, *i)."""
    g, cg, k = spec.groups, spec.x_group_channels, spec.kernel_size
    cols = cols.reshape(g, cg, *k, nb, *spec.y_size)  # (g, C_x/g, *k, N, *o)
    xr = np.zeros((g, cg, nb, *spec.x_read_size), dtype=cols.dtype)  # (g, C_x/g, N, *x_read_size)
    for tap in itertools.product(*(range(kj) for kj in k)):
        xr[(..., *spec.tap_window(tap))] += cols[(slice(None), slice(None), *tap)]  # (g, C_x/g, N, *o)
    xr = xr.reshape(spec.x_channels, nb, *spec.x_read_size).swapaxes(0, 1)  # (N, C_x, *x_read_size)
    return np.ascontiguousarray(_pad(xr, [(-lo, -hi) for lo, hi in spec.x_read_pads]))  # (N, C_x, *i)


def _ymat(spec: ConvSpec, y: Array) -> Array:
    """y (N, C_y, *o) -> (g, A, N*P)."""
    g, a, nb = spec.groups, spec.y_group_channels, y.shape[0]
    y = y.reshape(nb, g, a, spec.positions)  # (N, g, A, P)
    return y.transpose(1, 2, 0, 3).reshape(g, a, nb * spec.positions)  # (g, A, N*P)


def _y_array(spec: ConvSpec, ymat: Array, nb: int) -> Array:
    """(g, A, N*P) -> y (N, C_y, *o), contiguous."""
    y = ymat.reshape(spec.y_channels, nb, *spec.y_size)  # (C_y, N, *o)
    return np.ascontiguousarray(y.swapaxes(0, 1))  # (N, C_y, *o)


def _pad(a: Array, pairs: Sequence[tuple[int, int]]) -> Array:
    """Pad the trailing len(pairs) dims by (lo, hi) zeros each; a negative amount crops."""
    lead = a.ndim - len(pairs)
    # pad first, then crop: a crop on one side may exceed the input when the other side's pad makes room
    grow, cut = pad_then_crop(pairs)
    if any(lo > 0 or hi > 0 for lo, hi in pairs):
        a = np.pad(a, [(0, 0)] * lead + list(grow))
    return a[(*(slice(None),) * lead, *(slice(lo, a.shape[lead + j] - hi) for j, (lo, hi) in enumerate(cut)))]


# ---- checks -------------------------------------------------------------------------------------------------------

def _check_arrays(fn: str, optional: tuple[str, ...] = ("bias",), **arrays: Any) -> None:
    """Each argument is an ndarray of float32 or float64, all of one dtype; only those named in ``optional`` may be
    None."""
    first = None
    for name, a in arrays.items():
        if a is None and name in optional:
            continue
        if a is None:
            raise ConvgradTypeError(f"{fn}: {name} is None, but a numpy.ndarray is required")
        if not isinstance(a, np.ndarray):
            raise ConvgradTypeError(f"{fn}: {name} must be a numpy.ndarray, got {type(a).__name__}")
        if a.dtype not in DTYPES:
            raise ConvgradTypeError(f"{fn}: {name}.dtype={a.dtype} is not supported; use float32 or float64")
        if first is None:
            first = (name, a.dtype)
        elif a.dtype != first[1]:
            raise ConvgradTypeError(f"{fn}: {name}.dtype={a.dtype} does not match {first[0]}.dtype={first[1]}")


def _apply(name: str, input: Array, weight: Array, bias: Array | None, stride: IntOrTuple, padding: PaddingArg,
           dilation: IntOrTuple, transposed: bool, output_padding: IntOrTuple, groups: int) -> Array:
    fn = f"convgrad.numpy.{name}"
    _check_arrays(fn, input=input, weight=weight, bias=bias)
    spec = ConvSpec.from_shapes(input.shape, weight.shape, stride, padding, dilation, transposed, output_padding,
                                groups, fn=fn)
    if bias is not None and tuple(bias.shape) != (spec.out_channels,):
        raise ConvgradValueError(f"{fn}: bias.shape={tuple(bias.shape)} must be (out_channels,)=({spec.out_channels},)")
    out = forward(spec, input[None] if spec.unbatched else input, weight, bias)
    return out[0] if spec.unbatched else out
