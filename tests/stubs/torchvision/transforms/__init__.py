"""Stand-in for torchvision.transforms: timm's data package subclasses and names its transforms at import time."""

from typing import Any


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)

    class Unavailable:
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"torchvision stand-in: transforms.{name} is not available")

    Unavailable.__name__ = name
    globals()[name] = Unavailable
    return Unavailable
