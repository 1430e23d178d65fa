"""Stand-in for torchvision.ops.misc: timm subclasses and isinstance-checks FrozenBatchNorm2d."""

import torch


class FrozenBatchNorm2d(torch.nn.Module):
    """Never built by the architectures tested (timm freezes BatchNorm only when asked)."""

    def __init__(self, num_features: int, eps: float = 1e-5) -> None:
        super().__init__()
        raise RuntimeError("torchvision stand-in: FrozenBatchNorm2d is not available")
