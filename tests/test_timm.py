"""timm's architectures as the oracle (issue 38), full tier: every conv call a patched model makes reaches convgrad
and its gradients are torch's; PerSampleGrads (BatchNorm replaced by GroupNorm, as DP practitioners do) equals a
one-sample-at-a-time loop for every trainable parameter, in full, norms_only and patched modes, clipped sum
included; and so do Opacus's hooks and ghost modes with ``convgrad.opacus.register()``. float64, batch 2, no
pretrained weights (nothing is downloaded). The fast tier runs small copies of timm's layer patterns
(tests/patterns.py).

timm is installed without its dependencies (``.ci/run``): the registry has no CPU wheel of torchvision for this
torch, and tests/stubs holds a stand-in for the few names timm imports at module level. The models are built as
benchmarks/per_sample.py builds its timm models (benchmarks/timm_models.py: BatchNorm to GroupNorm).
"""

from __future__ import annotations

import copy
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import convgrad as cg
from convgrad.backends import auto
from helpers import TOL, load_script, opacus_private_step, per_sample_loop

timm_models = load_script("timm_models", Path(__file__).resolve().parents[1] / "benchmarks" / "timm_models.py")
# .ci/run installs timm: its absence there is a failure, not a skip
if not os.environ.get("CI") and importlib.util.find_spec("timm") is None:
    pytest.skip("timm is not installed", allow_module_level=True)

DT = torch.float64
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.filterwarnings("ignore::FutureWarning")]

# conv architectures of timm 1.0, their smallest variants (under 30M parameters: in float64 a model's per-sample
# gradients, its loop reference and a patched copy are several copies of it), at 32x32 (64x64 where a model needs
# it): plain convs,
# strided, dilated, grouped, depthwise, band kernels, Conv2dSame, StdConv2d, ScaledStdConv2d, BlurPool2d, timm's
# Linear and LayerNorm2d, layer-scale gammas, squeeze-excitation, selective kernels, split attention
ARCHS = {
    "resnet18": 32, "resnet26d": 32, "resnext26ts": 32, "seresnext26d_32x4d": 32, "resnetblur18": 32,
    "regnetx_002": 32, "regnety_002": 32, "regnetz_005": 32, "efficientnet_b0": 32, "efficientnet_lite0": 32,
    "tf_efficientnet_b0": 32, "tf_efficientnetv2_b0": 32, "efficientnetv2_rw_t": 32, "mobilenetv2_050": 32,
    "mobilenetv3_small_050": 32, "mobilenetv3_large_075": 32, "mnasnet_050": 32, "fbnetc_100": 32,
    "spnasnet_100": 32, "mixnet_s": 32, "tf_mixnet_s": 32, "ghostnet_100": 32, "ghostnetv2_100": 64,
    "lcnet_050": 32, "hardcorenas_a": 32, "tinynet_e": 32, "semnasnet_050": 32, "convnext_atto": 32,
    "convnext_femto": 32, "convnextv2_atto": 32, "nf_resnet26": 32, "nf_regnet_b0": 32, "eca_nfnet_l0": 32,
    "cspresnet50": 32, "cspdarknet53": 32, "dla34": 32, "dla46_c": 32, "dpn48b": 32, "hrnet_w18_small": 64,
    "ese_vovnet19b_dw": 32, "rexnet_100": 32, "repvgg_a0": 32, "res2net50_14w_8s": 32, "skresnet18": 32,
    "selecsls42b": 32, "gernet_s": 32, "resnest14d": 32, "mobileone_s0": 32, "repghostnet_050": 32,
    "hgnet_tiny": 32, "hgnetv2_b0": 32, "resnetv2_50x1_bit": 32, "resnet10t": 32, "mobilenetv4_conv_small": 32,
    "cs3darknet_s": 32, "densenet121": 32,
}
# where Opacus itself runs them (its backward hooks refuse an in-place op on a module's output: resnet's
# `x += shortcut`), in-place activations off
OPACUS = ["efficientnet_b0", "tf_efficientnet_b0", "mobilenetv3_small_050", "regnetx_002", "nf_resnet26",
          "convnext_atto", "mnasnet_050", "lcnet_050"]


def _model(name: str, groupnorm: bool) -> nn.Module:
    return timm_models.create(name, 3, groupnorm).to(DT)


def _input(name: str, n: int = 2) -> torch.Tensor:
    size = ARCHS[name]
    return torch.randn(n, 3, size, size, dtype=DT, generator=torch.Generator().manual_seed(0))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return ((out * torch.linspace(-1, 1, out.shape[1], dtype=out.dtype)).sum(1) + out.square().sum(1)).sum()


def _close(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str) -> None:
    """Within float64's tolerance of the largest entry: a true gradient of 0 (a bias right before a norm that
    removes it) holds rounding noise of ~1e-16 in both, no relative error can judge those."""
    scale = max(float(g.abs().max()) for g in ref.values())
    for k, g in ref.items():
        torch.testing.assert_close(got[k], g, rtol=TOL[DT]["rtol"], atol=TOL[DT]["rtol"] * scale, msg=f"{what}: {k}")


@pytest.mark.parametrize("name", list(ARCHS))
def test_patch_reaches_every_conv_call_and_keeps_torchs_gradients(name: str) -> None:
    torch.manual_seed(0)
    model = _model(name, groupnorm=False)
    x = _input(name)
    calls = cg.report(model, x).calls
    assert calls and all(c.backend == "torch" for c in calls)  # unpatched: torch runs every one
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    expected = dict(zip(params, torch.autograd.grad(_loss(model(x)), list(params.values())), strict=True))
    for backend in ("auto", "fwdconv", "fft"):
        patched = cg.patch(copy.deepcopy(model), backend=backend, force=True)  # fft on every layer
        routed = cg.report(patched, x)
        assert routed.reached == len(routed.calls) == len(calls), (backend, str(routed))
        with auto.tuning_mode("tune"):  # auto races its candidates (the tests default to its fixed mode)
            grads = torch.autograd.grad(_loss(patched(x)), [p for p in patched.parameters() if p.requires_grad])
        _close(dict(zip(params, grads, strict=True)), expected, f"{name} patched {backend}")


@pytest.mark.parametrize("name", list(ARCHS))
def test_per_sample_gradients_of_every_parameter_match_the_loop(name: str) -> None:
    torch.manual_seed(0)
    model = _model(name, groupnorm=True)
    x = _input(name)
    ref = per_sample_loop(model, _loss, x)
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    bound = float(norms.median())
    expected = {k: torch.tensordot((bound / (norms + 1e-6)).clamp(max=1.0), g, dims=1) for k, g in ref.items()}
    for mode in ("full", "norms_only", "patched"):
        m = cg.patch(copy.deepcopy(model), backend="fwdconv") if mode == "patched" else model
        params = {k: p for k, p in m.named_parameters() if p.requires_grad}
        m.zero_grad(set_to_none=True)
        with cg.PerSampleGrads(m, loss_reduction="sum", norms_only=mode == "norms_only") as psg:
            _loss(m(x)).backward()
        if mode != "norms_only":
            _close({k: p.grad_sample for k, p in params.items()}, ref, f"{name} {mode} grad_sample")
        torch.testing.assert_close(psg.norms(), norms, **TOL[DT], msg=f"{name} {mode} norms")
        assert set(psg.report()) == set(params)  # every trainable parameter reached, and says how
        m.zero_grad(set_to_none=True)
        psg.clip_and_accumulate(bound)
        _close({k: p.grad for k, p in params.items()}, expected, f"{name} {mode} clipped sum")


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
@pytest.mark.parametrize("name", OPACUS)
def test_opacus_with_registered_rules_clips_like_the_loop(name: str, mode: str) -> None:
    import convgrad.opacus

    torch.manual_seed(0)
    model = _model(name, groupnorm=True)
    timm_models.inplace_off(model)
    x, y = _input(name, 3), torch.tensor([0, 2, 1])
    loss = nn.CrossEntropyLoss(reduction="sum")
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in params}
    for i in range(3):
        for k, g in zip(params, torch.autograd.grad(loss(model(x[i:i + 1]), y[i:i + 1]), list(params.values())),
                        strict=True):
            rows[k].append(g)
    ref = {k: torch.stack(v) for k, v in rows.items()}
    norms = torch.cat([g.flatten(1) for g in ref.values()], 1).norm(dim=1)
    bound = float(norms.median())
    expected = {k: torch.tensordot((bound / (norms + 1e-6)).clamp(max=1.0), g, dims=1) for k, g in ref.items()}
    convgrad.opacus.register()
    try:
        got = opacus_private_step(model, x, y, mode, bound)
        _close(got, expected, f"{name} Opacus {mode}")
    finally:
        convgrad.opacus.unregister()


def test_the_architectures_cover_what_issue_38_names() -> None:
    """At least 50 conv architectures, with each pattern of a real model present."""
    assert len(ARCHS) >= 50
    layers: set[str] = set()
    for name in ("nf_resnet26", "tf_efficientnet_b0", "resnetblur18", "convnext_atto", "resnetv2_50x1_bit",
                 "mobilenetv3_small_050"):
        layers |= {type(m).__name__ for m in _model(name, groupnorm=False).modules()}
    assert {"ScaledStdConv2d", "Conv2dSame", "BlurPool2d", "LayerNorm2d", "StdConv2d", "Linear"} <= layers
