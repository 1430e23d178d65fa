import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

# backend="auto" is native in the tests: deterministic and fast (tests/test_auto.py switches tuning on)
os.environ.setdefault("CONVGRAD_AUTOTUNE", "fixed")

import pytest
import torch
from hypothesis import HealthCheck, settings

# the tests import their one helper module as `helpers`
sys.path.insert(0, str(Path(__file__).parent))

# One thread for the whole run: the tensors are tiny, and with more threads than free cores every op waits on the
# thread pool (tens of ms instead of microseconds on a loaded 2-core machine). CONVGRAD_TEST_THREADS overrides.
torch.set_num_threads(int(os.environ.get("CONVGRAD_TEST_THREADS", "1")))

# Hypothesis profiles, chosen by CONVGRAD_FUZZ_PROFILE: "fast" (the default, `python -m pytest`), "ci" (the full
# run, .ci/run), "thorough" (by hand, random seed). Fixed seeds and no example database keep the first two
# reproducible; tests that set max_examples themselves keep that count and take the rest from the profile.
_COMMON: dict[str, Any] = dict(deadline=None, database=None, print_blob=True,
                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                      HealthCheck.function_scoped_fixture])
settings.register_profile("convgrad-fast", max_examples=40, derandomize=True, **_COMMON)
settings.register_profile("convgrad-ci", max_examples=300, derandomize=True, **_COMMON)
settings.register_profile("convgrad-thorough", max_examples=10_000, **_COMMON)
PROFILE = "convgrad-" + os.environ.get("CONVGRAD_FUZZ_PROFILE", "fast")
settings.load_profile(PROFILE)

NO_CUDA = "no CUDA device"
_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=_CUDA)])
def device(request: pytest.FixtureRequest) -> torch.device:
    """Every device a test should run on: the CPU, and CUDA when present with TF32 off (float32 means float32)."""
    if request.param == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return torch.device(request.param)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread for a module of tiny convolutions (``pytestmark = pytest.mark.usefixtures("one_thread")``):
    with more threads than free cores each waits on the thread pool (tens of ms on a loaded machine instead of
    microseconds). The judge is torch at run time, on the same thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tuned() -> Iterator[None]:
    """auto's tuning mode on (backends and per-sample methods), with nothing remembered before or after."""
    from convgrad.backends import auto

    auto.clear()
    with auto.tuning_mode("tune"):
        yield
    auto.clear()


@pytest.fixture
def fft_plan_constants(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """A setter of ``convgrad.backends.fft.chunking``'s constants for one test
    (``fft_plan_constants(CHUNK_MIN_REALS=1)``): ``plans.plan`` is cached, so its cache is cleared with each change
    and after the test, when the old values are back (it would otherwise hand out plans made under the other values).
    """
    from convgrad.backends.fft import chunking, plans

    def set_constants(**values: int) -> None:
        for name, value in values.items():
            monkeypatch.setattr(chunking, name, value)
        plans.plan.cache_clear()
        plans.backward_plan.cache_clear()

    yield set_constants
    monkeypatch.undo()
    plans.plan.cache_clear()
    plans.backward_plan.cache_clear()


def pytest_report_header(config: pytest.Config) -> str:
    return f"convgrad: torch {torch.__version__}, {torch.get_num_threads()} thread(s), hypothesis profile {PROFILE}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Why the CUDA tests were skipped, in one line; and how many configurations and frames
    tests/test_explain_frames.py checked against the Jacobian, per profile."""
    cuda = sum(NO_CUDA in str(r.longrepr) for r in terminalreporter.stats.get("skipped", []))
    if cuda:
        terminalreporter.write_line(f"convgrad: {cuda} CUDA tests skipped: no GPU on this machine "
                                    "(they run wherever torch.cuda.is_available())")
    frames = sys.modules.get("test_explain_frames")
    for line in frames.tally_lines() if frames is not None else []:
        terminalreporter.write_line(line)
