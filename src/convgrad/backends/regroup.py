"""The regroup backend: PyTorch's own backward kernels on the convolution with its groups merged ``m`` at a time.

Contraction, per merged group G of m groups (a = C_y/g rows, b = C_x/g columns of a group's weight, T taps):
    grad_weight [m*a, N*P] x [N*P, m*b*T] -> [m*a, m*b*T], of which the m diagonal blocks [a, b*T] are wanted
    grad_input  [N, P, m*a] x blockdiag(w)[m*a, m*b, T] -> [N, P, m*b]   (the off-diagonal blocks are zeros)
computed by ``aten.convolution_backward`` with ``groups // m`` groups. Transposed convs alike, their weight
being ``(C_in, C_out/g, *k)``.

Why: on the CPU, oneDNN's direct (jit) kernels work on blocks of 16 channels (the AVX-512 vector). For
groups of fewer channels its weight gradient falls back to im2col + GEMM (``x64:gemm:jit`` in
``ONEDNN_VERBOSE=1``), several times slower than the forward; merged into groups of 16 or more channels
it runs the jit kernel, and m times the multiply-adds cost less than the fallback. Measured (2 threads,
busy 2-core machine, paired rounds, multiples of native's forward): grad_weight of a 3d conv in 8 groups
of 8 channels, m = 2: 0.9x (native: 4-39x); of 3D ResNeXt's 32 groups of 8: 2.0x (native: 12.6x). The
merge costs m times the multiply-adds, so it is only offered for 4 to 15 channels per group (m <= 4).

``plan(spec)`` lists the steps (each has ``describe()``); ``execute`` runs them. Every step is a
differentiable torch op (a broadcast product with an identity, a diagonal), so gradients of any order
and torch.func transforms work as they do for native.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from convgrad.backends import FusedBackend, Grads, register
from convgrad.backends.native import NativeBackward
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import ONEDNN_DTYPES

__all__ = ["MAX_MERGE", "VECTOR_CHANNELS", "BlockDiagonal", "DiagonalBlocks", "RegroupBackend", "RegroupPlan",
           "execute", "merge_factor", "plan"]

VECTOR_CHANNELS = 16  # channels per group that oneDNN's direct kernels block by (AVX-512, float32)
MAX_MERGE = 4  # merging m groups costs m times the multiply-adds


def merge_factor(spec: ConvSpec) -> int:
    """The fewest groups to merge so that a merged group holds at least VECTOR_CHANNELS input and output channels
    (1: none needed, or none that divides the groups within MAX_MERGE)."""
    per_group = min(spec.x_group_channels, spec.y_group_channels)
    for m in range(1, MAX_MERGE + 1):
        if spec.groups % m == 0 and m * per_group >= VECTOR_CHANNELS:
            return m
    return 1


@dataclass(frozen=True)
class GroupMerge:
    """The layout of ``groups`` merged ``merge`` at a time: merged group G's weight (m*a, m*b, *k) holds group j of
    G in its diagonal block (j, j); the steps that go into and out of it share it."""

    groups: int
    merge: int

    def blocks(self, w: torch.Tensor, columns: int) -> torch.Tensor:
        """(g*a, columns*b, *k) -> (g/m, m, a, columns, b, *k): rows by merged group and member, columns by block."""
        g, m = self.groups, self.merge
        return w.reshape(g // m, m, w.shape[0] // g, columns, w.shape[1] // columns, *w.shape[2:])  # (g/m, m, a, ..)


@dataclass(frozen=True)
class BlockDiagonal(GroupMerge):
    """(g*a, b, *k) -> (g*a, m*b, *k): each group's weight on the diagonal of its merged group, zeros elsewhere."""

    def __call__(self, w: torch.Tensor) -> torch.Tensor:
        m = self.merge
        blocks = self.blocks(w, 1)  # (g/m, m, a, 1, b, *k)
        eye = torch.eye(m, dtype=w.dtype, device=w.device).reshape(1, m, 1, m, 1, *(1,) * (w.dim() - 2))
        return (blocks * eye).reshape(w.shape[0], m * w.shape[1], *w.shape[2:])  # (g*a, m*b, *k): j of G in (j, j)

    def describe(self) -> str:
        return (f"merge the {self.groups} groups {self.merge} at a time: each group's weight on the diagonal of "
                f"its merged group's, zeros elsewhere")


@dataclass(frozen=True)
class DiagonalBlocks(GroupMerge):
    """(g*a, m*b, *k) -> (g*a, b, *k): the diagonal blocks of the merged groups' weight gradient."""

    def __call__(self, gw: torch.Tensor) -> torch.Tensor:
        m = self.merge
        diag = self.blocks(gw, m).diagonal(dim1=1, dim2=3)  # (g/m, a, b, *k, m)
        return diag.movedim(-1, 1).reshape(gw.shape[0], gw.shape[1] // m, *gw.shape[2:])  # (g*a, b, *k)

    def describe(self) -> str:
        return f"keep the {self.merge} diagonal blocks of each merged group's weight gradient"


@dataclass(frozen=True)
class RegroupPlan:
    """The steps for one convolution: block-diagonal weight (grad_input), merged backward, diagonal blocks."""

    spec: ConvSpec
    weight: BlockDiagonal
    run: NativeBackward  # the convolution with merged groups
    blocks: DiagonalBlocks

    def describe(self) -> str:
        steps = (f"grad_input: {self.weight.describe()}", self.run.describe(),
                 f"grad_weight: {self.blocks.describe()}")
        return "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))


def plan(spec: ConvSpec, merge: int | None = None) -> RegroupPlan:
    """The regroup plan of a convolution; ``merge`` defaults to ``merge_factor(spec)``.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> print(plan(ConvSpec.from_shapes((2, 64, 8, 8, 8), (64, 8, 3, 3, 3), padding=1, groups=8)).describe())
        1. grad_input: merge the 8 groups 2 at a time: each group's weight on the diagonal of its merged group's, \
zeros elsewhere
        2. aten.convolution_backward with groups=4
        3. grad_weight: keep the 2 diagonal blocks of each merged group's weight gradient
    """
    m = merge_factor(spec) if merge is None else merge
    merged = spec.with_merged_groups(m)
    return RegroupPlan(spec, BlockDiagonal(spec.groups, m), NativeBackward(merged, f"with groups={merged.groups}"),
                       DiagonalBlocks(spec.groups, m))


def execute(p: RegroupPlan, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
            need_input: bool, need_weight: bool) -> Grads:
    """Run a plan: both gradients (None where not needed)."""
    merged = p.weight(weight) if need_input and weight is not None else None
    gi, gw = p.run(grad_output, input, merged, need_input, need_weight)
    return gi, (None if gw is None else p.blocks(gw))


@register
class RegroupBackend(FusedBackend):
    """PyTorch's kernels with the groups merged into groups of 16 channels (see the module docstring)."""

    name = "regroup"
    bench_by_default = True

    @staticmethod
    def can_serve(spec: ConvSpec, like: torch.Tensor) -> bool:
        """Whether this backend can differ from native here: a CPU oneDNN dtype and groups of fewer than 16
        channels that merging at most MAX_MERGE of them brings to 16. A cheap rule; auto still times it."""
        return like.device.type == "cpu" and like.dtype in ONEDNN_DTYPES and merge_factor(spec) > 1

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        return execute(plan(spec), grad_output, input, weight, need_input, need_weight)
