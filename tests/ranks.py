"""Spawned gloo ranks on 127.0.0.1 for the distributed tests, with what a shared machine needs."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(worker: Callable[..., None], args: tuple[Any, ...], nprocs: int, timeout_s: float) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the {nprocs} ranks did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()


def run_ranks(worker: Callable[..., None], make_args: Callable[[int], tuple[Any, ...]], nprocs: int = 2,
              timeout_s: float = 90) -> None:
    """Run ``worker(rank, *make_args(port))`` in ``nprocs`` spawned processes and wait for all of them.

    Gloo on a shared 2-core VM kills a rank by a signal now and then (SIGABRT in about 1 full-suite run
    of 8): that gets a second run with a fresh port. An exception raised in a rank fails at once.
    """
    from torch.multiprocessing import ProcessExitedException

    try:
        _start(worker, make_args(free_port()), nprocs, timeout_s)
    except ProcessExitedException as e:
        if e.signal_name is None:
            raise
        _start(worker, make_args(free_port()), nprocs, timeout_s)
