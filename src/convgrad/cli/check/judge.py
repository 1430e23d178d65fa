"""The judge of `convgrad check`: a float64 reference on the same rounded inputs, and a bound that follows the data.

A backend that computes in dtype ``d`` receives the tensors rounded to ``d``. The reference is torch autograd in
float64 (complex128) on exactly those rounded values, so the difference is the backend's own rounding and nothing
else. Each gradient entry is a sum of products; its error is bounded element-wise by::

    |ours - ref| <= u |ref|  +  C (u + sqrt(m) u + sqrt(n) u_acc) |G|  +  C u tiny

- ``u``: the unit roundoff of ``d`` (eps / 2); ``u |ref|`` is the last rounding of the result.
- ``|G|``: the same gradient computed on absolute values in float64 (|grad_output| with |weight| for
  grad_input, with |input| for grad_weight, summed for grad_bias): the sum of the magnitudes of the products.
- ``n``: the number of those products (the same gradient of all-ones tensors). ``u_acc``: the unit roundoff of
  the accumulator: float32 for float16, bfloat16 and float32, float64 for float64. Where the kernels accumulate
  half precision in float32 this term is small and the bound is a few ``u``; in float32 and float64 it is the
  probabilistic bound of a sum in working precision.
- ``m``: the terms that torch's own kernel adds in ``d`` itself (``half_precision_sums``), 0 elsewhere. On the
  CPU, float16 (and bfloat16 where oneDNN does not run it) goes to torch's reference kernels (slow_conv2d,
  slow_conv3d, slow_conv_dilated, slow_conv_transpose: im2col + GEMM), whose GEMMs sum in float32 but whose
  col2im adds each kernel tap's column into a forward conv's grad_input in ``d`` (``m``: the taps that reach the
  entry, its products over C_out/g), and whose weight gradient adds each sample's GEMM into the result in ``d``
  (``m = N``). A 31x31 float16 layer's grad_input erred 27 times a float32 sum rounded once, past the bound that
  took float32 accumulation for granted (issue 40, item 4). The bound covers torch's kernel; a backend that sums
  in float32 is judged by the same bound, and the report's ``err / native`` column shows it doing better.
- ``C = BOUND_UNITS``: a few roundings of partial sums to ``d`` (split reductions, several steps).
- ``tiny``: the smallest normal number of ``d``; below it rounding errors are absolute (subnormals).

A length-only bound (``n u`` times the largest entry) would pass wrong kernels; this one follows each entry, so a
kernel tap in the wrong place fails in every dtype (tests/test_check.py proves it with a mutant backend).

Source: Higham, *Accuracy and Stability of Numerical Algorithms* (2nd ed., 2002), section 3.1, for
``|fl(x . y) - x . y| <= gamma_n |x| . |y|``; Higham and Mary, "A new approach to probabilistic rounding error
analysis", SIAM J. Sci. Comput. 41(5), 2019, for its ``sqrt(n) u`` form.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from convgrad.spec import ConvSpec
from convgrad.tensor_ops import pad_flat

__all__ = ["BOUND_UNITS", "DTYPES", "GRADIENTS", "Result", "check_gradients", "compare", "error_bound",
           "half_precision_sums", "reference_grads", "unit_roundoff"]

BOUND_UNITS = 4.0
DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex128, torch.complex64)}
GRADIENTS = ("grad_input", "grad_weight", "grad_bias")
_F_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_F_CONV_T = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class Result:
    """One compared gradient: who computed it, how far it is from the reference, and the verdict.

    ``max_abs`` is the largest ``|ours - ref|``; ``of_bound`` the largest ratio of that error to its bound
    (the gradient passes when it is at most 1); ``vs_native`` is ``max_abs`` over native's ``max_abs`` on the
    same inputs (where native's is 0, over one rounding of the largest entry).
    """

    backend: str
    gradient: str
    max_abs: float
    of_bound: float
    status: str  # "pass", "FAIL" or "skip: <why>"
    vs_native: float = math.nan

    @property
    def failed(self) -> bool:
        return self.status == "FAIL"


def unit_roundoff(dtype: torch.dtype) -> float:
    """Half the distance from 1 to the next number of ``dtype`` (a complex dtype: of its real part)."""
    return torch.finfo(dtype).eps / 2


def half_precision_sums(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether torch's own convolution kernels add some of their terms in ``dtype`` itself on ``device`` (the
    module docstring's ``m``): on the CPU, float16 and bfloat16 unless oneDNN runs that dtype there (bfloat16 on
    CPUs with AVX-512, float16 on those with AVX-512 FP16 or AMX, and only while ``torch.backends.mkldnn`` is
    enabled). CUDA's kernels accumulate half precision in float32.

    Examples:
        >>> half_precision_sums(torch.float32, torch.device("cpu")), half_precision_sums(torch.float16, "cuda")
        (False, False)
    """
    if torch.device(device).type != "cpu" or dtype not in (torch.float16, torch.bfloat16):
        return False
    mkldnn = torch.backends.mkldnn
    if not (mkldnn.is_available() and mkldnn.enabled):
        return True
    supported = (torch.ops.mkldnn._is_mkldnn_bf16_supported if dtype == torch.bfloat16
                 else torch.ops.mkldnn._is_mkldnn_fp16_supported)
    return not supported()


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def reference_grads(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                    ) -> dict[str, torch.Tensor]:
    """grad_input, grad_weight, grad_bias by torch autograd through F.conv*/F.conv_transpose*, batched tensors."""
    x, w = input.detach().requires_grad_(), weight.detach().requires_grad_()
    b = torch.zeros(spec.out_channels, dtype=x.dtype, device=x.device, requires_grad=True)
    if spec.transposed:  # torch's transposed conv with padding 0, then crop (lo, hi) per dim
        full = _F_CONV_T[spec.n](x, w, b, spec.stride, 0, spec.output_padding, spec.groups, spec.dilation)
        y = full[(..., *(slice(lo, full.shape[2 + j] - hi) for j, (lo, hi) in enumerate(spec.padding)))]
    else:  # F.pad takes the last dim first
        padded = F.pad(x, pad_flat(spec.padding))
        y = _F_CONV[spec.n](padded, w, b, spec.stride, 0, spec.dilation, spec.groups)
    return dict(zip(GRADIENTS, torch.autograd.grad(y, [x, w, b], grad_output)))


def error_bound(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                dtype: torch.dtype, reference: dict[str, torch.Tensor] | None = None,
                half_sums: bool | None = None) -> dict[str, torch.Tensor]:
    """The element-wise bound on ``|ours - reference|`` for a backend that computes in ``dtype`` (module docstring).

    Args:
        spec: the validated configuration (batched shapes).
        input, weight, grad_output: the tensors the backend received, already rounded to ``dtype``, in float64
            (complex128), shapes ``spec.input_shape``, ``spec.weight_shape``, ``spec.output_shape``.
        dtype: the dtype the backend computes in.
        reference: ``reference_grads`` of the same tensors, when already computed (default: computed here).
        half_sums: whether torch's kernels add some terms in ``dtype`` (the docstring's ``m``); default
            ``half_precision_sums(dtype, input.device)``.

    Returns:
        ``{"grad_input": (N, C_in, *spatial), "grad_weight": weight's shape, "grad_bias": (C_out,)}``, float64.

    Source: Higham (2002), section 3.1; Higham and Mary (2019); the module docstring gives the bound.

    Examples:
        Each grad_weight entry of this 1d conv sums 3 products of ones: ``u 3 + 4 (u + sqrt(3) u_acc) 3``,
        about ``15 u`` in bfloat16, whose accumulator (float32) is far more precise; each grad_input entry of a
        31-tap conv sums up to 31 in torch's float16 col2im: ``4 sqrt(31) u`` more per unit of ``|G|``:

        >>> spec = ConvSpec.from_shapes((1, 1, 4), (1, 1, 2))
        >>> ones = [torch.ones(s, dtype=torch.float64) for s in (spec.input_shape, spec.weight_shape,
        ...                                                       spec.output_shape)]
        >>> (error_bound(spec, *ones, torch.bfloat16, half_sums=False)["grad_weight"]
        ...  / unit_roundoff(torch.bfloat16)).round()
        tensor([[[15., 15.]]], dtype=torch.float64)
        >>> spec = ConvSpec.from_shapes((1, 1, 31), (1, 1, 31), padding=15)
        >>> ones = [torch.ones(s, dtype=torch.float64) for s in (spec.input_shape, spec.weight_shape,
        ...                                                       spec.output_shape)]
        >>> bounds = [error_bound(spec, *ones, torch.float16, half_sums=h)["grad_input"][0, 0, 15] for h in (0, 1)]
        >>> [round(float(b / (unit_roundoff(torch.float16) * 31))) for b in bounds]   # in units of u |G|
        [5, 27]
    """
    ref = reference if reference is not None else reference_grads(spec, input, weight, grad_output)
    absolute = reference_grads(spec, input.abs(), weight.abs(), grad_output.abs())
    ones = (torch.ones(t.shape, dtype=torch.float64, device=t.device) for t in (input, weight, grad_output))
    terms = reference_grads(spec, *ones)
    u = unit_roundoff(dtype)
    u_acc = unit_roundoff(torch.float64 if _wide(dtype) == dtype else torch.float32)
    tiny = torch.finfo(dtype).tiny
    half = half_precision_sums(dtype, input.device) if half_sums is None else half_sums
    # m: the terms torch's kernel adds in dtype (module docstring): a forward conv's col2im adds one column per tap
    # that reaches a grad_input entry (its products over the C_out/g channels of its group); every weight gradient
    # adds one GEMM per sample
    in_dtype = {"grad_input": 0.0 if spec.transposed else terms["grad_input"] / spec.y_group_channels,
                "grad_weight": float(spec.batch), "grad_bias": 0.0} if half else dict.fromkeys(GRADIENTS, 0.0)
    return {name: u * ref[name].abs() + BOUND_UNITS * (
        (u + (in_dtype[name] ** 0.5) * u + terms[name].sqrt() * u_acc) * absolute[name] + u * tiny)
        for name in GRADIENTS}


def compare(backend: str, gradient: str, ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> Result:
    """Judge one gradient: pass when every entry is within its bound (equal non-finite entries count as equal)."""
    if ours.shape != ref.shape:
        return Result(backend, gradient, math.inf, math.inf, "FAIL")
    ours = ours.to(device=ref.device, dtype=ref.dtype)
    diff = (ours - ref).abs()
    same = (ours == ref) | (ours.isnan() & ref.isnan())
    diff = torch.where(same, 0.0, diff.nan_to_num(math.inf))
    ratio = torch.where(diff == 0, 0.0, diff / bound)  # x / 0 = inf for a non-zero error where no error is allowed
    max_abs = float(diff.max()) if diff.numel() else 0.0
    of_bound = float(ratio.max()) if ratio.numel() else 0.0
    return Result(backend, gradient, max_abs, of_bound, "pass" if of_bound <= 1 else "FAIL")


@contextlib.contextmanager
def _full_float32() -> Iterator[None]:
    """float32 means float32 while checking: TF32 (on by default for cuDNN convolutions) rounds to 10 bits."""
    cudnn, saved = torch.backends.cudnn, torch.backends.cuda.matmul.allow_tf32
    # cudnn's flags() context, not assignment: torch.testing's disable_global_flags (OpInfo tests, in one process
    # with these) forbids setting them directly
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=cudnn.deterministic,
                     allow_tf32=False):
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            yield
        finally:
            torch.backends.cuda.matmul.allow_tf32 = saved


def _run_backend(name: str, spec: ConvSpec, tensors: tuple[torch.Tensor, ...],
                 fn: str) -> tuple[torch.Tensor, ...] | str:
    """One backend's three gradients (batched), or "skip: <why>" when it refuses this dtype or device by design."""
    import convgrad
    from convgrad.backends import get_backend

    x, w, gy = tensors
    if x.dtype.is_complex and not get_backend(name, fn).supports_complex:
        return "skip: no complex support"
    if spec.unbatched:  # what a user passes: no batch dim
        x, gy = x[0], gy[0]
    try:
        with _full_float32():
            gi, gw, gb = convgrad.conv_backward(gy, x, w, [spec.out_channels], spec.stride, spec.padding,
                                                spec.dilation, spec.transposed, spec.output_padding, spec.groups,
                                                backend=name)
    except (TypeError, ValueError) as err:
        if f"backend={name!r}" not in str(err):  # not a refusal by design (numpy: CPU, float32/64 only)
            raise
        return "skip: " + str(err).split(": ", 1)[-1].split(";")[0]
    return (gi[None] if spec.unbatched else gi), gw, gb


def check_gradients(spec: ConvSpec, input: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor,
                    dtype: torch.dtype, backends: list[str], fn: str = "check") -> list[Result]:
    """The judge of every mode of `convgrad check`: each backend's gradients of these tensors, rounded to ``dtype``.

    Args:
        spec: the validated configuration.
        input, weight, grad_output: batched tensors of shapes ``spec.input_shape``, ``spec.weight_shape``,
            ``spec.output_shape``, any floating dtype, on the device to check.
        dtype: the dtype every backend computes in; the tensors are rounded to it first.
        backends: registered names; native also runs (unreported when absent) as the baseline of ``vs_native``.
        fn: the name errors start with (default ``"check"``).

    Returns:
        One ``Result`` per (backend, gradient), in the order of ``backends``.

    Raises:
        ValueError: an unregistered backend.

    Source: the module docstring (the bound); tests/test_check.py (the mutant it fails).

    Examples:
        >>> spec = ConvSpec.from_shapes((2, 4, 9, 9), (6, 2, 3, 3), stride=2, groups=2)
        >>> x, w, gy = (torch.randn(s) for s in (spec.input_shape, spec.weight_shape, spec.output_shape))
        >>> [r.status for r in check_gradients(spec, x, w, gy, torch.bfloat16, ["fwdconv"])]
        ['pass', 'pass', 'pass']
    """
    rounded = tuple(t.detach().to(dtype) for t in (input, weight, grad_output))
    # the reference runs in float64 where the device has it (MPS has not)
    ref_device = torch.device("cpu") if rounded[0].device.type == "mps" else rounded[0].device
    wide = tuple(t.to(device=ref_device, dtype=_wide(dtype)) for t in rounded)
    ref = reference_grads(spec, *wide)
    bound = error_bound(spec, *wide, dtype, reference=ref,
                        half_sums=half_precision_sums(dtype, rounded[0].device))  # the kernels' device
    largest = {name: _largest(t) for name, t in ref.items()}
    judged = {}
    for name in dict.fromkeys([*backends, "native"]):
        grads = _run_backend(name, spec, rounded, fn)
        judged[name] = _judge(name, grads, ref, bound, largest, dtype)
        if name == "fft":  # FFT errors are normwise: fft is judged by its own bound (convgrad.backends.fft)
            judged[name] = _judge_normwise(spec, judged[name], grads, ref, wide, dtype)
    # native's error; where it is 0 (native is the float64 reference's own kernel), one rounding of the largest entry
    floor = {g: max(unit_roundoff(dtype) * largest[g], torch.finfo(dtype).tiny) for g in GRADIENTS}
    baseline = {r.gradient: r.max_abs or floor[r.gradient] for r in judged["native"]}
    return [dataclasses.replace(r, vs_native=r.max_abs / baseline[r.gradient]) if not math.isnan(r.max_abs) else r
            for name in backends for r in judged[name]]


def _judge_normwise(spec: ConvSpec, elementwise: list[Result], grads: tuple[torch.Tensor, ...] | str,
                    ref: dict[str, torch.Tensor], wide: tuple[torch.Tensor, ...], dtype: torch.dtype) -> list[Result]:
    """fft's grad_input and grad_weight by ``||ours - ref||_2 <= u ||ref||_2 + fft.normwise_bound`` (grad_bias, a
    plain sum, keeps the element-wise judge); ``of_bound`` is then the ratio of the norms."""
    from convgrad.backends import fft

    if isinstance(grads, str):
        return elementwise
    computed = fft.normwise_bound(spec, *wide, dtype)
    out = []
    for result, name, ours in zip(elementwise, GRADIENTS, grads):
        if name not in computed or result.status.startswith("skip"):
            out.append(result)
            continue
        diff = ours.to(device=ref[name].device, dtype=ref[name].dtype) - ref[name]
        err = float(diff.norm()) if torch.isfinite(diff).all() else math.inf
        allowed = unit_roundoff(dtype) * float(ref[name].norm()) + computed[name]
        ratio = 0.0 if err == 0 else (err / allowed if allowed > 0 else math.inf)
        out.append(dataclasses.replace(result, of_bound=ratio, status="pass" if ratio <= 1 else "FAIL"))
    return out


def _largest(t: torch.Tensor) -> float:
    return float(t.abs().max()) if t.numel() else 0.0


def _judge(name: str, grads: tuple[torch.Tensor, ...] | str, ref: dict[str, torch.Tensor],
           bound: dict[str, torch.Tensor], largest: dict[str, float], dtype: torch.dtype) -> list[Result]:
    """The three Results of one backend; a refusal or a gradient that ``dtype`` cannot hold is a skip."""
    if isinstance(grads, str):
        return [Result(name, g, math.nan, math.nan, grads) for g in GRADIENTS]
    return [compare(name, g, ours, ref[g], bound[g]) if largest[g] <= torch.finfo(dtype).max
            else Result(name, g, math.nan, math.nan, f"skip: exceeds {str(dtype).removeprefix('torch.')}'s range")
            for g, ours in zip(GRADIENTS, grads)]
