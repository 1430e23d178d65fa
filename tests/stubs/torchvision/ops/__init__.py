"""Stand-in for torchvision.ops (see the package doc)."""
