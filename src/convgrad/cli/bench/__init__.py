"""`convgrad bench`: time every backend against native on a suite of real layers.

For each layer of the suite (``convgrad.cli.bench.layers``; ``--list`` prints them) and each dtype,
grad_input, grad_weight and both together are timed for every backend, with native always included
and interleaved in the same rounds, next to native's forward convolution and a matmul of equal FLOPs
(``convgrad.cli.bench.timing``). A backend not named by ``--backends`` is timed only on the layers where it
takes part as auto races it (``timing.serves``). Each backend is reported by its speed-up over native
(native's time over its own) and by its time in native forwards (``convgrad.cli.bench.report``).

Before timing, the run says what it will time and about how long (``convgrad.cli.bench.estimate``); then a
progress bar on a terminal, a line per layer otherwise. ``results.json`` and ``results.md`` are written into
``--out`` after every layer (``speedups_<dtype>.png`` and ``forward_<dtype>.png`` at most every 30 s and at the
end), so a stopped run leaves what it measured; at the end the command prints rich tables (in full, also when its
output is not a terminal). The CPU model, core and thread counts (or the GPU) are recorded with every result. On
CUDA, native is cuDNN and TF32 is switched off, so float32 means float32.

Memory. By default (``--malloc keep``) glibc is told, through ``mallopt``, never to return freed
memory to the system nor to serve big blocks by fresh ``mmap`` (what jemalloc or tcmalloc do, as
PyTorch's CPU performance guide recommends). Otherwise every call that allocates a tensor of tens
of MB pays its page faults again: on a 2-core VM that made MobileNetV2's depthwise grad_input 30 ms
instead of 4 ms, for every backend alike, and buried the differences being measured.

Example (a tiny suite, for a smoke test):
    >>> from convgrad import cli
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as out:
    ...     cli.main(["bench", "--suite", "smoke", "--layers", "wav2vec2.*", "--backends", "fwdconv",
    ...               "--repeats", "2", "--min-time", "0", "--out", out, "--quiet"])
    0
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import datetime
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from convgrad.cli import console as cli_console
from convgrad.cli import demo_extras_missing, parse_shape
from convgrad.errors import ConvgradValueError

__all__ = ["add_arguments", "default_backends", "keep_malloc", "run"]

DTYPES = ("float32", "float64", "float16", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The bench options (all have defaults)."""
    from convgrad.cli.bench.model import OPTIMIZERS

    parser.add_argument("--suite", default="default",
                        help="suite of layers: default, slow (layers users report slow), all (both), "
                             "large (large kernels, where the fft backend pays: times fwdconv, fft and auto by "
                             "default) or smoke (default: default)")
    parser.add_argument("--list", action="store_true", help="print the layers the run would time, then exit")
    parser.add_argument("--layers", nargs="+", metavar="PATTERN", help="only layers whose name matches a glob")
    parser.add_argument("--backends", nargs="+", metavar="NAME",
                        help="backends to time besides native, on every layer (default: the suite's own, else "
                             "every registered backend that declares bench_by_default, each on the layers where auto "
                             "would race it)")
    parser.add_argument("--quick", action="store_true",
                        help=f"auto against native only, on both gradients in one call, {QUICK['repeats']} rounds of "
                             f"{QUICK['min_time']:g} s samples: a layer's answer in seconds (with --layers NAME), "
                             "unless native's own backward takes seconds")
    parser.add_argument("--dtype", nargs="+", default=["float32"], choices=DTYPES, metavar="DTYPE",
                        help="dtypes; float64 runs the suite's float64 subset unless --layers is given "
                             "(default: float32)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for results.json, results.md and the PNGs, written after every layer "
                             "(default: ./bench-results)")
    parser.add_argument("--repeats", type=int, default=None,
                        help=f"rounds; medians and IQRs over them (default: {DEFAULTS['repeats']}; "
                             f"{QUICK['repeats']} with --quick)")
    parser.add_argument("--min-time", type=float, default=None,
                        help=f"seconds per sample (default: {DEFAULTS['min_time']:g}; {QUICK['min_time']:g} with "
                             "--quick); with --model, see --steps")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (cuda when present)")
    parser.add_argument("--channels-last", action="store_true", help="input and grad_output in channels_last")
    parser.add_argument("--malloc", choices=["keep", "system"], default="keep",
                        help="keep: glibc keeps freed memory (no page faults per call); system: as is (default: keep)")
    parser.add_argument("--quiet", action="store_true", help="no estimate, no progress and no tables")
    model = parser.add_argument_group(
        "your own model", "time its training step (forward, a loss, backward) plain against convgrad.patch, and say "
                          "what auto chose for each conv call; --dtype, --threads, --device, --min-time, --quick and "
                          "--malloc apply too")
    model.add_argument("--model", metavar="MODULE:FACTORY",
                       help="FACTORY() builds the model; MODULE is a module name (the current directory is searched) "
                            "or a path/to/file.py")
    model.add_argument("--input-shape", type=parse_shape, metavar="N,C,...", help="its input's size")
    model.add_argument("--backend", default=None, metavar="NAME", help="the backend given to patch (default: auto)")
    model.add_argument("--steps", type=int, default=None,
                       help=f"timed steps of each model at least, one of each per round (default: {MODEL['steps']}; "
                            f"{MODEL_QUICK['steps']} with --quick); with --min-time S, until each has S s of steps "
                            f"(default: {MODEL['min_time']:g}; {MODEL_QUICK['min_time']:g} with --quick)")
    model.add_argument("--optimizer", choices=OPTIMIZERS, default=None,
                       help="an optimizer step at the end of each training step (default: none)")
    model.add_argument("--json", action="store_true", help="print every figure as JSON instead of the tables")


DEFAULTS = {"repeats": 7, "min_time": 0.05}
QUICK = {"repeats": 3, "min_time": 0.02}
MODEL = {"steps": 10, "min_time": 2.0, "warmup": 10}  # --model's
MODEL_QUICK = {"steps": 3, "min_time": 0.0, "warmup": 2}
SUITE_ONLY = {"suite": "default", "list": False, "layers": None, "backends": None, "repeats": None, "out": None,
              "channels_last": False}
MODEL_ONLY = {"input_shape": None, "backend": None, "steps": None, "optimizer": None, "json": False}


def default_backends(suite: str | None = None) -> list[str]:
    """The backends timed when no --backends is given: the suite's own (``layers.SUITE_BACKENDS``), else every
    registered one whose class sets ``bench_by_default`` (native is timed always, as the reference), auto last,
    after the backends it chooses among."""
    from convgrad.backends import backend_names, get_backend
    from convgrad.cli.bench.layers import SUITE_BACKENDS

    names = SUITE_BACKENDS.get(suite or "") or [b for b in backend_names() if get_backend(b).bench_by_default]
    return sorted(names, key=lambda b: b == "auto")


def _check(args: argparse.Namespace) -> list[str]:
    """Validate the options and fill in the defaults (--quick's where it is given); the backends to time."""
    from convgrad.backends import get_backend

    for name, value in (("repeats", args.repeats), ("min_time", args.min_time)):
        if value is None:
            setattr(args, name, (QUICK if args.quick else DEFAULTS)[name])
    for name, low in (("threads", 1), ("repeats", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise ConvgradValueError(f"convgrad bench: --{name}={value} must be at least {low}")
    if args.min_time < 0:
        raise ConvgradValueError(f"convgrad bench: --min-time={args.min_time} must not be negative")
    wanted = args.backends or (["auto"] if args.quick else default_backends(args.suite))
    for b in wanted:
        get_backend(b, "convgrad bench")
    return ["native", *dict.fromkeys(b for b in wanted if b != "native")]


def _device(name: str) -> Any:
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConvgradValueError(f"convgrad bench: --device={name} must be cpu, cuda, cuda:N or auto") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConvgradValueError(f"convgrad bench: --device={name} but no CUDA device is available")
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32, for native and the matmul alike
        torch.backends.cudnn.allow_tf32 = False
    elif device.type != "cpu":
        raise ConvgradValueError(f"convgrad bench: --device={name} must be cpu, cuda, cuda:N or auto")
    return device


def keep_malloc() -> str:
    """Ask glibc to keep freed memory: no mmap for big blocks, no trimming. Says what it did."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_mmap_max = -1, -4
        if libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 2**31 - 1):
            return "keep (glibc mallopt: no mmap, no trim)"
    except (OSError, AttributeError):
        pass
    return "system (mallopt unavailable)"


def _meta(args: argparse.Namespace, device: Any, backends: list[str]) -> dict[str, Any]:
    from convgrad.backends.auto import get_mode
    from convgrad.cli.bench.timing import machine

    meta = {"suite": args.suite, **machine(device), "backends": " ".join(backends), "repeats": args.repeats,
            "memory_format": "channels_last" if args.channels_last else "contiguous", "auto_mode": get_mode(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "convgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:])}
    if device.type == "cuda":
        meta["tf32"] = "off"
    return meta


def run(args: argparse.Namespace) -> int:
    """Say what the run will time and about how long it takes, time it layer by layer (a progress bar on a terminal,
    a line per layer otherwise), write the reports after every layer, print the tables; 0 on success. With --model,
    time that model's training step instead (``_run_model``)."""
    _refuse_mixed(args)
    if args.model is not None:
        return _run_model(args)
    args.out = args.out or Path("bench-results")
    if demo_extras_missing("bench", "rich.progress"):
        return 2
    import torch

    from convgrad.cli.bench import estimate
    from convgrad.cli.bench.layers import select
    from convgrad.cli.bench.timing import TASKS, serves

    if args.list:
        _list(args)
        return 0
    backends = _check(args)
    if args.out.exists() and not args.out.is_dir():
        raise ConvgradValueError(
            f"convgrad bench: --out={args.out} is an existing file, not a folder; --out names the folder "
            f"that gets results.json, results.md and the charts (give a new or existing folder)")
    device = _device(args.device)
    malloc = keep_malloc() if args.malloc == "keep" else "system"
    named = set(args.backends or ())  # timed on every layer; the others only where they take part (timing.serves)
    work = [(layer, dtype, [b for b in backends if b in ("native", "auto") or b in named
                            or serves(layer, dtype, b, device, args.channels_last)])
            for dtype in args.dtype for layer in select(args.suite, args.layers, dtype)]
    args.out.mkdir(parents=True, exist_ok=True)  # an unusable --out fails now, not after every layer is timed
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    tasks = ("both",) if args.quick else TASKS
    gflops = estimate.matmul_gflops(device, args.dtype[0])
    plan = estimate.estimate(work, tasks, args.repeats, args.min_time, gflops)
    line = _plan_line(args, work, backends, tasks, plan)
    meta = _meta(args, device, backends) | {"malloc": malloc, "matmul_gflops": round(gflops, 2),
                                            "estimate_s": round(plan.total, 1), "plan": line}
    console = cli_console(quiet=args.quiet)
    console.print(line, soft_wrap=True, highlight=False)
    results: list[Any] = []
    try:
        _time_all(args, console, work, tasks, device, meta, plan, results)
    except KeyboardInterrupt:
        kept = (f"what they measured is in {args.out / 'results.json'} and {args.out / 'results.md'}" if results
                else "nothing was written")
        print(f"convgrad bench: interrupted after {len(results)} of {len(work)} layers; {kept}", file=sys.stderr)
        return 130
    _print(console, results, meta, args.repeats)
    pngs = [str(args.out / f"{name}_{dtype}.png") for dtype in dict.fromkeys(r.dtype for r in results)
            for name in ("speedups", "forward")]
    console.print(f"wrote {args.out / 'results.json'}, {args.out / 'results.md'}, {', '.join(pngs)}", soft_wrap=True)
    return 0


def _refuse_mixed(args: argparse.Namespace) -> None:
    """An option of the suites given with --model, or one of --model's without it."""
    options, other = (SUITE_ONLY, "the suites") if args.model is not None else (MODEL_ONLY, "--model")
    for name, default in options.items():
        if getattr(args, name) != default:
            flag = "--" + name.replace("_", "-")
            raise ConvgradValueError(f"convgrad bench: {flag} applies to {other}, not to "
                                     f"{'--model' if args.model is not None else 'the suites'}")


def _run_model(args: argparse.Namespace) -> int:
    """`convgrad bench --model`: time the model's training step plain against patched, print the report (or JSON)."""
    import torch

    from convgrad.cli.bench.model import bench_model
    from convgrad.cli.bench.model_print import show

    if args.input_shape is None:
        raise ConvgradValueError("convgrad bench: --model needs --input-shape, e.g. --input-shape 8,3,224,224")
    if len(args.dtype) != 1:
        raise ConvgradValueError(f"convgrad bench: --model times one --dtype, not {' '.join(args.dtype)}")
    if args.threads is not None and args.threads < 1:
        raise ConvgradValueError(f"convgrad bench: --threads={args.threads} must be at least 1")
    defaults = MODEL_QUICK if args.quick else MODEL
    device = _device(args.device)
    if args.malloc == "keep":
        keep_malloc()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    def progress(line: str) -> None:
        if not args.quiet:
            print(f"convgrad bench --model: {line}", file=sys.stderr, flush=True)

    result = bench_model(args.model, args.input_shape, args.backend or "auto", args.dtype[0], device,
                         int(defaults["steps"]) if args.steps is None else args.steps,
                         defaults["min_time"] if args.min_time is None else args.min_time, int(defaults["warmup"]),
                         args.optimizer or "none", progress)
    result.settings |= {"command": "convgrad " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
                        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    if args.json:
        print(result.to_json())
    elif not args.quiet and not demo_extras_missing("bench", "rich.table"):
        # a file or a pipe: whole rows, as wide as the tables need up to 240 columns, as `convgrad check` prints them
        wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
        show(cli_console(width=240) if wide else cli_console(), result)
    return 0


_PLOT_EVERY_S = 30.0  # the charts after a layer at most this often (a chart costs about a second), and at the end


def _time_all(args: argparse.Namespace, console: Any, work: list[tuple[Any, str, list[str]]], tasks: tuple[str, ...],
              device: Any, meta: dict[str, Any], plan: Any, results: list[Any]) -> None:
    """Time every (layer, dtype) of ``work`` into ``results``, writing the reports after each."""
    import time

    import torch
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from convgrad.cli.bench import report
    from convgrad.cli.bench.estimate import duration
    from convgrad.cli.bench.timing import time_layer

    threads, started, plotted = torch.get_num_threads(), time.perf_counter(), 0.0
    live = console.is_terminal and not args.quiet
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[left]}"))
    with Progress(*columns, console=console, disable=not live) as progress:
        bar = progress.add_task("bench", total=len(work) * args.repeats, left="")
        for i, (layer, dtype, backends) in enumerate(work):
            progress.update(bar, description=f"{layer.name} {dtype}")
            for result in time_layer(layer, dtype, backends, device, threads, args.repeats, args.min_time,
                                     args.channels_last, tasks):
                progress.advance(bar)
                before = time.perf_counter() - started - result.seconds  # the layers done before this one
                progress.update(bar, left=f"about {duration(max(0.0, plan.left(i, before) - result.seconds))} left")
            results.append(result)
            meta["layers_done"] = f"{i + 1} of {len(work)}"
            report.to_json(results, meta, args.out / "results.json", args.repeats)
            report.to_markdown(results, meta, args.out / "results.md", args.repeats)
            if i + 1 == len(work) or time.perf_counter() - plotted >= _PLOT_EVERY_S:
                report.write_plots(results, args.out)
                plotted = time.perf_counter()
            if not live and not args.quiet:
                left = plan.left(i + 1, time.perf_counter() - started)
                console.print(f"[{i + 1}/{len(work)}] {report.layer_line(result, args.repeats)}; "
                              f"{'done' if i + 1 == len(work) else f'about {duration(left)} left'}", soft_wrap=True,
                              highlight=False)


def _plan_line(args: argparse.Namespace, work: list[tuple[Any, str, list[str]]], backends: list[str],
               tasks: tuple[str, ...], plan: Any) -> str:
    """What the run will time and about how long it will take."""
    from convgrad.cli.bench.estimate import duration

    layers = len({layer.name for layer, _, _ in work})
    some = [f"{b} on the {n} where it takes part" for b in backends
            if (n := sum(b in timed for _, _, timed in work)) < len(work)]
    what = "both gradients in one call" if tasks == ("both",) else "grad_input, grad_weight and both"
    guess = f"; {plan.guessed} of {len(work)} layers priced by a guess" if plan.guessed else ""
    return (f"convgrad bench --suite {args.suite}: {layers} layer{'s' * (layers != 1)} x {len(backends)} backends "
            f"({', '.join(backends)}{'; ' if some else ''}{', '.join(some)}), {what}, {', '.join(args.dtype)}, "
            f"{args.repeats} round{'s' * (args.repeats != 1)} of samples of at least {args.min_time:g} s: about "
            f"{duration(plan.total)} ({plan.source}{guess}); results are written to {args.out} after every layer")


def _list(args: argparse.Namespace) -> None:
    """Print the suites, then every layer a run with these options would time (per dtype)."""
    from convgrad.cli.bench.layers import SUITES, select

    print("suites: " + ", ".join(f"{name} ({len(layers)} layers)" for name, layers in SUITES.items()))
    for dtype in args.dtype:
        picked = select(args.suite, args.layers, dtype)
        print(f"suite {args.suite!r}, {dtype}: {len(picked)} layers")
        for layer in picked:
            print(f"  {layer.name:22s} {layer.network:22s} {layer.where}: {layer.spec().describe()}, "
                  f"{layer.gflop():.2f} GFLOP per gradient")


def _print(console: Any, results: list[Any], meta: dict[str, Any], repeats: int) -> None:
    from rich.table import Table

    from convgrad.cli.bench import report

    console.print(f"{meta['device_model']} ({meta['device']}), {meta['cores']} cores, {meta['threads']} threads, "
                  f"torch {meta['torch']}, auto mode {meta['auto_mode']}", soft_wrap=True)
    header, body = report.table_rows(results, repeats)
    table = Table(*header, title="median ms ± IQR; speed-up: native's time ÷ the backend's in the same round (above 1: "
                                 "faster than native); in fwds: time ÷ native's forward; medians over rounds ± IQR")
    for row in body:
        table.add_row(*row)
    if any(report.SUSPECT_MARK in cell for row in body for cell in row):
        table.caption = report.suspect_note(meta)
    summ = Table(*report.SUMMARY_HEADER, title="geometric means over layers")
    for row in report.summary_rows(results):
        summ.add_row(*row)
    for t in (table, summ):
        if not console.is_terminal:  # a terminal wraps cells to its width; a file or a pipe gets every cell whole
            console.width = max(console.measure(t, options=console.options.update_width(2**16)).maximum, 80)
        console.print(t)
