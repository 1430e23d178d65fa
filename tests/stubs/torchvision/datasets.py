"""Stand-in for torchvision.datasets: timm's dataset factory names these classes at import time."""

from typing import Any


class Unavailable:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("torchvision stand-in: datasets are not available")


CIFAR10 = CIFAR100 = MNIST = KMNIST = FashionMNIST = ImageFolder = Unavailable
Places365 = INaturalist = QMNIST = ImageNet = Unavailable
