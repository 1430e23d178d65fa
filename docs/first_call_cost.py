"""What the first training step costs with backend "auto": the table on docs/backends.md.

Each mode runs in a fresh process (a new process starts with no tuned choice in memory), on a
small CIFAR-sized CNN patched with ``convgrad.patch`` (batch 32, 3x32x32 inputs, five convs:
plain, strided, depthwise, pointwise, strided). It prints one Markdown row per mode: the first
step (forward and backward) and the median of the next ten, in milliseconds.

    PYTHONPATH=src python docs/first_call_cost.py

Timings depend on the machine and its load; rerun it on yours.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {  # label -> (convgrad backend or None for plain torch, environment)
    "torch.nn, not patched": (None, {}),
    "auto, CONVGRAD_AUTOTUNE=fixed": ("auto", {"CONVGRAD_AUTOTUNE": "fixed"}),
    "auto, first process (tunes)": ("auto", {"CONVGRAD_AUTOTUNE": "tune"}),
    "auto, later process (choices from the cache file)": ("auto", {"CONVGRAD_AUTOTUNE": "tune"}),
}


def one_run(backend: str | None) -> dict[str, float]:
    """Time the first step and the ten after it; runs in the child process."""
    import torch
    from torch import nn

    import convgrad as cg

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),  # (N, 64, 16, 16)
        nn.Conv2d(64, 64, 3, padding=1, groups=64), nn.Conv2d(64, 128, 1), nn.ReLU(),
        nn.Conv2d(128, 128, 3, stride=2, padding=1), nn.ReLU(),  # (N, 128, 8, 8)
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10))
    if backend is not None:
        cg.patch(model, backend=backend)
    x = torch.randn(32, 3, 32, 32)
    times = []
    for _ in range(11):
        start = time.perf_counter()
        model(x).sum().backward()
        times.append(time.perf_counter() - start)
    return {"first": times[0], "then": statistics.median(times[1:])}


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(one_run(None if sys.argv[2] == "torch" else sys.argv[2])))
        return 0
    src = str(Path(__file__).resolve().parents[1] / "src")
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "autotune.json")
        print("| run | first step (ms) | later steps, median (ms) |\n|---|---|---|")
        for label, (backend, env) in MODES.items():
            child_env = {**os.environ, **env, "CONVGRAD_AUTOTUNE_CACHE": cache if "process" in label else "",
                         "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
            out = subprocess.run([sys.executable, __file__, "--child", backend or "torch"], env=child_env,
                                 capture_output=True, text=True, check=True).stdout
            t = json.loads(out.splitlines()[-1])
            print(f"| {label} | {t['first'] * 1e3:.0f} | {t['then'] * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
