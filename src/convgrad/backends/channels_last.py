"""The channels_last backend: PyTorch's own backward kernels, run on channels-last copies of the operands.

Contraction: native's (``aten.convolution_backward``, see native.py), per group g (T taps, P positions):
    grad_input  [N, P, C_out/g] x [C_out/g, C_in/g, T] -> [N, P, C_in/g]   (taps scattered to input positions)
    grad_weight [C_out/g, N*P] x [N*P, C_in/g * T]     -> [C_out/g, C_in/g * T]
with the channels innermost in memory (NHWC, NDHWC); a 1d conv runs as a 2d one over rows of height 1.

Why a backend of its own: on the CPU, oneDNN chooses its kernel by memory layout. For grouped and
depthwise convs in the contiguous (NCHW) layout, its weight gradient, and the input gradient of 3d
depthwise convs, fall back to im2col + GEMM (``x64:gemm:jit`` in ``ONEDNN_VERBOSE=1``); in
channels-last the same calls run its direct ``jit:avx512_core`` kernels. Measured (2 threads, busy
2-core machine, paired rounds, multiples of native's forward): grad_weight of a 3d conv in 8 groups of
8 channels 1.7x (contiguous: 4-39x, the spread is that of the im2col path under load); of 3D ResNeXt's
32 groups of 8, 1.7x (contiguous: 12.6x). The price is a copy of input and grad_output into
channels-last and of the gradients back, memory-bound passes that a fast kernel does not need: for
depthwise layers whose contiguous kernels are direct already (2d 3x3) it loses.

``plan(spec)`` lists the steps (each has ``describe()``); ``execute`` runs them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convgrad.backends import FusedBackend, Grads, get_backend, register
from convgrad.backends.native import NativeBackward
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import CHANNELS_LAST, ONEDNN_DTYPES, is_channels_last, plain

__all__ = ["ChannelsLastBackend", "LayoutPlan", "execute", "plan"]



@dataclass(frozen=True)
class AddUnitDim:
    """(N, C, L) -> (N, C, 1, L): a 1d operand as a 2d one with rows of height 1 (a view)."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return t.unsqueeze(2)  # (N, C, 1, L)

    def describe(self) -> str:
        return "view each 1d operand as 2d: (N, C, L) -> (N, C, 1, L)"


@dataclass(frozen=True)
class ToChannelsLast:
    """Copy an operand into channels-last memory (no copy when it is already)."""

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        fmt = CHANNELS_LAST[t.dim()]
        out = t.contiguous(memory_format=fmt)
        # torch counts a tensor as channels-last whatever the strides of its size-1 dims, and its float64 CPU
        # backward then computes a wrong grad_weight for some (input (1, 4, 1, 2) with strides (4, 1, 8, 4),
        # groups=2; torch 2.13): a copy with the format's own strides
        return out if out.stride() == torch.empty_like(out, memory_format=fmt, device="meta").stride() \
            else out.clone(memory_format=fmt)

    def describe(self) -> str:
        return "copy input, weight and grad_output into channels-last memory (NHWC / NDHWC)"


@dataclass(frozen=True)
class RestoreLayout:
    """The gradients in the layout torch returns them in: channels-last when input or weight is, else contiguous."""

    unit_dim: bool  # drop the dim AddUnitDim added

    def __call__(self, t: torch.Tensor, channels_last: bool) -> torch.Tensor:
        if self.unit_dim:
            t = t.squeeze(2)  # (N, C, L)
        fmt = CHANNELS_LAST.get(t.dim()) if channels_last else None
        return t.contiguous(memory_format=fmt or torch.contiguous_format)

    def describe(self) -> str:
        squeeze = "drop the unit dim, then " if self.unit_dim else ""
        return f"{squeeze}return each gradient channels-last if input or weight is, else contiguous (as torch does)"


@dataclass(frozen=True)
class LayoutPlan:
    """The steps of this backend for one convolution, in order: prepare each operand, run, restore each gradient."""

    spec: ConvSpec
    prepare: tuple[AddUnitDim | ToChannelsLast, ...]
    run: NativeBackward
    restore: RestoreLayout

    def describe(self) -> str:
        steps = [*self.prepare, self.run, self.restore]
        return "\n".join(f"{i}. {step.describe()}" for i, step in enumerate(steps, 1))


def plan(spec: ConvSpec) -> LayoutPlan:
    """The channels-last plan of a convolution: a 1d conv runs as a 2d one over rows of height 1.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> print(plan(ConvSpec.from_shapes((2, 8, 50), (8, 1, 5), padding=2, groups=8)).describe())
        ... # doctest: +NORMALIZE_WHITESPACE
        1. view each 1d operand as 2d: (N, C, L) -> (N, C, 1, L)
        2. copy input, weight and grad_output into channels-last memory (NHWC / NDHWC)
        3. aten.convolution_backward of conv2d input=(2, 8, 1, 50) weight=(8, 1, 1, 5)
           padding=((0, 0), (2, 2)) groups=8, channels-last
        4. drop the unit dim, then return each gradient channels-last if input or weight is,
           else contiguous (as torch does)
    """
    unit_dim = spec.n == 1
    run = spec.with_leading_unit_dim() if unit_dim else spec
    prepare = (AddUnitDim(), ToChannelsLast()) if unit_dim else (ToChannelsLast(),)
    # aten.convolution_backward on the channels-last operands: oneDNN's direct kernels for this layout
    return LayoutPlan(spec, prepare, NativeBackward(run, f"of {run.describe()}, channels-last"),
                      RestoreLayout(unit_dim))


def execute(p: LayoutPlan, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
            need_input: bool, need_weight: bool) -> Grads:
    """Run a plan: both gradients (None where not needed), in torch's layout for these operands.

    Under functorch transforms (vmap, grad, ...) and while torch.compile traces, operands are not plain
    (``tensor_ops.plain``): memory formats cannot be queried or chosen inside vmap, so native runs as it is.
    """
    if not all(plain(t) for t in (grad_output, input, weight) if t is not None):
        return get_backend("native").backward(p.spec, grad_output, input, weight, need_input, need_weight)
    channels_last = any(is_channels_last(t) for t in (input, weight) if t is not None)
    if input is None:  # grad_input alone: grad_output stands for the input's layout
        channels_last = channels_last or is_channels_last(grad_output)
    if need_weight and grad_output.dtype == torch.bfloat16 and p.spec.reads_only_padding:
        # oneDNN's channels-last bfloat16 weight gradient leaves the taps that meet only padding uninitialised
        # (native.HALF_DTYPES): native on contiguous operands, which sets them to 0, in torch's layout
        plain_ops = (None if t is None else t.contiguous() for t in (grad_output, input, weight))
        grads = get_backend("native").backward(p.spec, *plain_ops, need_input, need_weight)  # type: ignore[arg-type]
        restore = RestoreLayout(unit_dim=False)
        gi, gw = (None if g is None else restore(g, channels_last) for g in grads)
        return gi, gw

    def prepared(t: torch.Tensor | None) -> torch.Tensor | None:
        for step in p.prepare:
            t = None if t is None else step(t)
        return t

    grads = p.run(prepared(grad_output), prepared(input), prepared(weight), need_input,  # type: ignore[arg-type]
                  need_weight)
    gi, gw = (None if g is None else p.restore(g, channels_last) for g in grads)
    return gi, gw


@register
class ChannelsLastBackend(FusedBackend):
    """PyTorch's own kernels on channels-last copies of the operands (see the module docstring for when it pays)."""

    name = "channels_last"
    supports_complex = True
    bench_by_default = True

    @staticmethod
    def can_serve(spec: ConvSpec, like: torch.Tensor) -> bool:
        """Whether this backend can differ from native here: a CPU oneDNN dtype, grouped, operands not channels-last
        already (then native is the same call). A cheap rule for pruning candidates; auto still times it."""
        return (like.device.type == "cpu" and like.dtype in ONEDNN_DTYPES and spec.groups > 1
                and not is_channels_last(like))

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        return execute(plan(spec), grad_output, input, weight, need_input, need_weight)
