"""ConvSpec: the normalised hyperparameters of one convolution and all its shape maths.

This is the only package that does shape or padding arithmetic. It holds integers only and imports no torch, so
the NumPy path can use it too. Its modules, each importing only those above it:

* ``arguments``: torch's int-or-tuple arguments normalised to per-dim tuples, with every argument check;
* ``formulation``: the per-dim arithmetic of the backward's formulations (polyphase taps, sub-pixel, blocks,
  stride phases and the one asymmetric-pad split ``pad_split``);
* ``chunks``: chunk sizing (equal chunks, consecutive ranges) and the byte budgets;
* ``geometry``: ``ConvSpec``, the forward geometry, the derived specs, the pads and phases of the backward.

What one backend alone needs (its transform sizes, its chunks, an estimate of a kernel's scratch memory) lives in
that backend's package, as functions over ``ConvSpec``; nothing here names a backend.

Geometry. Every convolution, forward or transposed, is described through the *forward geometry*: a big side
``x`` (extent ``i`` per dim) read by a kernel of extent ``k`` with stride ``s`` and dilation ``d`` after padding
``(p_lo, p_hi)``, and a small side ``y`` (extent ``o``) where

    y[j] = sum_t x_pad[j*s + t*d] * w[t],   j = 0 .. o-1.

A forward conv maps x -> y (x is its input). A transposed conv is the adjoint, y -> x (y is its input, x its
output). The leftover

    r = i + p_lo + p_hi - d(k-1) - 1 - (o-1)s  >= 0

counts the trailing rows of ``x_pad`` that no output reads. For a forward conv ``r < s``; for a transposed conv
``r`` equals ``output_padding`` (which may reach ``s`` or more when ``d > s``). The derivations are in the docs'
"Derivation" page.
"""

from __future__ import annotations

from convgrad.spec.arguments import IntOrTuple as IntOrTuple
from convgrad.spec.arguments import PaddingArg as PaddingArg
from convgrad.spec.arguments import Pair as Pair
from convgrad.spec.arguments import Shape as Shape
from convgrad.spec.arguments import check_bias_sizes, check_output_mask, same_padding
from convgrad.spec.arguments import ntuple as ntuple
from convgrad.spec.formulation import PadSplit as PadSplit
from convgrad.spec.formulation import PhaseTaps, tap_rows
from convgrad.spec.formulation import output_rows as output_rows
from convgrad.spec.formulation import pad_split as pad_split
from convgrad.spec.formulation import pad_then_crop as pad_then_crop
from convgrad.spec.formulation import pad_to_rows as pad_to_rows
from convgrad.spec.formulation import padded_sizes as padded_sizes
from convgrad.spec.formulation import phase_data_rows as phase_data_rows
from convgrad.spec.formulation import phase_taps as phase_taps
from convgrad.spec.formulation import strided_crop as strided_crop
from convgrad.spec.geometry import ConvSpec

# The public API (tests/api_snapshot.json); the names imported ``as`` themselves above are importable too.
__all__ = ["ConvSpec", "PhaseTaps", "check_bias_sizes", "check_output_mask", "same_padding", "tap_rows"]

