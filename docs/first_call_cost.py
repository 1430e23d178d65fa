"""What the first training step costs with backend "auto": the table on docs/backends.md.

Each mode runs in a fresh process (a new process starts with no tuned choice in memory), on a
small CIFAR-sized CNN patched with ``convgrad.patch`` (batch 32, 3x32x32 inputs, five convs:
plain, strided, depthwise, pointwise, strided). It prints a Markdown table, one row per mode: the
first step (forward and backward) and the median of the next ten, in milliseconds, and a line
naming the machine and its load.

    python docs/first_call_cost.py           # print the table
    python docs/first_call_cost.py --write   # and put it into docs/backends.md, between its markers

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

PAGE = Path(__file__).with_name("backends.md")
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


def table() -> str:
    """Run every mode in its own process; the Markdown table and the line about the machine."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    rows = ["| run | first step (ms) | later steps, median (ms) |", "|---|---|---|"]
    loads = [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    with tempfile.TemporaryDirectory() as tmp:
        cache = str(Path(tmp) / "autotune.json")
        for label, (backend, env) in MODES.items():
            child_env = {**os.environ, **env, "CONVGRAD_AUTOTUNE_CACHE": cache if "process" in label else "",
                         "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
            out = subprocess.run([sys.executable, __file__, "--child", backend or "torch"], env=child_env,
                                 capture_output=True, text=True, check=True).stdout
            t = json.loads(out.splitlines()[-1])
            rows.append(f"| {label} | {t['first'] * 1e3:.0f} | {t['then'] * 1e3:.0f} |")
            loads += [os.getloadavg()[0]] if hasattr(os, "getloadavg") else []
    sys.path.insert(0, src)  # this clone's convgrad, as in the children
    import torch

    from convgrad.tuning import device_name

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = f", load average {min(loads):.1f} to {max(loads):.1f} while it ran" if loads else ""
    machine = f"Measured on {device_name(torch.device('cpu'))}, {cores} cores, torch {torch.__version__}{load}."
    return "\n".join(rows) + "\n\n" + machine + "\n"


def write(text: str, page: Path = PAGE) -> None:
    """Put the table between the page's first-call-cost markers."""
    start, end = "<!-- first-call-cost: python docs/first_call_cost.py --write -->\n", "<!-- /first-call-cost -->"
    before, found, rest = page.read_text().partition(start)
    if not found or end not in rest:
        raise SystemExit(f"{page}: no {start.strip()} ... {end} markers")
    page.write_text(before + start + text + end + rest.split(end, 1)[1])


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(one_run(None if sys.argv[2] == "torch" else sys.argv[2])))
        return 0
    if sys.argv[1:] not in ([], ["--write"]):
        raise SystemExit("usage: python docs/first_call_cost.py [--write]")
    text = table()
    print(text, end="")
    if sys.argv[1:] == ["--write"]:
        write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
