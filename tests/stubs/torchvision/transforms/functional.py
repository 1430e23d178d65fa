"""Stand-in for torchvision.transforms.functional: InterpolationMode, and any other name as a function that raises."""

import enum
from typing import Any


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(f"torchvision stand-in: transforms.functional.{name} is not available")

    return unavailable
