"""The fft backend's memory (issue 28: each call's peak at most 2x native's for the same layer).

The fast tier checks the plans' arithmetic on every layer of the ``large`` bench suite: a group's kernel spectra are
held at most a chunk budget at a time, and each plan's chunks (grad_weight's fewer groups where native's peak is a
small scratch). The slow tier measures, at their real sizes, the calls that were over 2x (the torch profiler's peak
of live bytes, deterministic whatever the load): wav2vec2.posconv's forward (a group's spectra under the old
row-slicing trigger, the weight's size), wav2letter.k250s160's gradients (y's spectra of every row, and the previous
slice's spectra, held while a slice was transformed), and 3duxnet.dw7x7x7's grad_weight (5 groups of 54^3 bins a
chunk, sized by a quarter of x and y, where native's peak is a 3.4 MiB scratch; 2 a chunk now),
convnext.dw7x7's grad_weight (2 groups of 16 samples a chunk held 2.64x native's 0.69 MiB scratch; 1 group now) and
UniRepLKNet's forward, the closest to 2x of the depthwise layers' budget (``chunking.chunk_budget``: 1.68x).
``python benchmarks/large_kernels.py --memory-only`` gives the whole suite (benchmarks/results/fft_memory.md).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from convgrad.backends import fft
from convgrad.backends.fft import chunking
from convgrad.backends.native import weight_scratch
from convgrad.cli.bench.layers import select

LARGE = {layer.name: layer.spec() for layer in select("large", None)}
GRADIENTS = ("output", "grad_input", "grad_weight")


@pytest.mark.parametrize("name", sorted(LARGE))
def test_fft_holds_at_most_a_chunk_budget_of_one_groups_kernel_spectra(name: str) -> None:
    """Every plan of the large suite holds at most ``budget`` reals of a group's kernel spectra at once, or one row
    (the least it can). wav2vec2.posconv (48 x 48 channels per group, 576 bins) held all 1.33M reals of a group with a
    budget of 384k, since they fit the weight's size: its forward peaked at 3.15x native's."""
    spec = LARGE[name]
    budget = chunking.chunk_budget(spec, chunking.CHUNK_MIN_REALS)
    for gradient in GRADIENTS:
        p = fft.plan(spec, gradient)
        held = p.row_chunk * p.group_channels[2] * 2 * math.prod(p.bins(True))
        assert held <= budget or p.row_chunk == 1, (gradient, p.row_chunk, held, budget)


# per layer: (the forward's and grad_input's chunks, grad_weight's), (groups, samples); only where native's grad_weight
# scratch (native.weight_scratch) is far below the budget (3D UX-Net, ConvNeXt, UniRepLKNet) does grad_weight
# take fewer groups. The budget is the smaller of x and y on depthwise layers where x and y are alike (twice the
# groups of a quarter of both), a quarter of both on SincNet and on the grouped or dense layers (wav2vec2, HiFi-GAN,
# ResNet), CHUNK_MIN_REALS on wav2letter
CHUNKS = {"replknet.dw31": ((39, 4), (39, 4)), "slak.dw51x5": ((23, 2), (23, 2)),
          "unireplknet.dw13": ((67, 8), (35, 8)), "wav2vec2.posconv": ((1, 2), (1, 2)),
          "hyena.long1d": ((51, 2), (51, 2)), "sincnet.k251": ((1, 1), (1, 1)),
          "wav2letter.k250s160": ((1, 14), (1, 14)), "hifigan.up16s8": ((1, 1), (1, 1)),
          "3duxnet.dw7x7x7": ((10, 1), (2, 1)), "convnext.dw7x7": ((39, 16), (1, 16)),
          "resnet50.3x3@28": ((1, 3), (1, 3))}


def test_fft_chunks_of_every_large_layer() -> None:
    """The exact chunks of every plan of the large suite: grad_weight's groups are cut to what fits
    ``WEIGHT_SCRATCH_RATIO`` times native's scratch on 3D UX-Net, ConvNeXt and UniRepLKNet only; every other layer,
    and every forward and grad_input, takes the chunks of ``chunking.chunk_budget``. The previous rule (64 weights'
    elements) gave ConvNeXt 2 groups, 2.64x native's peak."""
    assert sorted(CHUNKS) == sorted(LARGE)
    got = {name: ((fft.plan(spec, "output").chunks, fft.plan(spec, "grad_input").chunks),
                  fft.plan(spec, "grad_weight").chunks) for name, spec in LARGE.items()}
    assert got == {name: ((side, side), weight) for name, (side, weight) in CHUNKS.items()}


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "large_kernels.py"
    spec = importlib.util.spec_from_file_location("large_kernels_bench", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.mark.slow
@pytest.mark.parametrize("name, call", [("wav2vec2.posconv", "forward"), ("wav2letter.k250s160", "grad_input"),
                                        ("wav2letter.k250s160", "grad_weight"), ("wav2letter.k250s160", "forward"),
                                        ("3duxnet.dw7x7x7", "grad_weight"), ("convnext.dw7x7", "grad_weight"),
                                        ("unireplknet.dw13", "forward"), ("unireplknet.dw13", "grad_weight")])
def test_fft_peak_is_at_most_twice_natives(bench: ModuleType, name: str, call: str) -> None:
    """The real layer, float32, 2 threads: fft's peak of live bytes during the call is at most 2x native's."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native, ours = bench.memory(LARGE[name], (call,))[call]
    finally:
        torch.set_num_threads(threads)
    assert ours <= 2 * native, f"{name} {call}: fft {ours / 2**20:.2f} MiB, native {native / 2**20:.2f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("name", ["convnext.dw7x7", "3duxnet.dw7x7x7", "replknet.dw31", "unireplknet.dw13"])
def test_native_weight_grad_scratch_is_at_least_the_modelled_one(bench: ModuleType, name: str) -> None:
    """grad_weight's chunk rule budgets twice ``native.weight_scratch``, a lower bound of what native's
    grad_weight holds: measured (float32, 2 threads), native's peak is at least that many reals."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        native, _ = bench.memory(LARGE[name], ("grad_weight",))["grad_weight"]
    finally:
        torch.set_num_threads(threads)
    scratch = weight_scratch(LARGE[name])
    assert native >= 4 * scratch, (name, native, scratch)
