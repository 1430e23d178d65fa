"""The old home of ``convgrad.tensor_ops`` (before issue 27), for code written against it; import from
``convgrad.tensor_ops`` instead."""

from convgrad.tensor_ops import CONV, add_product_, batched_like, bias_grad, pad, placeholder, plain, sliced

__all__ = ["CONV", "add_product_", "batched_like", "bias_grad", "pad", "placeholder", "plain", "sliced"]
