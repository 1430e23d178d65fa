"""convgrad inside the PyTorch machinery: torch.compile, torch.func, autocast, memory formats, state_dict, DDP.

Each test compares against the same thing done with torch's own convolutions.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import convgrad as cg
import convgrad.nn as cnn
from convgrad.backends import get_backend
from helpers import TOL, backend_accepts, grid_backends
from ranks import run_ranks

BACKENDS = cg.backends()
TORCH_OPS_ONLY = [b for b in BACKENDS if get_backend(b).differentiable]  # the backends functorch can transform
F64 = torch.float64


def _skip_unless_runs_on(backend: str, device: torch.device) -> None:
    """Skip a backend that refuses this device by design (numpy: CPU only), naming itself in the error."""
    if not backend_accepts(backend, F64, device):
        pytest.skip(f"{backend} does not run on {device}")


def _model(mod: Any, seed: int = 0) -> torch.nn.Module:
    """A small net of 2d convs (strided, 'same' grouped, transposed) from torch.nn or convgrad.nn."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        mod.Conv2d(3, 8, 3, stride=2, padding=1), torch.nn.ReLU(),
        mod.Conv2d(8, 8, 3, padding="same", groups=4, bias=False), torch.nn.Tanh(),
        mod.ConvTranspose2d(8, 4, 3, stride=2, output_padding=1),
    )


def _twins(backend: str, device: torch.device, dtype: torch.dtype = F64) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The native model and a convgrad.nn model loaded from its state_dict."""
    native = _model(torch.nn).to(device, dtype)
    ours = _model(cnn).to(device, dtype)
    for m in ours.modules():
        if isinstance(m, cnn.modules.ConvgradMixin):
            m.backend = backend
    ours.load_state_dict(native.state_dict())
    return native, ours


def _param_grads(model: torch.nn.Module, run: Any, x: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad()
    run(x).square().sum().backward()
    return [p.grad.clone() for p in model.parameters()]


def _assert_all_close(ours: list[torch.Tensor], ref: list[torch.Tensor], dtype: torch.dtype, ctx: str) -> None:
    assert len(ours) == len(ref) > 0
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, i=i: f"{ctx} #{i}: {m}")


# ---- torch.compile -----------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_aot_eager_gradients_equal_native(backend: str, device: torch.device) -> None:
    """One graph per model (fullgraph) for backends made of torch ops; numpy's backward may break the graph."""
    _skip_unless_runs_on(backend, device)
    torch._dynamo.reset()
    native, ours = _twins(backend, device)
    x = torch.randn(2, 3, 9, 9, dtype=F64, device=device)
    ref = _param_grads(native, native, x)
    compiled = torch.compile(ours, backend="aot_eager", fullgraph=backend in TORCH_OPS_ONLY)
    _assert_all_close(_param_grads(ours, compiled, x), ref, F64, f"compile {backend}")


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["auto", "fwdconv"])
def test_compile_inductor_gradients_equal_native(backend: str, device: torch.device) -> None:
    torch._dynamo.reset()
    native, ours = _twins(backend, device, torch.float32)
    x = torch.randn(2, 3, 9, 9, device=device)
    compiled = torch.compile(ours, backend="inductor")
    _assert_all_close(_param_grads(ours, compiled, x), _param_grads(native, native, x), torch.float32,
                      f"inductor {backend}")


# ---- torch.func --------------------------------------------------------------------------------------------------

KW = dict(stride=2, padding=((0, 1), (1, 0)), groups=2)  # asymmetric: convgrad pads the excess itself


def _native_conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.conv2d(F.pad(x, (1, 0, 0, 1)), w, b, stride=2, groups=2)


def _operands(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g, dtype=F64) for s in ((3, 4, 7, 6), (6, 2, 3, 3), (6,)))
    return x.to(device), w.to(device), b.to(device)


@pytest.mark.parametrize("backend", grid_backends(TORCH_OPS_ONLY))
def test_vmap_over_inputs_and_weights(backend: str, device: torch.device) -> None:
    x, w, b = _operands(device)
    ws = torch.stack([w, 2 * w, -w])  # one weight per sample
    ours = vmap(lambda xi, wi: cg.conv(xi, wi, b, **KW, backend=backend))(x, ws)
    ref = torch.stack([_native_conv(xi[None], wi, b)[0] for xi, wi in zip(x, ws)])
    torch.testing.assert_close(ours, ref, **TOL[F64])


ONE_SIDE_BATCHED = [  # (input shape, weight shape, stride, groups): depthwise taps, phase convs, 1d, gemm's fold
    ((2, 4, 9, 9), (4, 1, 3, 3), 2, 4),
    ((2, 4, 9, 8), (6, 2, 3, 2), 2, 2),
    ((2, 3, 11), (4, 3, 4), 3, 1),
    ((2, 4, 5, 6, 7), (6, 2, 2, 3, 3), 2, 2),  # 3d, 1 < groups < C_in, even kernel, rows left unread
]


@pytest.mark.parametrize("case", ONE_SIDE_BATCHED, ids=str)
@pytest.mark.parametrize("backend", grid_backends(TORCH_OPS_ONLY))
def test_vmap_over_one_operand_with_a_shared_grad_output(backend: str, case: tuple[Any, ...], device: torch.device,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """vmap over the weight alone (grad_input) or the input alone (grad_weight), grad_output shared, nested with a
    vmap over grad_output, and vmap of grad: a buffer that batched results are written into must be batched too."""
    input_shape, weight_shape, stride, groups = case
    g = torch.Generator().manual_seed(1)
    ws, xs = (torch.randn(3, *s, generator=g, dtype=F64).to(device) for s in (weight_shape, input_shape))
    conv = getattr(F, f"conv{len(input_shape) - 2}d")
    gy = torch.randn(conv(xs[0], ws[0], stride=stride, groups=groups).shape, generator=g, dtype=F64).to(device)
    if backend == "gemm":
        monkeypatch.setattr(get_backend("gemm"), "max_workspace_bytes", 512)  # several chunks: one shared result

    def input_grad(w: torch.Tensor, b: str) -> torch.Tensor:
        return cg.conv_input_grad(input_shape, w, gy, stride, groups=groups, backend=b)

    def weight_grad(x: torch.Tensor, b: str) -> torch.Tensor:
        return cg.conv_weight_grad(x, weight_shape, gy, stride, groups=groups, backend=b)

    for grad_of, operands in ((input_grad, ws), (weight_grad, xs)):
        ours = vmap(lambda t: grad_of(t, backend))(operands)  # noqa: B023
        ref = torch.stack([grad_of(t, "native") for t in operands])
        torch.testing.assert_close(ours, ref, **TOL[F64])
    gys = torch.stack([gy, -2 * gy])  # nested: the weight batched at one level, grad_output at the other

    def nested(b: str) -> torch.Tensor:
        return vmap(lambda w: vmap(lambda g: cg.conv_input_grad(input_shape, w, g, stride, groups=groups,
                                                                 backend=b))(gys))(ws)

    torch.testing.assert_close(nested(backend), nested("native"), **TOL[F64])

    def per_weight_grad(b: str) -> torch.Tensor:  # vmap of grad over the weight
        return vmap(grad(lambda w: input_grad(w, b).square().sum()))(ws)

    torch.testing.assert_close(per_weight_grad(backend), per_weight_grad("native"), **TOL[F64])


@pytest.mark.parametrize("backend", grid_backends(TORCH_OPS_ONLY))
def test_vmap_of_grad_gives_per_sample_gradients(backend: str, device: torch.device) -> None:
    """The torch.func per-sample-gradient recipe: vmap(grad(loss)) over the batch, weight and bias."""
    x, w, b = _operands(device)

    def loss(wb: tuple[torch.Tensor, torch.Tensor], xi: torch.Tensor, conv: Any) -> torch.Tensor:
        return conv(xi[None], *wb).tanh().sum()

    ours = vmap(grad(loss), in_dims=(None, 0, None))((w, b), x, lambda *a: cg.conv(*a, **KW, backend=backend))
    for i in range(x.shape[0]):
        wi, bi = w.clone().requires_grad_(), b.clone().requires_grad_()
        ref = torch.autograd.grad(loss((wi, bi), x[i], _native_conv), [wi, bi])
        torch.testing.assert_close(ours[0][i], ref[0], **TOL[F64])
        torch.testing.assert_close(ours[1][i], ref[1], **TOL[F64])


@pytest.mark.parametrize("size", [(7, 6), (8, 8)], ids=["odd-output", "even-output"])
@pytest.mark.parametrize("backend", grid_backends(TORCH_OPS_ONLY))
def test_batched_grads_and_vectorized_jacobian(backend: str, size: tuple[int, int], device: torch.device) -> None:
    """autograd.grad(is_grads_batched=True) and jacobian(vectorize=True) run the backward under the legacy vmap,
    which batches neither an alias (indexing that keeps a whole dim) nor an out= op; auto does not tune there."""
    _, w, _ = _operands(device)
    x = torch.randn(2, 4, *size, dtype=F64, device=device, requires_grad=True)
    vs = torch.randn(3, *_native_conv(x, w).shape, dtype=F64, device=device)  # 3 grad_outputs at once
    ours = torch.autograd.grad(cg.conv(x, w, **KW, backend=backend), (x,), vs, is_grads_batched=True)[0]
    ref = torch.autograd.grad(_native_conv(x, w), (x,), vs, is_grads_batched=True)[0]
    torch.testing.assert_close(ours, ref, **TOL[F64])
    jac = torch.autograd.functional.jacobian(lambda ww: cg.conv(x.detach(), ww, **KW, backend=backend), w,
                                             vectorize=True)
    torch.testing.assert_close(jac, torch.autograd.functional.jacobian(lambda ww: _native_conv(x.detach(), ww), w),
                               **TOL[F64])


@pytest.mark.parametrize("backend", grid_backends(TORCH_OPS_ONLY))
def test_grad_and_second_order_through_torch_func(backend: str, device: torch.device) -> None:
    x, w, _ = _operands(device)

    def f(conv: Any) -> Any:
        return lambda xx: conv(xx, w).square().sum()

    ours = f(lambda a, b: cg.conv(a, b, **KW, backend=backend))
    torch.testing.assert_close(grad(ours)(x), grad(f(_native_conv))(x), **TOL[F64])
    v = torch.randn_like(x)  # Hessian-vector product: forward-over-reverse
    hvp = jvp(grad(ours), (x,), (v,))[1]
    torch.testing.assert_close(hvp, jvp(grad(f(_native_conv)), (x,), (v,))[1], **TOL[F64])


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "conv_transpose"])
def test_forward_mode_jvp(transposed: bool, device: torch.device) -> None:
    """torch.func.jvp and jacfwd through the custom jvp: d conv = conv(dx, w) + conv(x, dw) + db."""
    x, w, b = _operands(device)
    if transposed:
        w = w.transpose(0, 1).reshape(4, 3, 3, 3).contiguous()[:, :3]  # (C_in, C_out/g, 3, 3), groups 2 -> C_out 6
        ours_f = lambda a, c, d: cg.conv_transpose(a, c, d, stride=2, output_padding=1, groups=2)  # noqa: E731
        ref_f = lambda a, c, d: F.conv_transpose2d(a, c, d, stride=2, output_padding=1, groups=2)  # noqa: E731
    else:
        ours_f = lambda a, c, d: cg.conv(a, c, d, **KW)  # noqa: E731
        ref_f = _native_conv
    tangents = tuple(torch.randn_like(t) for t in (x, w, b))
    out, tangent = jvp(ours_f, (x, w, b), tangents)
    ref_out, ref_tangent = jvp(ref_f, (x, w, b), tangents)
    torch.testing.assert_close(out, ref_out, **TOL[F64])
    torch.testing.assert_close(tangent, ref_tangent, **TOL[F64])
    # only some operands carry a tangent (the others are closed over): jacfwd agrees with jacrev
    small = x[:1, :, :4, :4]
    jf = jacfwd(lambda a: ours_f(a, w, b))(small)
    torch.testing.assert_close(jf, jacrev(lambda a: ref_f(a, w, b))(small), **TOL[F64])


def test_forward_mode_dual_numbers(device: torch.device) -> None:
    import torch.autograd.forward_ad as fwAD

    x, w, b = _operands(device)
    tx = torch.randn_like(x)
    with fwAD.dual_level():
        y = cg.conv(fwAD.make_dual(x, tx), w, b, **KW)
        tangent = fwAD.unpack_dual(y).tangent
    torch.testing.assert_close(tangent, _native_conv(tx, w), **TOL[F64])


# ---- autocast, memory format, state_dict -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", grid_backends([b for b in BACKENDS if b != "numpy"]))
def test_autocast_bfloat16_behaves_like_native(backend: str) -> None:
    """CPU autocast: convs run in bfloat16, outputs are bfloat16, float32 parameters get float32 gradients."""
    device = torch.device("cpu")
    native, ours = _twins(backend, device, torch.float32)
    x = torch.randn(2, 3, 9, 9, device=device)
    results = []
    for model in (native, ours):
        model.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = model(x)
        y.float().square().sum().backward()
        results.append((y, [p.grad for p in model.parameters()]))
    (y_ref, g_ref), (y_ours, g_ours) = results
    assert y_ours.dtype == y_ref.dtype == torch.bfloat16
    torch.testing.assert_close(y_ours, y_ref, **TOL[torch.bfloat16])
    assert [g.dtype for g in g_ours] == [g.dtype for g in g_ref] == [torch.float32] * len(g_ref)
    for a, b in zip(g_ours, g_ref):  # the backward ran in bfloat16 in both: compare at bfloat16's precision
        torch.testing.assert_close(a, b, rtol=5e-2, atol=5e-2 * float(b.abs().max()))


def test_autocast_leaves_float64_alone() -> None:
    x, w = torch.randn(1, 2, 5, 5, dtype=F64), torch.randn(3, 2, 3, 3, dtype=F64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert cg.conv2d(x, w).dtype == F.conv2d(x, w).dtype == F64


@pytest.mark.parametrize("backend", grid_backends(BACKENDS))
@pytest.mark.parametrize("n", [2, 3])
def test_channels_last_is_preserved_in_gradients(backend: str, n: int, device: torch.device) -> None:
    _skip_unless_runs_on(backend, device)
    fmt = torch.channels_last if n == 2 else torch.channels_last_3d
    x = torch.randn(2, 4, *(6,) * n, dtype=F64, device=device).contiguous(memory_format=fmt).requires_grad_()
    w = torch.randn(6, 2, *(3,) * n, dtype=F64, device=device).contiguous(memory_format=fmt).requires_grad_()
    native = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[n]
    ref = torch.autograd.grad(native(x, w, stride=2, groups=2).square().sum(), [x, w])
    ours = torch.autograd.grad(cg.conv(x, w, stride=2, groups=2, backend=backend).square().sum(), [x, w])
    for a, b, name in zip(ours, ref, ("grad_input", "grad_weight")):
        for f in (fmt, torch.contiguous_format):  # torch's layout, whatever its kernel (test_memory_format.py)
            assert a.is_contiguous(memory_format=f) == b.is_contiguous(memory_format=f), f"{backend}: {name} {f}"
        torch.testing.assert_close(a, b, **TOL[F64])


@pytest.mark.parametrize(("torch_cls", "ours_cls", "args"), [
    (torch.nn.Conv2d, cnn.Conv2d, (4, 6, 3)), (torch.nn.ConvTranspose2d, cnn.ConvTranspose2d, (4, 6, 3)),
    (torch.nn.Conv1d, cnn.Conv1d, (2, 3, 5)), (torch.nn.Conv3d, cnn.Conv3d, (2, 3, 2))])
def test_state_dict_is_interchangeable(torch_cls: type, ours_cls: type, args: tuple[int, ...]) -> None:
    theirs, ours = torch_cls(*args, stride=2, padding=1), ours_cls(*args, stride=2, padding=1)
    assert set(ours.state_dict()) == set(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict(), strict=True)
    x = torch.randn(1, args[0], *(7,) * (ours.weight.dim() - 2))
    torch.testing.assert_close(ours(x), theirs(x))
    back = torch_cls(*args, stride=2, padding=1)
    back.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(back(x), theirs(x))


# ---- DistributedDataParallel -------------------------------------------------------------------------------------

DDP_TIMEOUT_S = 90


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    """One rank: the same batch shard through native DDP and through convgrad DDP; rank 0 saves both."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=DDP_TIMEOUT_S))
    try:
        grads = {}
        x = torch.randn(2 * world, 3, 9, 9, dtype=F64, generator=torch.Generator().manual_seed(7))[2 * rank:][:2]
        for name, mod in (("native", torch.nn), ("convgrad", cnn)):
            model = DDP(_model(mod).double())
            model(x).square().sum().backward()
            grads[name] = [p.grad for p in model.parameters()]
        if rank == 0:
            torch.save(grads, out)
        dist.barrier()  # neither rank tears its connections down while the other still uses them (gloo aborts)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # DDP: two processes
def test_ddp_gloo_two_processes_equals_native_ddp(tmp_path: Path) -> None:
    out = str(tmp_path / "grads.pt")
    run_ranks(_ddp_worker, lambda port: (2, port, out), nprocs=2, timeout_s=DDP_TIMEOUT_S)
    grads = torch.load(out)
    _assert_all_close(grads["convgrad"], grads["native"], F64, "DDP")
