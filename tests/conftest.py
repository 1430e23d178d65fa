import os
import sys
from pathlib import Path

# backend="auto" is native in the tests: deterministic and fast (tests/test_auto.py switches tuning on)
os.environ.setdefault("CONVGRAD_AUTOTUNE", "fixed")

import pytest
import torch

# the tests import their one helper module as `helpers`
sys.path.insert(0, str(Path(__file__).parent))

_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=_CUDA)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every device a test should run on: the CPU, and CUDA when present with TF32 off (float32 means float32)."""
    if request.param == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(request.param)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many configurations and frames tests/test_explain_frames.py checked against the Jacobian, per profile."""
    frames = sys.modules.get("test_explain_frames")
    for line in frames.tally_lines() if frames is not None else []:
        terminalreporter.write_line(line)
