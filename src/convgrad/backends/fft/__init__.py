"""The fft backend: the convolution theorem, a correlation as one product per frequency bin.

Contractions, per group and per frequency bin f (x: the big side, split into its P live stride phases and
those folded into channels, B = (C_x/g) P; y: the small side, A = C_y/g; X, Y, W are N-d transforms of
length L per dim, ~T(f) = T(-f) the transform of the reversed sequence, conj(T(f)) for real data):
    y from x    Y[n, a]  = sum_b X[n, b] ~W[a, b]     [n, b] [b, a] -> [n, a]   (forward conv; transposed grad_input)
    x from y    X'[n, b] = sum_a Y[n, a] W[a, b]      [n, a] [a, b] -> [n, b]   (grad_input; transposed forward)
    w from x, y W'[a, b] = sum_n ~Y[n, a] X[n, b]     [a, n] [n, b] -> [a, b]   (grad_weight)
Groups are a batch dim of the per-bin matmul (or of a broadcast product when A*B is small), never a loop.

Stride and dilation by a polyphase split (``sizing.phases``): tap t reads x_pad[j*s + t*d], row j + q
of phase phi, with t*d = s*q + phi. Each live phase is read by a stride-1 correlation; the phases become
channels of x, each tap a slot (phase, q) of the kernel, so the sum over phases is part of the per-bin
contraction. No output is computed in full and then subsampled. Transform lengths are 5-smooth, even in the
last dim (a real transform of odd length costs twice as much per point), and only as long as the circular
correlation needs to wrap zeros onto zeros: U rows of a phase less the fewer of its leading and trailing padding
rows (``sizing.fft_phase``; the docs' "Derivation" page).

A gradient is a plan (``plan``: shapes only, the steps ``explain`` shows) run by ``execute``. Work is chunked
over groups and samples (``chunking.chunks``) so that one chunk's spectra hold about ``chunking.chunk_budget``
reals (a quarter of the layer's x and y, the smaller of them on depthwise layers), and a dense layer's kernel spectra
a slice of rows at a time (``chunking.kernel_rows``: no more than one chunk's budget). Every op is
differentiable (pad, index_select, rfftn, products, irfftn, slicing), so gradients of any order come from autograd.
Half precision is computed in float32.

The package: ``sizing`` and ``chunking`` (integers only, no torch: the transform geometry over a ``ConvSpec`` and the
chunks), ``program`` (a plan as data: steps, loops, their text and code), ``plans`` (shapes only: each result's
steps and loops, the fused backward's too), ``ops`` (each step's operation on tensors and the sentence it is),
``transforms`` (the transforms, phases and per-bin products the ops call), ``execute`` (the one interpreter),
``cost`` (auto's cost model and check's error bound), and here the registered backend.
"""

from __future__ import annotations

import torch

from convgrad.backends import Backend, register
from convgrad.backends.fft.cost import BOUND_UNITS, MIN_TAPS, estimate_flops, normwise_bound, worth_trying
from convgrad.backends.fft.execute import execute, execute_backward
from convgrad.backends.fft.plans import backward_plan, plan, shares_spectra
from convgrad.backends.fft.program import FftPlan, FftStep
from convgrad.backends.planning import planned
from convgrad.spec import ConvSpec

__all__ = ["BOUND_UNITS", "MIN_TAPS", "FftBackend", "FftPlan", "FftStep", "backward_plan", "estimate_flops", "execute",
           "execute_backward", "normwise_bound", "plan", "shares_spectra", "worth_trying"]


@register
class FftBackend(Backend):
    """Both gradients (and the forward) by the convolution theorem: pad, transform, per-bin product, inverse, crop.

    Serves every configuration: 1d/2d/3d, transposed with output_padding, groups, dilation, stride (polyphase),
    per-side padding, real and complex dtypes (half precision computed in float32). Fast where the kernel is
    large and the channels per group few (``worth_trying``); auto tries it only there.

    Examples:
        >>> import torch, convgrad as cg
        >>> x, w = torch.randn(2, 8, 40, 40, dtype=torch.float64), torch.randn(8, 1, 15, 15, dtype=torch.float64)
        >>> gy = torch.randn(2, 8, 40, 40, dtype=torch.float64)
        >>> ours = cg.conv_backward(gy, x, w, padding=7, groups=8, backend="fft")
        >>> ref = cg.conv_backward(gy, x, w, padding=7, groups=8, backend="native")
        >>> all(torch.allclose(a, b, atol=1e-10) for a, b in zip(ours, ref))
        True
    """

    name = "fft"
    supports_complex = True

    @staticmethod
    def can_serve(spec: ConvSpec, like: torch.Tensor) -> bool:
        """auto's rule: take part only where the cost model says fft can win (``worth_trying``)."""
        return worth_trying(spec)

    def input_grad(self, spec: ConvSpec, weight: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        # torch's complex convention: the gradient pairs grad_output with conj(weight) (a no-op for real dtypes)
        return execute(planned(plan, spec, "grad_input"), grad_output, weight.conj())

    def weight_grad(self, spec: ConvSpec, input: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
        input = input.conj()  # torch's complex convention, as in input_grad
        x, y = (grad_output, input) if spec.transposed else (input, grad_output)
        return execute(planned(plan, spec, "grad_weight"), x, y)

    def backward(self, spec: ConvSpec, grad_output: torch.Tensor, input: torch.Tensor | None,
                 weight: torch.Tensor | None, need_input: bool, need_weight: bool
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Both gradients in one pass, grad_output transformed once per chunk (``execute_backward``), where both are
        asked for and the plans share their chunks (``shares_spectra``: not a dense layer sliced by kernel rows);
        else each gradient alone."""
        if need_input and need_weight and input is not None and weight is not None:
            pi, pw = planned(plan, spec, "grad_input"), planned(plan, spec, "grad_weight")
            if shares_spectra(pi, pw):  # torch's complex convention: conj(weight) for gi, conj(input) for gw
                return execute_backward(pi, pw, grad_output, input.conj(), weight.conj())
        return super().backward(spec, grad_output, input, weight, need_input, need_weight)

    def forward(self, spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The convolution itself (no bias): ``spec.output_shape``."""
        return execute(planned(plan, spec, "output"), input, weight)
