"""Per-sample (per-example) gradients, exact per-sample norms and clipped sums for every convolution.

Layer level (``functional``): per_sample_weight_grad,
per_sample_bias_grad, per_sample_grad_norms. Model level (``model``):
the PerSampleGrads context manager, which fills ``.grad_sample`` (N, *param.shape) as
Opacus defines it, or only the per-sample norms, and clips and sums them for DP-SGD.
"""

from convgrad.per_sample.functional import per_sample_bias_grad, per_sample_grad_norms, per_sample_weight_grad
from convgrad.per_sample.model import PerSampleGrads

__all__ = ["PerSampleGrads", "per_sample_bias_grad", "per_sample_grad_norms", "per_sample_weight_grad"]
