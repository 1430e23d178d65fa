"""The chunked backend: PyTorch's own backward kernels on chunks of the batch, a few samples at a time.

Contraction: native's (``aten.convolution_backward``, see native.py), over chunks [a, b) of the batch:
    grad_input[a:b]  = native grad_input of (grad_output[a:b], weight)       the chunks concatenated
    grad_weight      = sum over chunks of native grad_weight of (input[a:b], grad_output[a:b])

Why: on the CPU, oneDNN's backward kernels slow down when one call's activations are large: its blocking
keeps a whole batch's rows in flight, and they no longer fit in the caches. Cut into chunks of a few MiB,
the same kernels run at their speed. Measured with ``torch.utils.benchmark`` (2 threads, float32, batch 32,
a 2-core AMD EPYC VM, torch 2.13 with oneDNN 3.12), native on the whole batch against chunks of 8 samples:
ResNet's 64-channel 3x3 at 32x32, grad_weight 14.8 against 8.0 ms and grad_input 17.4 against 8.5 ms; its
64->128 3x3 with stride 2 at 32x32, grad_input 18.2 against 5.3 ms. Where the activations are small it
loses (512 channels at 4x4: grad_weight 18.2 against 36.2 ms in chunks of 8), so it is offered only
where a chunk of ``CHUNK_BYTES`` splits the batch, and ``auto`` times it against native on the calls that
follow (``benchmarks/step_profile.py`` shows how a layer's time inside a training step differs from its
time alone).

A chunk holds as many samples as keep its input and grad_output within ``CHUNK_BYTES`` (4 MiB: chunks
of 8 for the 64-channel 32x32 layer, 16 at 16x16, the whole batch of 32 at 8x8, as measured best above),
at least one, the batch split into equal chunks. ``plan(spec, itemsize)`` lists the steps (each has
``describe()``); ``execute`` runs them. Every step is a torch op (slices, the native backward, a
concatenation, a sum), so gradients of any order and torch.func transforms work as they do for native.
float16 and bfloat16 sum the chunks' grad_weight in float32, as native's kernel sums the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from convgrad.backends import FusedBackend, Grads, get_backend, register
from convgrad.spec import ConvSpec
from convgrad.spec.chunks import CHUNK_BYTES, equal_chunk  # CHUNK_BYTES: a chunk's input and grad_output

__all__ = ["CHUNK_BYTES", "ChunkPlan", "ChunkedBackend", "chunk_size", "execute", "plan"]


def chunk_size(spec: ConvSpec, itemsize: int, limit: int | None = None) -> int:
    """Samples per chunk: as many as keep a chunk's input and grad_output within ``limit`` (default
    ``CHUNK_BYTES``) bytes, at least 1, the batch split into equal chunks (the last may be smaller).

    Args:
        spec: the convolution (batched).
        itemsize: bytes per element (4 for float32).
        limit: the byte budget of one chunk; None reads ``CHUNK_BYTES`` at the call.

    Returns:
        ``1 <= size <= max(N, 1)``; ``N`` itself when the whole batch fits.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> chunk_size(ConvSpec.from_shapes((32, 64, 32, 32), (64, 64, 3, 3), padding=1), 4)
        8
        >>> chunk_size(ConvSpec.from_shapes((32, 256, 8, 8), (256, 256, 3, 3), padding=1), 4)
        32
    """
    limit = CHUNK_BYTES if limit is None else limit
    per_sample = (math.prod(spec.input_shape[1:]) + math.prod(spec.output_shape[1:])) * itemsize
    batch = max(spec.batch, 1)
    return equal_chunk(batch, max(1, limit // max(per_sample, 1)))


@dataclass(frozen=True)
class NativeOnChunks:
    """aten.convolution_backward on samples [a, a + chunk) for each a, with the spec of that many samples."""

    spec: ConvSpec
    chunk: int

    def __call__(self, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
                 need_input: bool, need_weight: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        native, gis, gws = get_backend("native"), [], []
        for a in range(0, self.spec.batch, self.chunk):
            part = slice(a, a + self.chunk)
            sub = self.spec.with_batch(min(self.chunk, self.spec.batch - a))
            gi, gw = native.backward(sub, grad_output[part], None if input is None else input[part], weight,
                                     need_input, need_weight)
            gis += [] if gi is None else [gi]  # (chunk, C_in, *i)
            gws += [] if gw is None else [gw]  # (*weight_shape)
        return gis, gws

    def describe(self) -> str:
        count = -(-self.spec.batch // self.chunk)
        return f"aten.convolution_backward on {count} chunks of at most {self.chunk} samples"


@dataclass(frozen=True)
class ChunkPlan:
    """The steps for one convolution: the native backward per chunk, then grad_input joined, grad_weight summed."""

    spec: ConvSpec
    run: NativeOnChunks

    def describe(self) -> str:
        steps = (self.run.describe(), "grad_input: the chunks' grad_input concatenated along the batch",
                 "grad_weight: the sum of the chunks' grad_weight")
        return "\n".join(f"{i}. {step}" for i, step in enumerate(steps, 1))


def plan(spec: ConvSpec, itemsize: int = 4, chunk: int | None = None) -> ChunkPlan:
    """The chunked plan of a convolution.

    Args:
        spec: the convolution (batched), as ``ConvSpec.from_shapes`` builds it.
        itemsize: bytes per element of its tensors (default 4, float32).
        chunk: samples per chunk; default ``chunk_size(spec, itemsize)``.

    Returns:
        A ``ChunkPlan`` whose ``describe()`` lists the steps and which ``execute`` runs.

    Examples:
        >>> from convgrad.spec import ConvSpec
        >>> print(plan(ConvSpec.from_shapes((32, 64, 32, 32), (128, 64, 3, 3), 2, 1)).describe())
        1. aten.convolution_backward on 4 chunks of at most 8 samples
        2. grad_input: the chunks' grad_input concatenated along the batch
        3. grad_weight: the sum of the chunks' grad_weight
    """
    return ChunkPlan(spec, NativeOnChunks(spec, chunk_size(spec, itemsize) if chunk is None else chunk))


def execute(p: ChunkPlan, grad_output: torch.Tensor, input: torch.Tensor | None, weight: torch.Tensor | None,
            need_input: bool, need_weight: bool) -> Grads:
    """Run a plan: both gradients (None where not needed)."""
    if p.run.chunk >= p.spec.batch:  # one chunk (an empty batch too): native itself
        return get_backend("native").backward(p.spec, grad_output, input, weight, need_input, need_weight)
    gis, gws = p.run(grad_output, input, weight, need_input, need_weight)
    gi = torch.cat(gis) if need_input else None  # (N, C_in, *i)
    gw = None
    if gws:
        # half precision sums the chunks in float32, as native's kernel sums the batch: a bfloat16 running sum
        # stalls at 256 chunks' worth (the docs' "Numerics" page, "Half precision")
        low = gws[0].dtype in (torch.float16, torch.bfloat16)
        for g in gws:
            g = g.float() if low else g
            gw = g if gw is None else gw + g  # (*weight_shape)
        gw = gw.to(gws[0].dtype) if low else gw  # type: ignore[union-attr]
    return gi, gw


@register
class ChunkedBackend(FusedBackend):
    """PyTorch's kernels on chunks of the batch of at most CHUNK_BYTES (see the module docstring)."""

    name = "chunked"
    supports_complex = True
    bench_by_default = True

    @staticmethod
    def can_serve(spec: ConvSpec, like: torch.Tensor) -> bool:
        """Whether this backend can differ from native here: on the CPU, where a chunk of CHUNK_BYTES splits the
        batch. A cheap rule; auto still times it."""
        return like.device.type == "cpu" and chunk_size(spec, like.element_size()) < spec.batch

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool) -> Grads:
        return execute(plan(spec, grad_output.element_size()), grad_output, input, weight, need_input, need_weight)
