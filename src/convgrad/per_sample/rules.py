"""Per-sample rules of PerSampleGrads: one class per layer function, registered on the torch function it serves.

A rule is built from one captured call (``convgrad.per_sample.capture``): the function's own arguments, the call's
input x, its grad_output gy, and ``scale`` (N for loss_reduction="mean", each sample's own loss gradient; 1 for
"sum"). It gives the per-sample gradients of the call's weight and bias *operands*; the capture pulls them back to
the parameters the operands were computed from. Every rule has the same methods (``Layer``), so a new layer
function is a new registered class, not an ``isinstance`` chain.

Contractions per sample n (P: positions, the dims between batch and features):
    conv        see convgrad.per_sample.methods (forward geometry, per group)
    linear      gw[n] [out, in] = gy[n]ᵀ [out, P] · x[n] [P, in];    gb[n] = Σ_P gy[n]
    group_norm  gγ[n] [C] = Σ_space gy[n] ⊙ x̂[n];                    gβ[n] = Σ_space gy[n]
    layer_norm  gγ[n] [*D] = Σ_P gy[n] ⊙ x̂[n];                       gβ[n] = Σ_P gy[n]
    rms_norm    gγ[n] [*D] = Σ_P gy[n] ⊙ x̂[n]
    batch_norm  gγ[n] [C] = Σ_space gy[n] ⊙ x̂[n];                    gβ[n] = Σ_space gy[n]   (running statistics
                only: x̂ = (x - running_mean) / sqrt(running_var + eps) treats each sample alone)
    embedding   gw[n] [V, D] = Σ_P onehot(idx[n, p]) ⊗ gy[n, p]
                ghost: |gw[n]|² = Σ_{p,q} [idx_p = idx_q]·⟨gy_p, gy_q⟩ (P² terms)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from convgrad.functional import conv_bias_grad, conv_transpose_weight_grad, conv_weight_grad
from convgrad.per_sample import methods, tuning
from convgrad.per_sample.functional import per_sample_bias_grad
from convgrad.spec import ConvSpec
from convgrad.tensor_ops import pad

__all__ = ["FUNCTIONS", "ConvLayer", "Layer"]

Grads = dict[str, torch.Tensor]
# Below this many positions per sample, a conv's summed weight gradient is one more weight-gradient call rather than
# the sum of its N materialised per-sample gradients, whose read then costs more (batch 32, 2 threads, kept memory,
# ms, sum(0) / one native call): 512 channels at 2x2 16.1 / 3.8, at 4x4 10.3 / 7.9; 256 at 8x8 2.8 / 7.8.
SUM_BY_CALL_POSITIONS = 32
# Clipping may keep a layer's per-sample gradients (then one weighted sum) instead of its input and grad_output (then
# one more weight-gradient pass) where they take at most STORE_GROWTH times the memory of that state, so a layer
# grows its kept memory by at most one state's worth. At 1.0, U-Net's 128->64 and 64->64 convs at 16x16 (1.5 and
# 1.1 times their state) took the extra pass; per_sample.py --quantities c --contenders plain convgrad --repeats 7
# measured U-Net's clipped step 1.53x plain at 1.0 and 1.30x at 2.0, the other models unchanged within their IQR.
STORE_GROWTH = 2.0
# ... or where they take at most STORE_FLOOR_BYTES in all, however that compares with the state: a few MiB is no
# memory risk, and the extra pass costs more than the weighted sum (the small CNN's 64->64 conv at 8x8, batch 32:
# 4.5 MiB, 4.5x its state; ghost + pass 17.9 ms against 12.0 ms stored, in per_sample.py --models small_cnn).
STORE_FLOOR_BYTES = 8 * 2**20
# Samples per chunk when a normalisation's x̂ is recomputed: gy ⊙ x̂ of a whole batch is two temporaries the size of
# the input, 16 MiB at WRN-16-4's 64x32x32 GroupNorm (batch 32), live while the backward still holds that stage's
# activations; in chunks of this many elements they stay under 2 x 1 MiB.
NORM_CHUNK_ELEMENTS = 1 << 18


class Layer:
    """One captured call of a layer function, for the per-sample gradients of its weight and bias operands.

    Args:
        x: the call's input, batch first ``(N, ...)``.
        gy: its grad_output ``(N, ...)``.
        scale: N for a mean loss, 1 for a sum.
        shapes: {operand: shape} of the operands whose per-sample gradients are wanted ("weight", "bias").
    """

    ghost_cheaper = False  # a ghost norm costs fewer MACs than materialising
    INPUT: ClassVar[str] = "input"  # the argument that carries the samples
    OPERANDS: ClassVar[tuple[str, ...]] = ("weight", "bias")  # the arguments a trainable parameter may reach
    SIGNATURE: ClassVar[tuple[tuple[str, ...], tuple[Any, ...]]] = ((), ())  # torch's parameter names, defaults

    def __init__(self, x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size]) -> None:
        self.x, self.gy, self.scale, self.shapes = x, gy, scale, shapes

    @classmethod
    def from_call(cls, args: dict[str, Any], x: torch.Tensor, gy: torch.Tensor, scale: float,
                  shapes: dict[str, torch.Size]) -> Layer:
        """The rule of one call from its bound arguments (``SIGNATURE``); the base takes no hyperparameter."""
        return cls(x, gy, scale, shapes)

    @classmethod
    def refusal(cls, args: dict[str, Any]) -> str | None:
        """Why this call cannot have per-sample gradients (it mixes the samples, ...), or None."""
        return None

    @property
    def state_elements(self) -> int:
        """Elements kept to compute the gradients later (the captured input and grad_output)."""
        return self.x.numel() + self.gy.numel()

    @property
    def may_store(self) -> bool:
        """Whether clipping may keep this layer's per-sample gradients instead of its state (``STORE_GROWTH``,
        ``STORE_FLOOR_BYTES``)."""
        small = self.grad_elements * self.gy.element_size() <= STORE_FLOOR_BYTES
        return small or self.grad_elements <= STORE_GROWTH * self.state_elements

    @property
    def grad_elements(self) -> int:
        """Elements of the materialised per-sample gradients."""
        return self.x.shape[0] * sum(math.prod(s) for s in self.shapes.values())

    def grads(self) -> Grads:
        """Per-sample gradients {operand: (N, *operand.shape)}."""
        raise NotImplementedError

    def ghost_sq_norms(self) -> torch.Tensor:
        """(N,) squared norms without forming the gradients; only rules with ghost_cheaper possible define it."""
        raise NotImplementedError

    def materialised_sq_norms(self) -> torch.Tensor:
        """(N,) squared norms; rules with big gradients override this to work chunk by chunk."""
        return sum(methods.sq_norms(g) for g in self.grads().values())  # type: ignore[return-value]

    def clip_plan(self) -> tuple[str, bool]:
        """How norms_only clips this layer: ("ghost" or "materialise", whether to keep the per-sample gradients for
        a weighted sum instead of the state for one more gradient pass); kept only where ``may_store``."""
        if self.ghost_cheaper:
            return "ghost", False
        return "materialise", self.may_store

    def clipped(self, factors: torch.Tensor) -> Grads:
        """{operand: Σ_n factors[n]·grad[n]}, by default from the materialised gradients."""
        return {k: (g * factors.to(g.dtype).view(-1, *(1,) * (g.dim() - 1))).sum(0) for k, g in self.grads().items()}

    def summed(self, grads: Grads) -> Grads:
        """{operand: the gradient autograd would give} (the per-sample gradients summed, over ``scale``)."""
        return {k: g.sum(0).div_(self.scale) for k, g in grads.items()}

    def _scaled_gy(self, factors: torch.Tensor) -> torch.Tensor:
        f = (factors * self.scale).to(self.gy.dtype)  # factors come in norm_dtype (float32 for half precision)
        return self.gy * f.view(-1, *(1,) * (self.gy.dim() - 1))  # (N, ...)


# torch function -> its rule (conv is captured apart, through convgrad.reach's ConvCall)
FUNCTIONS: dict[Callable[..., Any], type[Layer]] = {}


def register(*functions: Callable[..., Any]) -> Callable[[type[Layer]], type[Layer]]:
    def deco(cls: type[Layer]) -> type[Layer]:
        FUNCTIONS.update(dict.fromkeys(functions, cls))
        return cls
    return deco


class ConvLayer(Layer):
    """conv1d/2d/3d and conv_transpose1d/2d/3d: any padding, groups, dilation, output_padding.

    Args:
        spec: the call's geometry (batched).
        x, gy, scale: as ``Layer``; x the input as the convolution read it (already padded by a padding mode).
        weight_shape: the weight operand's shape.
        shapes: as ``Layer``.
    """

    def __init__(self, spec: ConvSpec, x: torch.Tensor, gy: torch.Tensor, scale: float,
                 weight_shape: torch.Size, shapes: dict[str, torch.Size]) -> None:
        super().__init__(x, gy, scale, shapes)
        self.spec, self.weight_shape = spec, weight_shape
        self.sides = (gy, x) if spec.transposed else (x, gy)
        self.has_bias, self.has_weight = "bias" in shapes, "weight" in shapes
        self._materialise: str | None = None  # set by clip_plan: the method its plan materialises with

    @classmethod
    def for_module(cls, module: nn.Module, input: torch.Tensor, grad_output: torch.Tensor,
                   scale: float) -> ConvLayer:
        """The rule of one call of a torch.nn conv module (Opacus's grad samplers): any padding string or
        padding_mode, ``output_size=``, unbatched input."""
        m: nn.modules.conv._ConvNd = module  # type: ignore[assignment]
        nd = len(m.kernel_size)
        if input.dim() == nd + 1:  # unbatched: one sample, whose "mean" loss is its own (scale 1, not C_in)
            input, grad_output, scale = input.unsqueeze(0), grad_output.unsqueeze(0), 1.0  # (1, C, *spatial)
        fn = f"PerSampleGrads({type(m).__name__})"
        w = tuple(m.weight.shape)
        if m.transposed:
            spec = ConvSpec.from_shapes(input.shape, w, m.stride, m.padding, m.dilation, True, m.output_padding,
                                        m.groups, fn=fn)
            if spec.output_shape != tuple(grad_output.shape):  # forward(input, output_size=...) was used
                spec = spec.fit_output_size(grad_output.shape[2:])
        else:
            spec = ConvSpec.from_shapes(input.shape, w, m.stride, m.padding, m.dilation, groups=m.groups, fn=fn)
            if m.padding_mode != "zeros":  # torch pads the input with the mode, then convolves unpadded
                input = pad(input, spec.padding, mode=m.padding_mode)  # (N, C_in, *(i+lo+hi))
                spec = ConvSpec.from_shapes(input.shape, w, m.stride, 0, m.dilation, groups=m.groups, fn=fn)
        shapes = {k: p.shape for k, p in m.named_parameters(recurse=False) if p.requires_grad}
        return cls(spec, input, grad_output, scale, m.weight.shape, shapes)

    @property
    def ghost_cheaper(self) -> bool:  # type: ignore[override]
        """Whether the ghost norm is this layer's fastest way to its norms (measured, ``per_sample.tuning``)."""
        return tuning.method_for(self.spec, *self.sides, "norms") == "ghost"

    def clip_plan(self) -> tuple[str, bool]:
        """The clipping plan measured for this layer (``per_sample.tuning``, purpose "clip"); storing the per-sample
        gradients is allowed only where ``may_store`` (at most STORE_GROWTH times the state kept otherwise)."""
        method, _, kept = tuning.method_for(self.spec, *self.sides, "clip", self.may_store).partition("+")
        if method != "ghost":
            self._materialise = method
        return method, bool(kept)

    def _method(self) -> str:
        """The method that materialises this layer's per-sample gradients."""
        return self._materialise or tuning.method_for(self.spec, *self.sides, "grads")

    def _bias(self) -> Grads:
        return {"bias": per_sample_bias_grad(self.gy) * self.scale} if self.has_bias else {}

    def grads(self) -> Grads:
        out = self._bias()
        if self.has_weight:
            gw = methods.weight_grad(self.spec, *self.sides, self._method())
            out["weight"] = gw.mul_(self.scale) if self.scale != 1 else gw
        return out

    def param_sq_norms(self, ghost: bool | None = None) -> Grads:
        """{operand: (N,) squared norm of its per-sample gradient} (Opacus keeps one norm per parameter): the
        weight's by the ghost norm (ghost=True), chunk by chunk from materialised gradients (False), or by
        whichever ``ghost_cheaper`` picks (None, the default)."""
        out = {}
        if self.has_weight:
            if self.ghost_cheaper if ghost is None else ghost:
                sq = methods.ghost_sq_norms(self.spec, *self.sides)
            else:
                sq = methods.materialised_sq_norms(self.spec, *self.sides, self._method())
            out["weight"] = sq * self.scale**2
        if self.has_bias:
            out["bias"] = methods.sq_norms(self._bias()["bias"])
        return out

    def _sq(self, ghost: bool) -> torch.Tensor:
        parts = list(self.param_sq_norms(ghost).values())
        return sum(parts[1:], parts[0]) if parts else self.x.new_zeros(self.spec.batch,
                                                                        dtype=methods.norm_dtype(self.x.dtype))

    def ghost_sq_norms(self) -> torch.Tensor:
        return self._sq(ghost=True)

    def materialised_sq_norms(self) -> torch.Tensor:
        return self._sq(ghost=False)

    def clipped(self, factors: torch.Tensor) -> Grads:
        """With one ordinary (batch-summed) weight-gradient call on the per-sample-scaled grad_output."""
        gy = self._scaled_gy(factors)  # (N, C_out, *out)
        out = {"bias": conv_bias_grad(gy)} if self.has_bias else {}
        if self.has_weight:
            out["weight"] = self._weight_grad(gy)
        return out

    def summed(self, grads: Grads) -> Grads:
        """As ``Layer.summed``, but on few positions the weight's by one weight-gradient call: there summing N
        materialised gradients reads more memory than the call multiplies (``SUM_BY_CALL_POSITIONS``)."""
        if not (self.has_weight and "weight" in grads and self.spec.positions < SUM_BY_CALL_POSITIONS):
            return super().summed(grads)
        rest = super().summed({k: g for k, g in grads.items() if k != "weight"})
        return {**rest, "weight": self._weight_grad(self.gy)}

    def _weight_grad(self, gy: torch.Tensor) -> torch.Tensor:
        s, w = self.spec, self.weight_shape
        if s.transposed:
            return conv_transpose_weight_grad(self.x, w, gy, s.stride, s.padding, s.output_padding, s.groups,
                                              s.dilation)
        return conv_weight_grad(self.x, w, gy, s.stride, s.padding, s.dilation, s.groups)


@register(F.linear)
class LinearLayer(Layer):
    """linear on (N, *, in): the dims between batch and features are positions P."""

    SIGNATURE = (("input", "weight", "bias"), (None,))

    def __init__(self, x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size]) -> None:
        if x.dim() == 1:  # unbatched: one sample, whose "mean" loss is its own (scale 1, not in_features)
            x, gy, scale = x.unsqueeze(0), gy.unsqueeze(0), 1.0  # (1, in), (1, out)
        super().__init__(x, gy, scale, shapes)
        n, d_in, d_out = x.shape[0], x.shape[-1], gy.shape[-1]
        p = math.prod(x.shape[1:-1])  # not -1 in the reshapes: batch 0 leaves it undetermined
        self.x3 = x.reshape(n, p, d_in)  # (N, P, in)
        self.gy3 = gy.reshape(n, p, d_out)  # (N, P, out)
        self.ghost_cheaper = p * (d_in + d_out) < d_in * d_out
        self.has_bias, self.has_weight = "bias" in shapes, "weight" in shapes

    def grads(self) -> Grads:
        out = {"bias": self.gy3.sum(1) * self.scale} if self.has_bias else {}  # (N, out)
        if self.has_weight:
            out["weight"] = torch.bmm(self.gy3.transpose(1, 2), self.x3).mul_(self.scale)  # (N, out, in)
        return out

    def ghost_sq_norms(self) -> torch.Tensor:
        acc = methods.norm_dtype(self.x3.dtype)  # half precision: Gram entries and squares overflow float16
        x3, gy3 = self.x3.to(acc), self.gy3.to(acc)  # (N, P, in), (N, P, out)
        if x3.shape[1] == 1:  # |gy xᵀ|² = |gy|²|x|²
            sq = x3.square().sum((1, 2)) * gy3.square().sum((1, 2))
        else:
            sq = torch.linalg.vecdot((x3 @ x3.transpose(1, 2)).flatten(1),
                                     (gy3 @ gy3.transpose(1, 2)).flatten(1))  # <(N,P,P), (N,P,P)>
        sq = sq * self.scale**2 if self.has_weight else torch.zeros_like(sq)
        return sq + (gy3.sum(1) * self.scale).square().sum(1) if self.has_bias else sq

    def clipped(self, factors: torch.Tensor) -> Grads:
        gy = self._scaled_gy(factors).reshape(-1, self.gy.shape[-1])  # (N·P, out)
        out = {"bias": gy.sum(0)} if self.has_bias else {}
        if self.has_weight:
            out["weight"] = gy.T @ self.x.reshape(-1, self.x.shape[-1])  # (out, in)
        return out


class _NormLayer(Layer):
    """Affine parameters of a normalisation over each sample alone: x̂ is recomputed from the input, a chunk of
    samples at a time (``NORM_CHUNK_ELEMENTS``). ``hyper`` holds the function's own arguments."""

    def __init__(self, x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size],
                 hyper: dict[str, Any]) -> None:
        super().__init__(x, gy, scale, shapes)
        self.hyper = hyper

    @classmethod
    def from_call(cls, args: dict[str, Any], x: torch.Tensor, gy: torch.Tensor, scale: float,
                  shapes: dict[str, torch.Size]) -> Layer:
        hyper = {k: v for k, v in args.items() if k not in (cls.INPUT, *cls.OPERANDS)}
        return cls(x, gy, scale, shapes, hyper)

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        """x̂ of x, some of the samples of ``self.x``."""
        raise NotImplementedError

    def _sum_dims(self) -> list[int]:
        """The dims of x the parameters do not cover (summed over): channels at dim 1, the rest."""
        return list(range(2, self.x.dim()))

    def grads(self) -> Grads:
        dims = self._sum_dims()

        def total(t: torch.Tensor) -> torch.Tensor:  # an empty dim list would make sum() reduce everything
            return (t.sum(dims) if dims else t) * self.scale  # (N, *param.shape)

        out = {}
        if "weight" in self.shapes:
            n = self.x.shape[0]
            parts = methods.sample_chunks(n, self.x[:1].numel(), NORM_CHUNK_ELEMENTS) if n else [slice(0, 0)]
            out["weight"] = torch.cat([total(self.gy[c] * self._normalised(self.x[c])) for c in parts])
        if "bias" in self.shapes:
            out["bias"] = total(self.gy)
        return out


@register(F.group_norm)
class GroupNormLayer(_NormLayer):
    SIGNATURE = (("input", "num_groups", "weight", "bias", "eps"), (None, None, 1e-5))

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        return F.group_norm(x, self.hyper["num_groups"], None, None, self.hyper["eps"])  # (n, C, *spatial)


@register(F.layer_norm)
class LayerNormLayer(_NormLayer):
    SIGNATURE = (("input", "normalized_shape", "weight", "bias", "eps"), (None, None, 1e-5))

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.hyper["normalized_shape"], None, None, self.hyper["eps"])  # (n, *, *D)

    def _sum_dims(self) -> list[int]:  # the normalised trailing dims are the parameters'
        shape = self.hyper["normalized_shape"]
        return list(range(1, self.x.dim() - (1 if isinstance(shape, int) else len(shape))))


@register(F.rms_norm)
class RmsNormLayer(_NormLayer):
    OPERANDS = ("weight",)
    SIGNATURE = (("input", "normalized_shape", "weight", "eps"), (None, None))

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.hyper["normalized_shape"], None, self.hyper["eps"])  # (n, *, *D)

    def _sum_dims(self) -> list[int]:  # the normalised trailing dims are the parameters'
        shape = self.hyper["normalized_shape"]
        return list(range(1, self.x.dim() - (1 if isinstance(shape, int) else len(shape))))


@register(F.batch_norm)
class BatchNormLayer(_NormLayer):
    """batch_norm with its running statistics (eval mode): an affine map per channel, no sample depending on
    another. In training mode (or without running statistics) it normalises with the batch's own statistics,
    which mixes the samples: refused."""

    SIGNATURE = (("input", "running_mean", "running_var", "weight", "bias", "training", "momentum", "eps"),
                 (None, None, False, 0.1, 1e-5))

    @classmethod
    def refusal(cls, args: dict[str, Any]) -> str | None:
        if args["training"] or args["running_mean"] is None or args["running_var"] is None:
            mode = ("no running statistics: track_running_stats=False" if args["running_mean"] is None
                    else "training mode")
            return (f"normalises with the statistics of the batch ({mode}), which mixes the samples; call .eval() "
                    f"on the BatchNorm to use its running statistics, or replace it by GroupNorm")
        return None

    def _normalised(self, x: torch.Tensor) -> torch.Tensor:
        h = self.hyper
        return F.batch_norm(x, h["running_mean"], h["running_var"], None, None, False, 0.0, h["eps"])  # (n, C, *)


@register(F.embedding)
class EmbeddingLayer(Layer):
    """embedding: the input holds indices (N, *P); the weight (V, D) gets one row of gy per index, per sample;
    ``padding_idx``'s row none, as torch's backward."""

    OPERANDS = ("weight",)
    SIGNATURE = (("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
                 (None, None, 2.0, False, False))

    def __init__(self, x: torch.Tensor, gy: torch.Tensor, scale: float, shapes: dict[str, torch.Size],
                 padding_idx: int | None) -> None:
        super().__init__(x, gy, scale, shapes)
        n = x.shape[0]
        self.idx = x.reshape(n, math.prod(x.shape[1:]))  # (N, P): batch 0 leaves -1 undetermined
        d = gy.shape[-1]
        gy2 = gy.reshape(n, self.idx.shape[1], d)  # (N, P, D)
        if padding_idx is not None:
            gy2 = gy2.masked_fill((self.idx == padding_idx % shapes["weight"][0]).unsqueeze(-1), 0)
        self.gy3 = gy2
        self.vocab = shapes["weight"][0]
        p = self.idx.shape[1]
        self.ghost_cheaper = p * p * (d + 1) < self.vocab * d

    @classmethod
    def from_call(cls, args: dict[str, Any], x: torch.Tensor, gy: torch.Tensor, scale: float,
                  shapes: dict[str, torch.Size]) -> Layer:
        return cls(x, gy, scale, shapes, args["padding_idx"])

    @classmethod
    def refusal(cls, args: dict[str, Any]) -> str | None:
        if args["scale_grad_by_freq"]:
            return "scales each gradient by its index's frequency in the whole batch (scale_grad_by_freq=True)"
        if args["sparse"]:
            return "asks for a sparse gradient (sparse=True); per-sample gradients are dense"
        return None

    def _scatter(self, gy3: torch.Tensor) -> torch.Tensor:
        n, p, d = gy3.shape
        rows = (self.idx + torch.arange(n, device=self.idx.device).unsqueeze(1) * self.vocab).reshape(-1)  # (N·P,)
        out = gy3.new_zeros(n * self.vocab, d)  # (N·V, D)
        return out.index_add_(0, rows, gy3.reshape(n * p, d)).view(n, self.vocab, d)  # (N, V, D)

    def grads(self) -> Grads:
        return {"weight": self._scatter(self.gy3) * self.scale}

    def ghost_sq_norms(self) -> torch.Tensor:
        acc = methods.norm_dtype(self.gy3.dtype)
        g = self.gy3.to(acc)  # (N, P, D)
        same = (self.idx.unsqueeze(2) == self.idx.unsqueeze(1)).to(acc)  # (N, P, P)
        return torch.linalg.vecdot(same.flatten(1), (g @ g.transpose(1, 2)).flatten(1)) * self.scale**2

    def clipped(self, factors: torch.Tensor) -> Grads:
        f = (factors * self.scale).to(self.gy3.dtype)  # as _scaled_gy, on the masked (N, P, D) rows
        return {"weight": self._scatter(self.gy3 * f.view(-1, 1, 1)).sum(0)}
