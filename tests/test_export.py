"""torch.export of convgrad's modules and patched models (issue 40, item 2), strict and non-strict, with a dynamic
batch and dynamic spatial dims (``torch.export.Dim``), as torch exports ``torch.nn``'s.

What an exported program keeps (docs/backends.md, "Under torch.compile, torch.export and TorchScript"): torch's
convolution, ``aten.convolution``. Its outputs and its gradients are torch autograd's at every size the dims allow,
it holds no convgrad op (it runs, saved and loaded, without convgrad), and ``no_weight_gradients()`` does not act on
it, which a warning says at export. Before the fix, non-strict export failed in ``ConvSpec.from_shapes`` ("input.shape
=(s31, 2, 12, 12) must contain only ints (got SymInt)"), strict export failed inside torch.fx ("LazyProxy"), and even
with static shapes strict export traced convgrad's autograd Function under no_grad: the program's weights got no
gradient at all.

Every model below is a twin of a torch model with the same parameters; the patched ones include a conv subclass with
its own forward, which calls the functional conv itself (what patch routes through convgrad too).
"""

from __future__ import annotations

import copy
import io
import operator
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import convgrad as cg
from helpers import TOL

F64 = torch.float64
NOTE = r"torch\.export records torch's convolution \(aten\.convolution\).*no_weight_gradients\(\) does not act on it"


class OwnForward(torch.nn.Conv2d):
    """A user's conv with its own forward, calling the functional conv itself."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.conv2d(input, self.weight * 0.5, self.bias, self.stride, self.padding, self.dilation,
                        self.groups) + 1


class ConvForward(torch.nn.Conv1d):
    """A user's conv with its own forward, through torch's ``_conv_forward`` (the mixin's under patch)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(torch.tanh(input), self.weight, self.bias)


# (name, torch twin's builder, spatial dims, in_channels, smallest spatial size each dynamic dim allows)
TORCH_MODULES: list[tuple[str, Callable[[], torch.nn.Module], int, int, int]] = [
    ("conv1d", lambda: torch.nn.Conv1d(3, 4, 5, stride=2, padding=2), 1, 3, 5),
    ("conv2d same even kernel", lambda: torch.nn.Conv2d(4, 6, (4, 3), padding="same", dilation=(1, 2), groups=2),
     2, 4, 5),
    ("conv2d reflect", lambda: torch.nn.Conv2d(2, 3, 3, padding=2, padding_mode="reflect"), 2, 2, 5),
    ("conv3d", lambda: torch.nn.Conv3d(2, 4, 3, stride=2, padding=1, groups=2), 3, 2, 5),
    ("conv_transpose1d", lambda: torch.nn.ConvTranspose1d(4, 2, 3, stride=2, padding=1, output_padding=1), 1, 4, 5),
    ("conv_transpose2d", lambda: torch.nn.ConvTranspose2d(4, 2, (3, 4), stride=2, dilation=(2, 1), groups=2), 2, 4,
     5),
    ("conv_transpose3d", lambda: torch.nn.ConvTranspose3d(2, 2, 3, stride=(2, 1, 2)), 3, 2, 5),
]

PATCHED_MODELS: list[tuple[str, Callable[[], torch.nn.Module], int, int, int]] = [
    ("sequential", lambda: torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, stride=2, padding=1), torch.nn.ReLU(),
                                               torch.nn.ConvTranspose2d(4, 2, 3, stride=2, output_padding=1)),
     2, 2, 5),
    ("own forward (functional)", lambda: torch.nn.Sequential(OwnForward(2, 4, 3, padding=1), torch.nn.ReLU(),
                                                             torch.nn.Conv2d(4, 2, 3, dilation=2)), 2, 2, 6),
    ("own forward (_conv_forward)", lambda: ConvForward(3, 2, 4, stride=3, padding=1), 1, 3, 5),
]


def _drop_in(ref: torch.nn.Module) -> torch.nn.Module:
    """The convgrad.nn module of ref's class, built with ref's arguments and holding its parameters."""
    cls = getattr(cg.nn, type(ref).__name__)
    kw = {k: getattr(ref, k) for k in ("stride", "padding", "dilation", "groups", "padding_mode")}
    if ref.transposed:  # type: ignore[union-attr]
        kw["output_padding"] = ref.output_padding
    ours: torch.nn.Module = cls(ref.in_channels, ref.out_channels, ref.kernel_size, **kw).double()
    ours.load_state_dict(ref.state_dict())
    return ours


def _twins(case: tuple[str, Callable[[], torch.nn.Module], int, int, int], patched: bool
           ) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(convgrad model, torch twin) in float64, equal parameters."""
    torch.manual_seed(0)
    ref = case[1]().double()
    ours = cg.patch(copy.deepcopy(ref), backend="fwdconv") if patched else _drop_in(ref)
    return ours, ref


def _export(model: torch.nn.Module, n: int, channels: int, smallest: int, strict: bool) -> torch.export.ExportedProgram:
    """model exported on a (3, C, 7, ...) example with the batch and every spatial dim dynamic."""
    dims = {0: Dim("batch", min=1, max=64), **{2 + j: Dim(f"size{j}", min=smallest, max=96) for j in range(n)}}
    x = torch.randn(3, channels, *(7,) * n, dtype=F64)
    with pytest.warns(UserWarning, match=NOTE):
        return torch.export.export(model, (x,), dynamic_shapes=(dims,), strict=strict)


def _assert_torchs(program: torch.nn.Module, ref: torch.nn.Module, n: int, channels: int, smallest: int) -> None:
    """At several batch and spatial sizes (not the example's), the program's output and its gradients (input and
    every parameter) are the torch twin's."""
    for batch, size in ((1, smallest), (2, 9), (5, 16), (64, smallest + 1)):
        torch.manual_seed(batch)
        x = torch.randn(batch, channels, *(size + j for j in range(n)), dtype=F64, requires_grad=True)
        y, want = program(x), ref(x)
        torch.testing.assert_close(y, want, **TOL[F64])
        gy = torch.randn_like(want)
        got_grads = torch.autograd.grad(y, [x, *program.parameters()], gy)
        want_grads = torch.autograd.grad(want, [x, *ref.parameters()], gy)
        assert len(got_grads) == len(want_grads)
        for got, expected in zip(got_grads, want_grads):
            torch.testing.assert_close(got, expected, **TOL[F64])


def _assert_aten_only(program: torch.export.ExportedProgram) -> None:
    """The graph calls aten ops (and getitem) only: no convgrad op, no higher-order op (strict export wrapped
    convgrad's Function as ``wrap_with_set_grad_enabled(False, ...)``, cutting the weights' gradients)."""
    targets = [node.target for node in program.graph.nodes if node.op == "call_function"]
    assert any(getattr(t, "__name__", "").startswith("convolution") for t in targets), targets
    for t in targets:
        assert t is operator.getitem or (isinstance(t, torch._ops.OpOverload) and t.namespace == "aten"), t


@pytest.mark.parametrize(("patched", "strict"), [(False, False), (True, True),
                                                 pytest.param(False, True, marks=pytest.mark.slow),
                                                 pytest.param(True, False, marks=pytest.mark.slow)],
                         ids=["drop-in-non-strict", "patched-strict", "drop-in-strict", "patched-non-strict"])
def test_export_with_dynamic_batch_and_size_is_torchs(patched: bool, strict: bool) -> None:
    """A Conv2d (drop-in) and a patched model with a subclass of its own forward, both dims dynamic: the program is
    torch's at every size; it saves and loads as an aten program. (Each export takes a second or two: two of the
    four run in the fast tier, one of each failure.)"""
    case = TORCH_MODULES[1] if not patched else PATCHED_MODELS[1]
    ours, ref = _twins(case, patched)
    _, _, n, channels, smallest = case
    program = _export(ours, n, channels, smallest, strict)
    _assert_aten_only(program)
    _assert_torchs(program.module(), ref, n, channels, smallest)
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    _assert_torchs(torch.export.load(saved).module(), ref, n, channels, smallest)


@pytest.mark.parametrize("patched", [False, True], ids=["drop-in", "patched"])
def test_strict_export_with_static_shapes_keeps_the_gradients(patched: bool) -> None:
    """Strict export traced convgrad's Function under no_grad: the program's output had no grad_fn, so its weights
    (and its input) got no gradient, where torch.nn's exported twin gives torch's."""
    ours, ref = _twins(PATCHED_MODELS[0] if patched else TORCH_MODULES[3], patched)
    x = torch.randn(2, 2, 6, 6, dtype=F64) if patched else torch.randn(2, 2, 6, 6, 6, dtype=F64)
    with pytest.warns(UserWarning, match=NOTE):
        program = torch.export.export(ours, (x,), strict=True).module()
    x.requires_grad_()
    y, want = program(x), ref(x)
    assert y.grad_fn is not None
    got = torch.autograd.grad(y.square().sum(), [x, *program.parameters()])
    expected = torch.autograd.grad(want.square().sum(), [x, *ref.parameters()])
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL[F64])


def test_no_weight_gradients_does_not_act_on_an_exported_program() -> None:
    """What docs/backends.md and the export warning say: the program's backward is torch's, scope or not."""
    ours, ref = _twins(TORCH_MODULES[0], patched=False)
    program = _export(ours, 1, 3, 5, strict=True).module()
    x = torch.randn(2, 3, 11, dtype=F64)
    with cg.no_weight_gradients():
        got = torch.autograd.grad(program(x).square().sum(), [program.weight])[0]  # type: ignore[arg-type]
        (want,) = torch.autograd.grad(ref(x).square().sum(), [ref.weight])
    torch.testing.assert_close(got, want, **TOL[F64])
    # while convgrad's own module honours it
    with cg.no_weight_gradients():
        (unused,) = torch.autograd.grad(ours(x.requires_grad_()).square().sum(), [ours.weight], allow_unused=True)
    assert unused is None


@pytest.mark.slow  # about 30 exports
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
@pytest.mark.parametrize("case", TORCH_MODULES + PATCHED_MODELS, ids=lambda c: c[0])
def test_every_module_exports_with_dynamic_shapes(case: tuple[str, Callable[[], torch.nn.Module], int, int, int],
                                                  strict: bool) -> None:
    """Every convgrad.nn class (1d/2d/3d, transposed with output_padding, groups, dilation, 'same' with an even
    kernel, a padding mode) as a drop-in module and patched, and the patched models: torch's at every size."""
    _, _, n, channels, smallest = case
    for patched in ([False, True] if case in TORCH_MODULES else [True]):
        ours, ref = _twins(case, patched)
        program = _export(ours, n, channels, smallest, strict)
        _assert_aten_only(program)
        _assert_torchs(program.module(), ref, n, channels, smallest)


def test_export_of_a_functional_call_is_torchs() -> None:
    """convgrad.conv2d called in a module's forward (backend auto, which may tune an fft forward eagerly): the
    program holds torch's exact convolution."""

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(3, 1, 9, 9, dtype=F64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return cg.conv2d(x, self.weight, padding=4, groups=3)

    net = Net()
    x = torch.randn(2, 3, 20, 20, dtype=F64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        program = torch.export.export(net, (x,), dynamic_shapes=({0: Dim("batch", max=16), 3: Dim("w", min=9,
                                                                                               max=64)},))
    _assert_aten_only(program)
    x2 = torch.randn(5, 3, 20, 33, dtype=F64)
    torch.testing.assert_close(program.module()(x2), F.conv2d(x2, net.weight, padding=4, groups=3), **TOL[F64])
