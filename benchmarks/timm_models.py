"""timm's conv architectures as DP practitioners train them: BatchNorm replaced by GroupNorm, no pretrained weights.

Used by benchmarks/per_sample_models.py (its timm models) and tests/test_timm.py (the full tier's oracle). timm is
installed without its dependencies (benchmarks/requirements.txt): the registry has no CPU wheel of torchvision for
this torch, and where torchvision is missing tests/stubs gives the few names timm imports at module level.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from torch import nn

STUBS = Path(__file__).resolve().parents[1] / "tests" / "stubs"


def import_timm() -> ModuleType:
    """timm, with the tests' torchvision stand-in on the path where torchvision is not installed.

    Raises:
        ImportError: timm is not installed (``pip install --no-deps -c constraints.txt -r
            benchmarks/requirements.txt``).
    """
    try:
        import torchvision  # noqa: F401
    except ImportError:
        if str(STUBS) not in sys.path:
            sys.path.append(str(STUBS))  # after site-packages: a real torchvision installed later still wins
    import timm

    return timm


def batch_norm_to_group_norm(model: nn.Module) -> None:
    """Every BatchNorm (timm's BatchNormAct2d included: its act stays) becomes a GroupNorm of up to 32 groups of two
    channels or more (a group of one channel on a 1x1 map normalises a single value: an error in torch)."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.modules.batchnorm._BatchNorm):
                c = child.num_features
                groups = next(g for g in (32, 16, 8, 4, 2, 1) if c % g == 0 and c // g >= min(2, c))
                norm: nn.Module = nn.GroupNorm(groups, c, affine=child.affine)
                if type(child) is not nn.BatchNorm2d and hasattr(child, "act"):  # timm's BatchNormAct2d
                    norm = nn.Sequential(norm, child.drop, child.act)
                setattr(parent, name, norm)


def create(name: str, classes: int, groupnorm: bool = True) -> nn.Module:
    """timm's model ``name`` with ``classes`` outputs, no dropout or stochastic depth, in training mode; BatchNorm
    replaced by GroupNorm (``groupnorm``). Its in-place activations and additions stay as timm wrote them."""
    timm = import_timm()
    try:
        model = timm.create_model(name, pretrained=False, num_classes=classes, drop_rate=0.0, drop_path_rate=0.0)
    except TypeError:  # a model without stochastic depth
        model = timm.create_model(name, pretrained=False, num_classes=classes, drop_rate=0.0)
    if groupnorm:
        batch_norm_to_group_norm(model)
    return model.train()


def inplace_off(model: nn.Module) -> int:
    """Turn off the ``inplace`` flag of every module that has one (timm's activations, ReLU, ...): Opacus's backward
    hooks refuse a module whose output is changed in place. Returns how many modules had it on."""
    count = 0
    for m in model.modules():
        if getattr(m, "inplace", False) is True:
            m.inplace = False
            count += 1
    return count

