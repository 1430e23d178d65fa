"""PerSampleGrads: per-sample gradients, norms and clipped sums of every trainable parameter of a model.

It reaches the parameters through the functions a forward calls, not through module types, so a subclass with a
forward of its own, a conv called as a function, or a weight computed in the forward needs no rule of its own:

    hooks     a pre-hook and a forward hook on every module keep the stack of the modules whose forward runs (for
              the messages, and to find the module a rerun belongs to); the outermost forward runs with the capture
              mode on the stack (``convgrad.per_sample.capture``), which sees every torch function call
              (``convgrad.per_sample.session`` holds this machinery);
    capture   a layer function that a parameter reaches (conv, linear, the norms, embedding) runs on detached
              operands, and its output is tapped (``tap.Tap``); an operation where a parameter meets the samples
              outside any rule marks the innermost running module that holds the parameter for a rerun;
    backward  a layer's tap hands grad_output and its saved input to the rule (``convgrad.per_sample.rules``); the
              operands' per-sample gradients are pulled back to the parameters they were computed from (one
              vmapped backward of that transform, ``torch.autograd.grad(is_grads_batched=True)``); a rerun
              module's tap runs its forward per sample (``convgrad.per_sample.fallback``);
    results   the context keeps what its own backward computed: ``.grad_sample``, the norms, the clipped sums.

Parameters stay the very same objects throughout: nothing is swapped, so a model's parameters are its optimizer's
whatever happens inside the context.

Under DistributedDataParallel the context runs the model under ``no_sync()``, so that DDP's buckets, which fire
during the backward before any per-sample norm exists, never all-reduce an unclipped gradient;
``clip_and_accumulate`` makes one all-reduce of the clipped sums instead (as Opacus's DistributedDPOptimizer does
after its clipping).
"""

from __future__ import annotations

import contextlib
from types import TracebackType

import torch
from torch import nn

from convgrad.checks import check_module
from convgrad.errors import ConvgradTypeError, ConvgradValueError
from convgrad.per_sample import distributed
from convgrad.per_sample.session import Session

__all__ = ["PerSampleGrads"]

class PerSampleGrads:
    """Context manager: per-sample gradients (``.grad_sample``), per-sample norms and clipped sums for DP-SGD.

    Inside the ``with`` block, run the forward pass and ``loss.backward()``. Afterwards every trainable parameter
    of the model that the loss reached has ``.grad_sample`` of shape ``(N, *param.shape)``, as Opacus defines it:
    the gradient of each sample's own loss. The default ``loss_reduction="mean"`` fits a loss that is a mean over
    the batch, as PyTorch's losses and Opacus default to (``F.cross_entropy(model(x), y)``): each per-sample
    gradient is then N times its share of ``.grad``. For a summed loss (``reduction="sum"``) pass
    ``loss_reduction="sum"``; a mismatch scales every per-sample gradient and norm by N or 1/N.

    Every trainable parameter is reached however it reaches its layer. The layer functions have rules (conv1d/2d/3d
    and conv_transpose1d/2d/3d with any padding, padding mode, groups, dilation, output_size; linear; layer_norm,
    group_norm, rms_norm; batch_norm with running statistics; embedding), whoever calls them: torch.nn's modules,
    a subclass with its own forward (timm's ``StdConv2d``, ``Linear``, ``LayerNorm2d``), ``F.conv2d`` in any
    forward, convgrad's own modules and patched models. A weight computed from parameters in the forward (weight
    standardisation, a ``weight_norm`` / ``spectral_norm`` parametrization, ``w0 + B @ A``, ``gain * w``) gets its
    layer's per-sample gradient pulled back to its parameters, exactly. A parameter that meets the samples in any
    other operation (a layer-scale ``x * gamma``) gets its per-sample gradients from the forward of the innermost
    module that holds it, run again per sample (``report()`` says which parameters took which way). A module
    called several times in one forward sums its calls, like ``.grad``.

    The backward also adds to the ordinary ``.grad`` the sum of the per-sample gradients (divided by N for "mean")
    instead of a separate batch-summed weight gradient: the layers run on detached weights.

    With ``norms_only=True`` nothing is stored in ``.grad_sample`` and backward leaves the ``.grad`` of the
    parameters untouched (DP-SGD replaces it anyway): each layer keeps only its per-sample squared norms, computed
    by a ghost norm wherever that costs fewer operations (see ``convgrad.per_sample_grad_norms``), plus the smaller
    of its materialised per-sample gradients or its (input, grad_output) for clipping; then ``clip_and_accumulate``
    adds to ``.grad``. A parameter reached by several calls has their per-sample gradients summed before its norm.
    Double backward (create_graph=True) through a captured layer is refused.

    Micro-batches: ``clip_and_accumulate`` adds the clipped sum to ``.grad`` as it was before the context's
    backward, so one context and one call per micro-batch accumulate a logical batch, as Opacus's virtual steps
    do. Reset ``.grad`` (``optimizer.zero_grad()``) before each logical batch. One context holds one batch: a
    backward through a forward that its first backward did not reach (the next micro-batch) is refused, since
    its samples would land on the rows of the first batch's; a second backward through a retained graph, the
    same samples again, adds to them, like ``.grad``. Call ``clear()`` to start another batch in the same context.
    Results belong to the context: ``norms()`` of a context never entered, or one whose backward has not run, is
    an error, never another context's batch.

    DistributedDataParallel: pass the DDP module itself, ``PerSampleGrads(ddp_model)``, and run the forward inside
    the context. The context runs it under ``ddp_model.no_sync()``, so that DDP never all-reduces an unclipped
    gradient; the backward leaves ``.grad`` untouched, ``.grad_sample`` and ``norms()`` cover this rank's samples,
    and ``clip_and_accumulate`` makes one all-reduce (a sum) of the clipped sums: every rank then holds
    ``Σ_n clip(g_n)`` over the global batch. Add the noise once (the same draw on every rank, from generators
    seeded alike) and divide by the global batch size, the sum of the ranks' batch sizes.

    BatchNorm is accepted with its running statistics (eval mode: each sample is normalised alone) and its affine
    parameters get per-sample gradients. With the batch's statistics (training mode, or
    ``track_running_stats=False``) it mixes the samples of a batch, so no sample has a gradient of its own: a
    forward through it inside the context is refused, whether or not its parameters are trainable.

    Args:
        model: an ``nn.Module``, or a ``DistributedDataParallel`` wrapping one. Inputs are batch-first, batch 0
            included.
        loss_reduction: ``"mean"`` (default, as PyTorch's losses and Opacus) or ``"sum"``, how the loss combines
            the samples' losses.
        norms_only: compute norms (and clipped sums) only (default False).

    Raises:
        TypeError: model is not an nn.Module, norms_only not a bool; the model contains a DataParallel, an FSDP
            module or a DistributedDataParallel other than the model itself; the model is a DistributedDataParallel
            built with static_graph=True.
        ValueError: an unknown loss_reduction. At a forward inside the context: a batch_norm with the batch's
            statistics; an embedding with ``scale_grad_by_freq`` or ``sparse``; a module that must be rerun per
            sample whose forward draws random numbers, returns something other than one tensor, or changes its
            input in place; the forward is compiled by torch.compile; it runs inside a DistributedDataParallel
            that synchronises gradients (the model given was its inner module). During the backward: a gradient
            that reaches a parameter from outside the model's forward (a weight penalty in the loss); a layer
            called on another number of samples than the first one (part of the batch, or the batch folded into
            another dim); a backward of another batch (see Micro-batches).

    Source: the docs' "Per-sample gradients and DP-SGD" guide; Opacus's GradSampleModule (grad_sample's definition,
    its functorch fallback) and DistributedDPOptimizer (clipping before the all-reduce); Abadi et al., "Deep
    learning with differential privacy" (2016) for clipping.

    Examples:
        >>> import torch, convgrad as cg
        >>> model = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding="same", padding_mode="circular"),
        ...                             torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 2))
        >>> x = torch.randn(5, 1, 6, 6)
        >>> with cg.PerSampleGrads(model) as psg:  # loss_reduction="mean", as the loss below
        ...     model(x).square().sum(1).mean().backward()
        >>> model[0].weight.grad_sample.shape
        torch.Size([5, 4, 1, 3, 3])
        >>> psg.norms().shape
        torch.Size([5])
        >>> _ = psg.clip_and_accumulate(max_norm=1.0)  # .grad = (.grad before the backward) + Σ_n clipped
        >>> bool(model[2].weight.grad.norm() <= 5.0)
        True
        >>> psg.report()["0.weight"]
        'conv2d'
    """

    def __init__(self, model: nn.Module, loss_reduction: str = "mean", norms_only: bool = False) -> None:
        fn = "PerSampleGrads"
        check_module(fn, model)
        if loss_reduction not in ("sum", "mean"):
            raise ConvgradValueError(f"{fn}: loss_reduction={loss_reduction!r} must be 'sum' or 'mean'")
        if not isinstance(norms_only, bool):
            raise ConvgradTypeError(f"{fn}: norms_only={norms_only!r} must be a bool")
        distributed.refuse_wrappers(fn, model)
        self._ddp = distributed.as_ddp(model)
        self.model, self.loss_reduction, self.norms_only = model, loss_reduction, norms_only
        self._session = Session(model, loss_reduction, norms_only, self._ddp)
        self._no_sync = contextlib.ExitStack()

    # ---- context --------------------------------------------------------------------------------
    def __enter__(self) -> PerSampleGrads:
        self._session.find_params()  # requires_grad may have changed since the context was built
        self.clear()
        self._session.install()
        if self._ddp is not None:
            self._no_sync.enter_context(self._ddp.no_sync())
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._session.remove()
        self._no_sync.close()

    def clear(self) -> None:
        """Forget every per-sample result: ``.grad_sample = None`` and no norms (called on entering)."""
        self._session.forget()
        for p in self._session.params.values():
            p.grad_sample = None  # type: ignore[attr-defined]

    def report(self) -> dict[str, str]:
        """How each parameter's per-sample gradients were computed in this context's last forward.

        Returns:
            {parameter name: "conv2d", "linear", "conv2d through a transform (its weight computed from it)",
            "rerun of module 'blocks.0' (Block) per sample (mul)", several joined by "; "}, for the parameters
            that a captured forward reached.
        """
        s = self._session
        return {s.param_names[pid]: "; ".join(sorted(how)) for pid, how in s.results.how.items()}

    # ---- results --------------------------------------------------------------------------------
    def norms(self) -> torch.Tensor:
        """Per-sample L2 norms over the gradients of every parameter this context's backward reached.

        Returns:
            ``(N,)``, the norm of each sample's whole gradient (every layer, weight and bias); under
            DistributedDataParallel, of this rank's N samples. float32 for float16 and bfloat16 parameters: the
            squares accumulate in float32 (in float16 a norm of 360 would square to inf).

        Raises:
            RuntimeError: this context recorded no per-sample gradient (it was never entered, or no backward ran
                inside it since it was entered or cleared).
        """
        total = self._session.results.sq_norms()
        if total is None:
            raise RuntimeError("PerSampleGrads.norms: this context recorded no per-sample gradient; run the forward "
                               "pass and loss.backward() inside its `with PerSampleGrads(model)` block")
        return total.clamp(min=0).sqrt()  # a ghost norm near 0 can round below it

    def clip_and_accumulate(self, max_norm: float) -> torch.Tensor:
        """Add to each parameter's ``.grad`` the sum over samples of its per-sample gradient clipped to max_norm.

        Sample n is scaled by ``min(1, max_norm / (norm[n] + 1e-6))`` (Opacus's factor), with norm[n]
        taken over the whole model. Where the gradients were not materialised (norms_only), each
        layer makes one ordinary weight-gradient call (convgrad.conv_weight_grad, ...) on its
        grad_output scaled per sample. The sum is added to ``.grad`` as it was before the context's
        backward (the unclipped sum that backward put there is not kept), so that micro-batches of
        one logical batch accumulate; calling it twice gives the same ``.grad``. Parameters that
        received no gradient get zeros added. Under DistributedDataParallel the clipped sums of all
        ranks are all-reduced (one call per dtype) before they are added, so every rank holds the
        sum over the global batch. Add the noise and divide by the (global) batch size yourself.

        Args:
            max_norm: the clipping bound C > 0.

        Returns:
            ``(N,)``, the per-sample norms before clipping (this rank's samples under DDP).

        Raises:
            ValueError: max_norm is not positive. RuntimeError: as
                ``norms``.
        """
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            raise ConvgradValueError(
                f"PerSampleGrads.clip_and_accumulate: max_norm={max_norm!r} must be a positive number")
        norms = self.norms()
        factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)  # (N,)
        clipped = self._session.results.clipped(factors)
        params = list(self._session.params.values())
        sums = [clipped[id(p)] if id(p) in clipped else torch.zeros_like(p) for p in params]
        if self._ddp is not None:
            distributed.all_reduce_sum(sums, self._ddp.process_group)
        for p, g in zip(params, sums, strict=True):
            before = self._session.results.before.get(id(p), p.grad)
            g = g.to(p.dtype)  # autocast: the parameter's dtype
            p.grad = g if before is None else before + g
        return norms
