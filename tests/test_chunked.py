"""The chunked backend with its chunks forced small: every hard case, uneven chunks, gradcheck, gradgradcheck, vmap.

Registered, it also runs the whole grid (tests/test_grid.py) and every ecosystem test, but the grid's tensors are
far below CHUNK_BYTES (one chunk: native's own call); here the batch is cut into chunks.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import convgrad as cg
from convgrad.backends import chunked
from convgrad.spec import ConvSpec
from helpers import assert_gradchecks, assert_matches_autograd, grid_cases, make_tensors, random_cases, reference_grads

BATCHED = [c for c in grid_cases() + random_cases(40, seed=98) if c.input_shape[0] > 1]


@pytest.fixture
def chunk(request: Any, monkeypatch: pytest.MonkeyPatch) -> int:
    """Cut every batch into chunks of this many samples (0: one less than the batch, so the last chunk is smaller
    where the batch has more than 2 samples)."""
    size = request.param
    monkeypatch.setattr(chunked, "chunk_size", lambda spec, itemsize, limit=None: size or max(1, spec.batch - 1))
    return size


@pytest.mark.parametrize("chunk", [1, 0], indirect=True)
@pytest.mark.parametrize("case", BATCHED, ids=str)
def test_chunks_match_autograd_float64(chunk: int, case: Any) -> None:
    t = make_tensors(case)
    gi, gw, gb = cg.conv_backward(t["grad_output"], t["input"], t["weight"], [case.spec().out_channels],
                                  transposed=case.transposed, backend="chunked",
                                  **{**case.kwargs(), "output_padding": case.output_padding})
    assert chunked.plan(case.spec()).run.chunk < case.input_shape[0]  # the chunked path ran, not native's
    assert_matches_autograd({"grad_input": gi, "grad_weight": gw, "grad_bias": gb}, reference_grads(case, t),
                            torch.float64, f"chunked {chunk} {case}")


@pytest.mark.parametrize("chunk", [2], indirect=True)
@pytest.mark.parametrize(("xs", "ws", "kw"), [
    ((3, 4, 7), (6, 2, 3), dict(stride=2, groups=2, padding=((0, 1),))),  # 3 samples: chunks of 2 and 1
    ((3, 4, 5, 4), (4, 1, 2, 3), dict(groups=4, stride=2, dilation=(2, 1), padding=1)),
    # 3d: its first derivatives run in the fast tier (the grid above), the costly gradgradcheck in the slow one
    pytest.param((3, 4, 3, 3, 4), (8, 2, 2, 2, 2), dict(groups=2, stride=(1, 2, 1), padding=((1, 0), (0, 1), (1, 1))),
                 marks=pytest.mark.slow),
], ids=str)
def test_chunks_pass_gradcheck_and_gradgradcheck(chunk: int, xs: tuple, ws: tuple, kw: dict) -> None:
    assert_gradchecks("chunked", xs, ws, kw)


@pytest.mark.parametrize("chunk", [1], indirect=True)
def test_chunks_transposed_gradcheck(chunk: int) -> None:
    assert_gradchecks("chunked", (2, 4, 3, 3), (4, 3, 3, 2), dict(stride=2, groups=2, output_padding=1),
                      transposed=True, bias=False, seed=2)


@pytest.mark.parametrize("chunk", [2], indirect=True)
def test_chunks_under_vmap_and_grad(chunk: int) -> None:
    """torch.func: per-sample weight gradients through the chunked backward (a batch of 3 inside) equal native's."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 3, 4, 6, 6, generator=g, dtype=torch.float64), torch.randn(6, 4, 3, 3, generator=g,
                                                                                  dtype=torch.float64)

    def loss(w: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
        return (cg.conv(x, w, padding=1, backend=backend) ** 2).sum()

    ours = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(w, x, "chunked")
    ref = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, None))(w, x, "native")
    torch.testing.assert_close(ours, ref)


def test_chunk_size_keeps_a_chunk_within_its_bytes_in_equal_chunks() -> None:
    def spec(batch: int, c: int, size: int) -> ConvSpec:
        return ConvSpec.from_shapes((batch, c, size, size), (c, c, 3, 3), padding=1)

    # ResNet-18's layers at batch 32, float32: a sample's input and grad_output take 2*C*H*W*4 bytes
    assert chunked.chunk_size(spec(32, 64, 32), 4) == 8  # 512 KiB a sample: 8 in 4 MiB
    assert chunked.chunk_size(spec(32, 128, 16), 4) == 16
    assert chunked.chunk_size(spec(32, 256, 8), 4) == 32  # all of it: native's own call
    assert chunked.chunk_size(spec(30, 64, 32), 4) == 8  # 4 chunks (8, 8, 8, 6), not 3 of 8 and one of 6... equal
    assert chunked.chunk_size(spec(33, 64, 32), 4) == 7  # 5 chunks of at most 7, rather than 4 of 8 and one of 1
    assert chunked.chunk_size(spec(2, 64, 512), 4) == 1  # one sample over the budget: one at a time
    assert chunked.chunk_size(spec(0, 64, 32), 4) == 1
    assert chunked.chunk_size(spec(32, 64, 32), 8) == 4  # float64: twice the bytes
    like = torch.zeros(1)
    assert chunked.ChunkedBackend.can_serve(spec(32, 64, 32), like)
    assert not chunked.ChunkedBackend.can_serve(spec(32, 256, 8), like)
    assert not chunked.ChunkedBackend.can_serve(spec(32, 64, 32), torch.zeros(1, device="meta"))


@pytest.mark.parametrize("chunk", [1], indirect=True)
@pytest.mark.parametrize(("dtype", "n"), [(torch.bfloat16, 1000), (torch.float16, 3000)])
def test_half_precision_sums_the_chunks_in_float32(chunk: int, dtype: torch.dtype, n: int) -> None:
    # n chunks of one sample, each a grad_weight of 1: a half-precision running sum of them stalls (bfloat16 at
    # 256, float16 at 2,048); native's kernel sums its batch in float32 (docs/numerics.md, "Half precision")
    x = torch.ones(n, 1, 1, 1, dtype=dtype)
    _, gw, _ = cg.conv_backward(x, x, torch.ones(1, 1, 1, 1, dtype=dtype), None, output_mask=(False, True, False),
                                backend="chunked")
    assert gw.dtype == dtype and gw.item() == n
