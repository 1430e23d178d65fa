"""`convgrad check`: verify every backend's gradients against float64 autograd, in any dtype.

Three modes::

    convgrad check --input 2,4,9,9 --weight 6,2,3,3 --stride 2 --groups 2 [--padding 1:2,0:1] [--dtype float16]
    convgrad check --model convgrad.cli.check:example_model --input-shape 8,3,32,32 [--backend fwdconv]
    convgrad check --model path/to/models.py:small_cnn --input-shape 8,3,224,224
    convgrad check --random 200 --seed 0 [--verbose]

Every mode is judged by one function, ``check_gradients``: the inputs
are rounded to the checked dtype, the reference is float64 autograd on those same rounded values, and each entry
must lie within an error bound computed from the data (judge.py). The exit status is 1 when any gradient is out
of its bound, 2 on a bad argument, 0 otherwise.
"""

from convgrad.cli.check.command import add_arguments, run
from convgrad.cli.check.configs import check_config, check_random, random_config
from convgrad.cli.check.judge import (
                                      BOUND_UNITS,
                                      DTYPES,
                                      GRADIENTS,
                                      Result,
                                      check_gradients,
                                      compare,
                                      error_bound,
                                      half_precision_sums,
                                      reference_grads,
                                      unit_roundoff,
)
from convgrad.cli.check.model import LayerCheck, check_model, example_model, load_factory

__all__ = ["BOUND_UNITS", "DTYPES", "GRADIENTS", "LayerCheck", "Result", "add_arguments", "check_config",
           "check_gradients", "check_model", "check_random", "compare", "error_bound", "example_model",
           "half_precision_sums", "load_factory", "random_config", "reference_grads", "run", "unit_roundoff"]
