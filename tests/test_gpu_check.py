"""benchmarks/gpu_check.sh and gpu_per_sample.py, as far as a machine without CUDA can check them."""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})


def test_the_script_parses_and_its_steps_fit_the_time_limits() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    done = _run("--dry-run", "--out", "results")
    assert done.returncode == 0, done.stderr
    steps = [line.split(" (timeout ") for line in done.stdout.splitlines()]
    assert [name for name, _ in steps] == ["environment", "tests-cuda", "bench", "per-sample"]
    limits = [int(rest.split("s)")[0]) for _, rest in steps]
    assert max(limits) <= 600 and sum(limits) <= 8 * 60, limits  # no command over 10 minutes; about 8 in all
    assert all("results" in rest for _, rest in steps[1:]), "every result goes to the one folder"
    assert "-k cuda" in steps[1][1] and "--device cuda" in steps[2][1] and "--device cuda" in steps[3][1]


def test_each_bench_pattern_names_layers_of_the_suite() -> None:
    """The layer names can change under the script: each pattern must still select something."""
    bench = next(line for line in _run("--dry-run").stdout.splitlines() if line.startswith("bench "))
    words = shlex.split(bench.split("): ", 1)[1])
    patterns = words[words.index("--layers") + 1:]
    from convgrad.cli.bench.layers import SUITES

    names = [layer.name for layer in SUITES["default"]]  # the suite `convgrad bench` runs without --suite
    assert patterns and all(fnmatch.filter(names, pattern) for pattern in patterns), (patterns, names)


@pytest.mark.slow  # runs the script: fresh interpreters
def test_without_cuda_it_stops_with_one_clear_line(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path / "out"), CUDA_VISIBLE_DEVICES="")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "gpu_check.sh: torch sees no CUDA device (torch.cuda.is_available() is False); run it on a CUDA machine"]
    assert not (tmp_path / "out").exists()
    bad = _run("--fast")
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu_check.sh: unknown argument '--fast' (use --out DIR, " \
                                                         "--dry-run)"


@pytest.mark.slow  # runs the script: fresh interpreters
def test_the_per_sample_step_runs_on_the_cpu(tmp_path: Path) -> None:
    """The same code the GPU step runs, tiny: it still finds per_sample.py's models and contenders."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_per_sample", ROOT / "benchmarks" / "gpu_per_sample.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    args = ["--device", "cpu", "--models", "resnet18", "--batch", "2", "--image-size", "8", "--repeats", "1",
            "--out", str(tmp_path)]
    assert module.main(args) == 0
    rows = json.loads((tmp_path / "per_sample.json").read_text())
    assert [(r["contender"], r["quantity"]) for r in rows] == [
        ("plain", None), ("convgrad", "a"), ("convgrad", "c"), ("torch.func", "a"), ("torch.func", "c")]
    assert all(r["median_s"] > 0 and len(r["times_s"]) == 1 for r in rows)
    assert (tmp_path / "per_sample.md").read_text().count("| resnet18 |") == 5
