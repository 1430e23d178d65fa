"""pytest plugin for test_opacus_suite.py: Opacus's own test modules, run in a subprocess, with
``convgrad.opacus.register()`` in effect when CONVGRAD_OPACUS_REGISTER=1; it reports how often our conv rule ran.

Opacus's ghost-clipping module test imports torchvision for FakeData, two transforms and mobilenet_v3_small.
torchvision is no dependency of convgrad, and the registry holds none for the pinned torch (0.29 needs torch 2.14),
so where it is missing a stand-in gives FakeData (seeded uniform images, as ToTensor would give), Compose,
ToTensor and Normalize, and a mobilenet_v3_small that skips the one test that calls it (Opacus refusing
mobilenet's BatchNorm). Both runs, with and without the registration, get it.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types
from typing import Any

import torch

_calls: list[int] = []


class _FakeData(torch.utils.data.Dataset):
    def __init__(self, size: int = 1000, image_size: tuple[int, ...] = (3, 224, 224), num_classes: int = 10,
                 transform: Any = None, target_transform: Any = None, random_offset: int = 0) -> None:
        self.size, self.image_size, self.num_classes = size, image_size, num_classes
        self.transform, self.target_transform, self.offset = transform, target_transform, random_offset

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        gen = torch.Generator().manual_seed(index + self.offset)
        image = torch.rand(self.image_size, generator=gen)  # (C, H, W) in [0, 1)
        target = int(torch.randint(0, self.num_classes, (1,), generator=gen))
        image = self.transform(image) if self.transform else image
        return image, (self.target_transform(target) if self.target_transform else target)


class _Compose:
    def __init__(self, transforms: list[Any]) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class _ToTensor:
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _Normalize:
    def __init__(self, mean: list[float], std: list[float]) -> None:
        self.mean, self.std = torch.tensor(mean), torch.tensor(std)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.view(-1, 1, 1)) / self.std.view(-1, 1, 1)  # (C, H, W)


def _mobilenet_v3_small(*args: Any, **kwargs: Any) -> Any:
    import unittest

    raise unittest.SkipTest("torchvision stand-in: mobilenet_v3_small needs the real torchvision")


def _install_torchvision_stand_in() -> None:
    root = types.ModuleType("torchvision")
    parts = {"transforms": {"Compose": _Compose, "ToTensor": _ToTensor, "Normalize": _Normalize},
             "datasets": {"FakeData": _FakeData}, "models": {"mobilenet_v3_small": _mobilenet_v3_small}}
    for name, attrs in parts.items():
        module = types.ModuleType(f"torchvision.{name}")
        module.__dict__.update(attrs)
        setattr(root, name, module)
        sys.modules[module.__name__] = module
    sys.modules["torchvision"] = root


def pytest_configure(config: Any) -> None:
    if importlib.util.find_spec("torchvision") is None:
        _install_torchvision_stand_in()
    examples = os.environ.get("CONVGRAD_OPACUS_EXAMPLES")
    if examples:  # Opacus's tests set only a deadline: the loaded profile gives the number of examples
        from hypothesis import settings

        settings.register_profile("convgrad-opacus", max_examples=int(examples))
        settings.load_profile("convgrad-opacus")
    if os.environ.get("CONVGRAD_OPACUS_REGISTER") == "1":
        import convgrad.opacus
        from convgrad.per_sample import rules

        convgrad.opacus.register()
        init = rules.ConvLayer.__init__

        def counted(self: Any, *args: Any, **kwargs: Any) -> None:
            _calls.append(1)
            init(self, *args, **kwargs)

        rules.ConvLayer.__init__ = counted  # type: ignore[method-assign]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    terminalreporter.write_line(f"convgrad conv rule calls: {len(_calls)}")
