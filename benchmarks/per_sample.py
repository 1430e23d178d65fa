"""Per-sample gradients on CPU: convgrad against Opacus, BackPACK, torch.func and a plain backward.

Models (benchmarks/per_sample_models.py, batch 32, float32): a small CNN, a CIFAR ResNet-18 (GroupNorm),
VGG-11, WRN-16-4 (GroupNorm, no weight standardisation), a 1d conv net with wav2vec 2.0's strided kernels,
a U-Net with ConvTranspose2d, a RepLKNet-style net, and five of timm's as DP practitioners take them (BatchNorm
replaced by GroupNorm, 32x32, 10 classes; skipped where timm is not installed): efficientnet_b0, convnext_atto,
mobilenetv3_small_100, regnetx_002, nf_resnet26. Quantities, one training step each:
    a  all per-sample gradients (N, *param.shape)
    b  per-sample gradient norms only (N,)
    c  one clipped, summed DP-SGD gradient (.grad = sum_n clip(g_n, C))
Contenders: plain (a non-private backward, the floor), convgrad (PerSampleGrads), opacus (hooks mode:
GradSampleModule, DPOptimizer's clipping), opacus-ghost (fast gradient clipping, (c) only),
opacus-ghost+convgrad (the same with ``convgrad.opacus.register()``, when convgrad.opacus exists),
backpack (BatchGrad, BatchL2Grad), torch.func (vmap of grad). A contender that is not installed is skipped, with a
row that says so. Opacus and BackPACK work through module backward hooks, which fail on timm's in-place activations;
where they do, the failure stays in the table and the contender runs again as "<name>, in-place off" on a copy with
every module's ``inplace`` flag off (``INPLACE_OFF``); the targets compare convgrad with the peers that ran the
unmodified model only.

Time: per model, every (contender, quantity) is set up in one process on its own copy of the model;
after two warm-up steps (the first one's time is kept: it includes convgrad's tuning), the steps run in
interleaved rounds (the order rotating) and each time is divided by plain's in the same round: the
table gives the median of those ratios over the rounds and their IQR, and the median time. One step's
time varies 6-34% within a process on a shared machine; pairing within a round cancels load that comes
and goes. CPU time (all threads) is reported beside wall time: a contender using one core of two shows
CPU/wall near 1. Memory: each (model, contender, quantity) runs again in two fresh processes, two steps each
(the first one includes convgrad's tuning), measured from the point where the model, the data and the contender's
wrappers are set up. "peak RSS" is the process's peak resident memory (VmHWM) minus its RSS at that point: what
the machine must have, glibc's heap fragmentation and oneDNN's scratchpads included. "peak allocated" is the peak
of the bytes live in PyTorch's CPU allocator during the two steps (the torch profiler's memory events, the
counterpart of ``torch.cuda.max_memory_allocated``): the tensors a method needs, whatever the allocator, given
for the second step (steady; buffers kept from the first count) and for the first (convgrad's tuning included).
Allocation: as in ``convgrad bench`` (``--malloc keep``, the default), the timing process asks glibc to keep
freed memory, so that a step's tensors of hundreds of MB reuse pages instead of faulting fresh ones in: in one
process holding every contender, VGG-11's (a) step of every contender was dominated by page faults and
kernel page zeroing (system time). ``--malloc system`` times as is. The memory processes always run as is.

Usage (extra libraries: benchmarks/requirements.txt, installed as in benchmarks/README.md):
    PYTHONPATH=src python benchmarks/per_sample.py --threads 2 --repeats 7
    PYTHONPATH=src python benchmarks/per_sample.py --models small_cnn resnet18 --quantities c --repeats 3
    PYTHONPATH=src python benchmarks/per_sample.py --models replknet_small --quantities b c --batch 4 --repeats 1
        (a quick check that a model runs; the targets are taken at the default batch of 32)
    PYTHONPATH=src python benchmarks/per_sample.py --models efficientnet_b0 convnext_atto mobilenetv3_small_100 \
        regnetx_002 nf_resnet26 --threads 2 --repeats 7 --out benchmarks/results/per_sample_timm
Results go to benchmarks/results/per_sample.{json,md}.
"""

from __future__ import annotations

import argparse
import copy
import gc
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
import timm_models
from per_sample_models import CLASSES, INPUT_SHAPES, MODELS, TIMM, timm_available

BATCH, MAX_NORM = 32, 1.0
CONTENDERS = ["plain", "convgrad", "opacus", "opacus-ghost", "opacus-ghost+convgrad", "backpack", "torch.func"]
QUANTITIES = {"a": "all per-sample gradients", "b": "per-sample norms only", "c": "clipped summed gradient"}
ONLY_C = {"opacus-ghost", "opacus-ghost+convgrad"}  # fast gradient clipping yields the clipped sum only


def available(contender: str) -> bool:
    need = {"opacus": "opacus", "opacus-ghost": "opacus", "backpack": "backpack"}.get(contender)
    if contender == "opacus-ghost+convgrad":
        return all(importlib.util.find_spec(m) is not None for m in ("opacus", "convgrad.opacus"))
    return need is None or importlib.util.find_spec(need) is not None


# ---- contenders: setup(model, quantity) once, then step(x, y) per measured step, release() after it ------------
def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The step's loss: cross-entropy summed over the batch (every contender takes loss_reduction="sum")."""
    return F.cross_entropy(out, y, reduction="sum")


def _zero(model: nn.Module) -> None:
    for p in model.parameters():
        p.grad = None
        for attr in ("grad_sample", "grad_batch", "batch_l2", "summed_grad", "_norm_sample"):
            if getattr(p, attr, None) is not None:
                setattr(p, attr, None)


def _clip_sum(per_sample: list[torch.Tensor], params: list[nn.Parameter]) -> None:
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample]).norm(dim=0)
    factors = (MAX_NORM / (norms + 1e-6)).clamp(max=1.0)
    for p, g in zip(params, per_sample, strict=True):
        p.grad = torch.tensordot(factors, g, dims=1)


def setup_plain(model: nn.Module, quantity: str) -> Any:
    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        loss(model(x), y).backward()
    return step


def setup_convgrad(model: nn.Module, quantity: str) -> Any:
    import convgrad as cg

    psg = cg.PerSampleGrads(model, loss_reduction="sum", norms_only=quantity != "a")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with psg:
            loss(model(x), y).backward()
        if quantity == "b":
            psg.norms()
        elif quantity == "c":
            psg.clip_and_accumulate(MAX_NORM)
        psg.clear()  # .grad_sample and the kept state go, as the next step's context would drop them
    return step


def _private(model: nn.Module, mode: str) -> tuple[Any, Any, Any]:
    from opacus import PrivacyEngine

    x, y = torch.zeros(BATCH, 1), torch.zeros(BATCH, dtype=torch.long)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    criterion = nn.CrossEntropyLoss(reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its secure RNG and accountant warnings
        made = PrivacyEngine().make_private(module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                            data_loader=loader, noise_multiplier=0.0, max_grad_norm=MAX_NORM,
                                            poisson_sampling=False, loss_reduction="sum", grad_sample_mode=mode,
                                            criterion=criterion)
    return made[0], made[1], made[2] if mode == "ghost" else criterion


def setup_opacus(model: nn.Module, quantity: str) -> Any:
    gsm, opt, criterion = _private(model, "hooks")
    params = [p for p in gsm.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        criterion(gsm(x), y).backward()
        if quantity == "b":
            torch.stack([p.grad_sample.flatten(1).norm(dim=1) for p in params]).norm(dim=0)
        elif quantity == "c":
            opt.clip_and_accumulate()  # Opacus's own per-sample clipping, into p.summed_grad
    return step


def _ghost(model: nn.Module, ours: bool) -> Any:
    toggle = None
    if ours:
        import convgrad.opacus as toggle  # registered around each step: the other contenders run without it
    if toggle is not None:
        toggle.register()
    gsm, opt, criterion = _private(model, "ghost")
    if toggle is not None:
        toggle.unregister()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        if toggle is not None:
            toggle.register()
        try:
            opt.zero_grad(set_to_none=True)
            criterion(gsm(x), y).backward()  # two backward passes: norms, then the clipped sum into .grad
        finally:  # a step that raises (timm's in-place ops) must not leave the rules on for the next contender
            if toggle is not None:
                toggle.unregister()
    return step


def setup_opacus_ghost(model: nn.Module, quantity: str) -> Any:
    return _ghost(model, ours=False)


def setup_opacus_ghost_convgrad(model: nn.Module, quantity: str) -> Any:
    return _ghost(model, ours=True)


def setup_backpack(model: nn.Module, quantity: str) -> Any:
    from backpack import backpack, extend
    from backpack.extensions import BatchGrad, BatchL2Grad

    model = extend(model)
    params = [p for p in model.parameters() if p.requires_grad]
    owner = {id(p): type(m).__name__ for m in model.modules() for p in m.parameters(recurse=False)}

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with backpack(BatchL2Grad() if quantity == "b" else BatchGrad()):
            loss(model(x), y).backward()
        attr = "batch_l2" if quantity == "b" else "grad_batch"
        missing = sorted({owner[id(p)] for p in params if getattr(p, attr, None) is None})
        if missing:  # BackPACK extends the module types it knows and leaves the others' parameters without
            raise RuntimeError(f"BackPACK gives no per-sample {attr} to the parameters of {', '.join(missing)}")
        if quantity == "b":
            torch.stack([p.batch_l2 for p in params]).sum(0).sqrt()
        elif quantity == "c":
            _clip_sum([p.grad_batch for p in params], params)
    return step


def setup_torch_func(model: nn.Module, quantity: str) -> Any:
    from torch.func import functional_call, grad, vmap

    params = {k: p.detach() for k, p in model.named_parameters()}

    def loss_one(p: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss(functional_call(model, p, (x.unsqueeze(0),)), y.unsqueeze(0))

    per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))
    live = dict(model.named_parameters())

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        grads = per_sample(params, x, y)
        if quantity == "b":
            torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()]).norm(dim=0)
        elif quantity == "c":
            _clip_sum(list(grads.values()), [live[k] for k in grads])
        else:
            for k, g in grads.items():
                live[k].grad_sample = g
    return step


SETUPS = {"plain": setup_plain, "convgrad": setup_convgrad, "opacus": setup_opacus,
          "opacus-ghost": setup_opacus_ghost, "opacus-ghost+convgrad": setup_opacus_ghost_convgrad,
          "backpack": setup_backpack, "torch.func": setup_torch_func}
# Contenders built on module backward hooks (Opacus, BackPACK) fail on a model whose forward changes a module's
# output in place (timm's activations, ``inplace=True``: "Output 0 of BackwardHookFunction is a view and is being
# modified inplace"). Where one fails on a model that has such modules, it runs again as "<name>, in-place off" on a
# copy whose modules' ``inplace`` flags are off (``time_model``); the unmodified model's failure stays in the table
# beside it, and the targets compare convgrad only with contenders that ran the unmodified model.
INPLACE_OFF = ", in-place off"
HOOKED = ("opacus", "opacus-ghost", "opacus-ghost+convgrad", "backpack")


def _in_place_off(setup: Any) -> Any:
    def run(model: nn.Module, quantity: str) -> Any:
        timm_models.inplace_off(model)
        return setup(model, quantity)
    return run


SETUPS.update({name + INPLACE_OFF: _in_place_off(SETUPS[name]) for name in HOOKED})


def data(model_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's inputs (BATCH, *INPUT_SHAPES[model_name]) and labels (BATCH,), the same in every run."""
    g = torch.Generator().manual_seed(0)
    shape = INPUT_SHAPES[model_name]
    return torch.randn(BATCH, *shape, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


def _timed(step: Any, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    _zero(model)
    start, cpu = time.perf_counter(), time.process_time()
    step(x, y)
    out = time.perf_counter() - start, time.process_time() - cpu
    _zero(model)  # the results go before the next contender runs
    return out


# ---- timing: one process per model, every job interleaved ---------------------------------------------------
def time_model(model_name: str, jobs: list[tuple[str, str]], repeats: int) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    base = MODELS[model_name]()
    x, y = data(model_name)
    steps, models, errors, first = {}, {}, {}, {}
    inplace = timm_models.inplace_off(copy.deepcopy(base)) > 0
    jobs = list(jobs)
    for job in jobs:  # grows: a hook-based contender's failure on in-place modules adds its in-place-off run
        models[job] = copy.deepcopy(base)
        try:
            steps[job] = SETUPS[job[0]](models[job], job[1])
            first[job] = _timed(steps[job], models[job], x, y)[0]
            _timed(steps[job], models[job], x, y)
        except Exception as e:  # a contender that cannot handle the model (BackPACK and GroupNorm, say)
            errors[job] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            steps.pop(job, None)
            if inplace and job[0] + INPLACE_OFF in SETUPS:
                jobs.insert(jobs.index(job) + 1, (job[0] + INPLACE_OFF, job[1]))
    live = [j for j in jobs if j in steps]
    wall: dict[tuple[str, str], list[float]] = {j: [] for j in live}
    cpu: dict[tuple[str, str], list[float]] = {j: [] for j in live}
    for r in range(repeats):
        for job in live[r % len(live):] + live[:r % len(live)]:
            w, c = _timed(steps[job], models[job], x, y)
            wall[job].append(w)
            cpu[job].append(c)
    floor = wall.get(("plain", "-"))
    out = []
    for job in jobs:
        rec: dict[str, Any] = {"model": model_name, "contender": job[0], "quantity": job[1]}
        if job in errors:
            out.append({**rec, "error": errors[job]})
            continue
        rec.update(time_s=statistics.median(wall[job]), times_s=wall[job], cpu_s=statistics.median(cpu[job]),
                   first_s=first[job])
        if floor:
            ratios = sorted(t / f for t, f in zip(wall[job], floor, strict=True))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            rec.update(ratio=statistics.median(ratios), iqr=(q[0], q[2]))
        out.append(rec)
    return out


# ---- memory: one fresh process per job ------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    """A size from /proc/self/status: VmRSS (resident now) or VmHWM (the peak of this process image)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_allocated(trace: Path) -> dict[str, int]:
    """Peaks of live bytes in a chrome trace of ``profile(profile_memory=True)`` around two steps, each inside a
    ``record_function("step1")`` / ``("step2")``: {"step1": ..., "step2": ...}. The "[memory]" events carry the bytes
    of each allocation (positive) and free (negative) of PyTorch's CPU allocator. A block allocated before the
    profile began has no free event and does not count; one allocated in step 1 and still live (a reused
    workspace, say) counts in step 2 as well."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = {e["name"]: (e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name", "").startswith("step")
             and e.get("ph") == "X"}
    live, peaks = 0, dict.fromkeys(spans, 0)
    for e in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        live += e["args"]["Bytes"]
        for name, (lo, hi) in spans.items():
            if lo <= e["ts"] <= hi:
                peaks[name] = max(peaks[name], live)
    return peaks


def memory_worker(model_name: str, contender: str, quantity: str, kind: str) -> dict[str, Any]:
    """Two steps in this fresh process: "rss", the growth of peak RSS over both; "allocated", the peak of live
    tensor bytes in the first step (convgrad's tuning) and in the second (steady)."""
    torch.manual_seed(0)
    model = MODELS[model_name]()
    x, y = data(model_name)
    step = SETUPS[contender](model, quantity)
    gc.collect()
    if kind == "allocated":
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True,
                                        on_trace_ready=lambda prof: prof.export_chrome_trace(str(trace))):
                for name in ("step1", "step2"):
                    with torch.profiler.record_function(name):
                        _timed(step, model, x, y)
            peaks = peak_allocated(trace)
        return {"alloc_mib": peaks["step2"] / 2**20, "alloc_first_mib": peaks["step1"] / 2**20}
    base = _status_kib("VmRSS")
    for _ in range(2):
        _timed(step, model, x, y)
    # VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork and exec, so a worker started by a
    # parent that holds 3 GiB reported 3 GiB for every contender; VmHWM belongs to this process image alone
    peak = _status_kib("VmHWM")
    return {"peak_mib": (peak - base) / 1024}


def measure_memory(args: argparse.Namespace, model: str, contender: str, quantity: str) -> dict[str, float | str]:
    """{"peak_mib", "alloc_mib", "alloc_first_mib"}, RSS and allocated each from a fresh process of its own (the
    profiler's event buffers would count in the RSS); an error's last line in place of a number."""
    out: dict[str, float | str] = {}
    for kind, keys in (("rss", ("peak_mib",)), ("allocated", ("alloc_mib", "alloc_first_mib"))):
        cmd = [sys.executable, __file__, "--memory-worker", model, contender, quantity, kind,
               "--threads", str(args.threads), "--batch", str(args.batch)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        if proc.returncode != 0:
            out.update(dict.fromkeys(keys, (proc.stderr.strip().splitlines() or ["(no output)"])[-1]))
        else:
            out.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# ---- report ---------------------------------------------------------------------------------------------------
def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| model | quantity | contender | time (s) | x plain (median, IQR) | CPU / wall | first step (s) | "
             "peak RSS (MiB) | peak allocated, steady / first step (MiB) |", "|---|---|---|---|---|---|---|---|---|"]

    def mem_text(mem: Any) -> str:
        return f"{mem:.0f}" if isinstance(mem, float) else (f"error: {mem}" if mem else "")

    def alloc_text(r: dict[str, Any]) -> str:
        steady, first = mem_text(r.get("alloc_mib")), mem_text(r.get("alloc_first_mib"))
        return f"{steady} / {first}" if steady or first else ""

    for r in results:
        if "error" in r or "skipped" in r:
            why = f"error: {r['error']}" if "error" in r else f"skipped: {r['skipped']}"
            lines.append(f"| {r['model']} | {r['quantity']} | {r['contender']} | {why} | | | | | |")
            continue
        ratio = f"{r['ratio']:.2f} ({r['iqr'][0]:.2f}-{r['iqr'][1]:.2f})" if "ratio" in r else ""
        lines.append(f"| {r['model']} | {r['quantity']} | {r['contender']} | {r['time_s']:.3f} | {ratio} | "
                     f"{r['cpu_s'] / r['time_s']:.2f} | {r['first_s']:.2f} | {mem_text(r.get('peak_mib'))} | "
                     f"{alloc_text(r)} |")
    return "\n".join(lines)


MEMORY = (("peak_mib", "peak RSS"), ("alloc_mib", "peak allocated (steady step)"),
          ("alloc_first_mib", "peak allocated (first step)"))


def _peer(contender: str) -> bool:
    """Whether a contender is another library's, run on the model as it is (not an in-place-off copy)."""
    return contender not in ("plain", "convgrad") and not contender.endswith(INPLACE_OFF)


def targets(results: list[dict[str, Any]]) -> list[str]:
    """The targets of the per-sample work, checked per model."""
    ok = {(r["model"], r["contender"], r["quantity"]): r for r in results if "error" not in r and "skipped" not in r}
    out = []
    for m in sorted({r["model"] for r in results}):
        plain = ok.get((m, "plain", "-"))
        ours_a, ours_c = ok.get((m, "convgrad", "a")), ok.get((m, "convgrad", "c"))
        others = [r for (mm, c, q), r in ok.items() if mm == m and q == "a" and _peer(c)]
        peers_c = [r for (mm, c, q), r in ok.items() if mm == m and q == "c" and _peer(c) and "+convgrad" not in c]
        if ours_a and "ratio" in ours_a:
            out.append(f"{m} (a): {ours_a['ratio']:.2f}x plain (target <= 1.5x)")
        if ours_a and others:
            fastest = min(others, key=lambda r: r["time_s"])
            out.append(f"{m} (a): {fastest['time_s'] / ours_a['time_s']:.2f}x faster than the fastest contender, "
                       f"{fastest['contender']} (target >= 1.0x; >= 1.5x on resnet18, vgg11, wrn16_4)")
            for key, what in MEMORY:
                mems = [r[key] for r in others if isinstance(r.get(key), float)]
                if isinstance(ours_a.get(key), float) and mems:
                    out.append(f"{m} (a) {what}: {ours_a[key]:.0f} MiB, lowest contender {min(mems):.0f} MiB "
                               f"(target <=)")
        if ours_c and "ratio" in ours_c:
            bar = 1.3 if m in ("resnet18", "vgg11") else 1.5
            out.append(f"{m} (c): {ours_c['ratio']:.2f}x plain (target <= {bar}x)")
            if peers_c:
                fastest = min(peers_c, key=lambda r: r["time_s"])
                out.append(f"{m} (c): {fastest['time_s'] / ours_c['time_s']:.2f}x faster than the fastest peer on "
                           f"the unmodified model, {fastest['contender']} (target >= 1.0x)")
            for key, what in MEMORY:
                if plain and isinstance(ours_c.get(key), float) and isinstance(plain.get(key), float):
                    out.append(f"{m} (c) {what}: {ours_c[key] / max(plain[key], 1e-9):.2f}x plain "
                               f"(target <= 1.25x)")
        for q in ("a", "b", "c"):
            r = ok.get((m, "convgrad", q))
            if r and plain:
                out.append(f"{m} ({q}) first step: {r['first_s']:.2f} s, steady {r['time_s']:.2f} s (tuning and "
                           f"first-call costs: {r['first_s'] - r['time_s']:+.2f} s)")
    return out


def main(argv: list[str] | None = None) -> int:
    global BATCH  # --batch sets it for the contenders' data and Opacus's loader
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--contenders", nargs="+", choices=CONTENDERS, default=CONTENDERS)
    p.add_argument("--quantities", nargs="+", choices=list(QUANTITIES), default=list(QUANTITIES))
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds after two warm-up steps (default 7)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads (default: all)")
    p.add_argument("--batch", type=int, default=BATCH, help=f"samples per step (default {BATCH}; smaller for a quick "
                   "check that a model runs)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per memory process (default 900)")
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "per_sample")
    p.add_argument("--malloc", choices=["keep", "system"], default="keep",
                   help="keep: glibc keeps freed memory while timing (no page faults per step); system: as is "
                        "(default: keep)")
    p.add_argument("--memory-worker", nargs=4, metavar=("MODEL", "CONTENDER", "QUANTITY", "KIND"),
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    BATCH = args.batch
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # Opacus's and torch's hook warnings, once per contender
    if args.memory_worker:
        print(json.dumps(memory_worker(*args.memory_worker)))
        return 0
    from rich.console import Console

    from convgrad.cli.bench import keep_malloc

    console = Console(stderr=True)
    malloc = keep_malloc() if args.malloc == "keep" else "system"
    console.print(f"malloc while timing: {malloc}")
    contenders = [c for c in args.contenders if available(c)]
    missing = [c for c in args.contenders if c not in contenders]
    for c in missing:
        console.print(f"skipped {c}: not installed")
    jobs = [("plain", "-")] + [(c, q) for c in contenders if c != "plain" for q in args.quantities
                               if q == "c" or c not in ONLY_C]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    for model in args.models:
        if model in TIMM and not timm_available():
            console.print(f"skipped {model}: timm is not installed (benchmarks/requirements.txt)")
            results.append({"model": model, "contender": "(all)", "quantity": "-",
                             "skipped": "timm is not installed (benchmarks/requirements.txt)"})
            continue
        console.print(f"timing {model}: {len(jobs)} jobs, {args.repeats} rounds")
        records = time_model(model, jobs, args.repeats)
        for r in records:
            if not args.no_memory and "error" not in r:
                r.update(measure_memory(args, model, r["contender"], r["quantity"]))
        results += records + [{"model": model, "contender": c, "quantity": "-", "skipped": "not installed"}
                              for c in missing]
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1))  # partial results survive
    md = (f"malloc while timing: {malloc}\n\n" + markdown(results) + "\n\n"
          + "\n".join(f"- {t}" for t in targets(results)) + "\n")
    args.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
