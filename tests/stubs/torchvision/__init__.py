"""A stand-in for torchvision, for timm's imports in tests/test_timm.py only: the registry has no CPU wheel of
torchvision for torch 2.13, and timm names a few of its classes at import time. Nothing here computes anything
timm's models run; using any of it raises."""
