"""Which formulations explain shows, and the plan of each: the method arguments of ``explain`` resolved, and
the plan built (the very call the backend makes, so the plan is the object it runs)."""

from __future__ import annotations

from typing import Any

from convgrad.backends import fft
from convgrad.backends.fwdconv import INPUT_METHODS, WEIGHT_METHODS
from convgrad.errors import ConvgradValueError, MethodRefused
from convgrad.explain import fft_view
from convgrad.spec import ConvSpec

__all__ = ["EXPLAIN_INPUT_METHODS", "EXPLAIN_WEIGHT_METHODS", "METHODS", "plan_of", "resolve_methods"]

# the formulations explain shows: fwdconv's, and the fft backend's for either gradient
EXPLAIN_INPUT_METHODS = (*INPUT_METHODS, fft_view.METHOD)
EXPLAIN_WEIGHT_METHODS = (*WEIGHT_METHODS, fft_view.METHOD)
METHODS = (*INPUT_METHODS, *WEIGHT_METHODS, fft_view.METHOD)


def resolve_methods(method: str | None, input_method: str | None,
                    weight_method: str | None) -> tuple[str | None, str | None]:
    """method=NAME applies NAME to whichever gradient has it; the explicit ones must name their own list."""
    if method == fft_view.METHOD:  # both gradients have it
        for name, given in (("input_method", input_method), ("weight_method", weight_method)):
            if given not in (None, method):
                raise ConvgradValueError(f"explain: method={method!r} and {name}={given!r} disagree; give one of them")
        return method, method
    if method is not None:
        if method not in INPUT_METHODS + WEIGHT_METHODS:
            raise ConvgradValueError(
                f"explain: method={method!r} must be None or one of {METHODS}")
        name, given = ("input_method", input_method) if method in INPUT_METHODS else ("weight_method", weight_method)
        if given not in (None, method):
            raise ConvgradValueError(f"explain: method={method!r} and {name}={given!r} disagree; give one of them")
        input_method, weight_method = (method, weight_method) if name == "input_method" else (input_method, method)
    if input_method is not None and input_method not in EXPLAIN_INPUT_METHODS:
        raise ConvgradValueError(
            f"explain: input_method={input_method!r} must be None or one of {EXPLAIN_INPUT_METHODS}")
    if weight_method is not None and weight_method not in EXPLAIN_WEIGHT_METHODS:
        raise ConvgradValueError(
            f"explain: weight_method={weight_method!r} must be None or one of {EXPLAIN_WEIGHT_METHODS}")
    return input_method, weight_method


def plan_of(build: Any, spec: ConvSpec, method: str | None, name: str) -> Any:
    """The plan ``build`` makes for ``method`` (None: the rule's own choice), or fft's plan of the same result;
    a refusal is re-raised as explain's, with the refusal's own reason."""
    if method == fft_view.METHOD:  # the fft backend's plan of the same result
        gradient = {"plan_forward": "output", "plan_input_grad": "grad_input"}.get(build.__name__, "grad_weight")
        return fft.plan(spec, gradient)
    try:  # no method: the very call (and lru_cache entry) the backend uses, so the plan is the object it runs
        return build(spec) if method is None else build(spec, method)
    except MethodRefused as err:  # the refusal's own reason, not its message's text
        raise MethodRefused("explain", err.method, f"cannot serve {spec.describe()}: {err.reason}",
                            param=name) from None
