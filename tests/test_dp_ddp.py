"""DP-SGD across processes: PerSampleGrads(ddp_model) and Opacus's DPDDP with our rules, gloo on 2 CPU processes.

Each rank holds its own shard of one global batch (uneven: 3 and 5 samples). The clipped sum every
rank ends with must equal single-process clipping of the concatenated batch, computed here by a
loop over samples with torch autograd.
"""

from __future__ import annotations

import datetime
import os
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import convgrad as cg
from helpers import assert_matches_autograd
from ranks import run_ranks

pytestmark = pytest.mark.slow  # DDP: every test reads the ranks' results (two processes)

DT = torch.float64
TIMEOUT_S = 180  # two fresh interpreters import torch, convgrad and Opacus on a shared machine
SHARDS = (3, 5)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(2, 4, 3, padding=1, padding_mode="circular"), nn.GroupNorm(2, 4), nn.Tanh(),  # (N, 4, 7, 7)
        nn.Conv2d(4, 4, 3, stride=2, groups=2), nn.Tanh(),  # (N, 4, 3, 3)
        nn.ConvTranspose2d(4, 2, 2, stride=2, output_padding=1), nn.Flatten(),  # (N, 98)
        nn.Linear(2 * 7 * 7, 3),
    ).to(DT)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen, n = torch.Generator().manual_seed(1), sum(SHARDS)
    return torch.randn(n, 2, 7, 7, dtype=DT, generator=gen), torch.randint(0, 3, (n,), generator=gen)


def _shard(rank: int) -> slice:
    return slice(sum(SHARDS[:rank]), sum(SHARDS[:rank + 1]))


def _expected(max_norm: float) -> dict[str, torch.Tensor]:
    """Σ_n clip(g_n) over the global batch, one process, one sample at a time."""
    model, (x, y) = _model(), _data()
    per: dict[str, list[torch.Tensor]] = {k: [] for k, _ in model.named_parameters()}
    for i in range(x.shape[0]):
        gs = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), list(model.parameters()))
        for (k, _), g in zip(model.named_parameters(), gs, strict=True):
            per[k].append(g)
    grads = {k: torch.stack(v) for k, v in per.items()}
    norms = torch.cat([g.flatten(1) for g in grads.values()], 1).norm(dim=1)
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return {k: torch.tensordot(factors, g, dims=1) for k, g in grads.items()}


def _max_norm() -> float:
    """A bound between the smallest and the largest per-sample norm, so that some samples are clipped."""
    model, (x, y) = _model(), _data()
    with cg.PerSampleGrads(model, loss_reduction="sum") as psg:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    return float(psg.norms().median())


# ---- what each rank runs ---------------------------------------------------------------------------------------
def _psg_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor, max_norm: float, norms_only: bool,
              parts: int) -> dict[str, Any]:
    """One logical batch in ``parts`` micro-batches; every rank makes the same number of calls (a collective)."""
    ddp.zero_grad(set_to_none=True)
    untouched = []
    for xb, yb in zip(x.tensor_split(parts), y.tensor_split(parts), strict=True):
        with cg.PerSampleGrads(ddp, loss_reduction="sum", norms_only=norms_only) as psg:
            F.cross_entropy(ddp(xb), yb, reduction="sum").backward()
        untouched.append(all(p.grad is None for p in ddp.parameters()))
        psg.clip_and_accumulate(max_norm)
    return {"grads": {k.removeprefix("module."): p.grad.clone() for k, p in ddp.named_parameters()},
            "untouched": untouched[0]}


def _opacus_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, max_norm: float, mode: str) -> dict[str, Any]:
    from opacus import PrivacyEngine
    from opacus.distributed import DifferentiallyPrivateDistributedDataParallel as DPDDP

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=x.shape[0])
    criterion = nn.CrossEntropyLoss(reduction="sum")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        made = PrivacyEngine().make_private(module=DPDDP(model), optimizer=torch.optim.SGD(model.parameters(), lr=0.0),
                                            data_loader=loader, noise_multiplier=0.0, max_grad_norm=max_norm,
                                            poisson_sampling=False, loss_reduction="sum", grad_sample_mode=mode,
                                            criterion=criterion)
        gsm, opt, loader = made[0], made[1], made[-1]
        criterion = made[2] if mode == "ghost" else criterion
        for xb, yb in loader:
            opt.zero_grad()
            criterion(gsm(xb), yb).backward()
            opt.step()  # DistributedDPOptimizer: clip, noise on rank 0 (none here), all-reduce
    fell_back = [k for k, m in model.named_modules() if hasattr(m, "ft_compute_sample_grad")]
    out = {"grads": {k: p.grad.clone() for k, p in model.named_parameters()}, "functorch": fell_back}
    gsm._close()
    return out


def _refusals(ddp: nn.Module, x: torch.Tensor) -> dict[str, str]:
    out = {}
    with cg.PerSampleGrads(ddp.module):  # the inner module, while the DDP forward synchronises
        try:
            ddp(x)
        except ValueError as err:
            out["inner"] = str(err)
    try:
        cg.PerSampleGrads(nn.Sequential(ddp))
    except TypeError as err:
        out["nested"] = str(err)
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:  # its reducer fails an internal assert in a backward under no_sync()
        cg.PerSampleGrads(DDP(_model(), static_graph=True))
    except TypeError as err:
        out["static_graph"] = str(err)
    return out


def _worker(rank: int, world: int, port: int, out_dir: str, max_norm: float) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        x, y = (t[_shard(rank)] for t in _data())
        results: dict[str, Any] = {}
        for norms_only in (False, True):
            for parts in (1, 2):  # the whole shard; two micro-batches (2 + 1 and 3 + 2 samples)
                results[f"psg norms_only={norms_only} parts={parts}"] = _psg_step(DDP(_model()), x, y, max_norm,
                                                                                  norms_only, parts)
        results["refusals"] = _refusals(DDP(_model()), x)
        try:
            import convgrad.opacus
        except ModuleNotFoundError:
            pass
        else:
            convgrad.opacus.register()
            for mode in ("hooks", "ghost"):
                results[f"opacus {mode}"] = _opacus_step(_model(), x, y, max_norm, mode)
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
        dist.barrier()  # neither rank tears its connections down while the other still uses them (gloo aborts)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], float]:
    out_dir = tmp_path_factory.mktemp("ddp")
    max_norm = _max_norm()
    run_ranks(_worker, lambda port: (2, port, str(out_dir), max_norm), nprocs=2, timeout_s=TIMEOUT_S)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(2)], max_norm


def test_per_sample_grads_under_ddp_equals_single_process_clipping(ranks: tuple[list[dict[str, Any]], float]) -> None:
    results, max_norm = ranks
    expected = _expected(max_norm)
    keys = [k for k in results[0] if k.startswith("psg")]
    assert len(keys) == 4
    for key in keys:
        for rank, res in enumerate(results):
            assert_matches_autograd(res[key]["grads"], expected, DT, f"{key} rank {rank}")
            assert res[key]["untouched"], f"{key}: the backward under DDP must leave .grad to clip_and_accumulate"


def test_opacus_dpddp_with_registered_rules_equals_single_process_clipping(
        ranks: tuple[list[dict[str, Any]], float]) -> None:
    pytest.importorskip("opacus")
    results, max_norm = ranks
    expected = _expected(max_norm)
    for mode in ("hooks", "ghost"):
        for rank, res in enumerate(results):
            assert res[f"opacus {mode}"]["functorch"] == []
            assert_matches_autograd(res[f"opacus {mode}"]["grads"], expected, DT, f"Opacus DPDDP {mode} rank {rank}")


def test_what_per_sample_grads_cannot_handle_under_ddp_is_refused(ranks: tuple[list[dict[str, Any]], float]) -> None:
    refusals = ranks[0][0]["refusals"]
    assert "inside a DistributedDataParallel module that all-reduces" in refusals["inner"]
    assert "PerSampleGrads(ddp_model)" in refusals["inner"]
    assert "module '0' is a DistributedDataParallel inside the model" in refusals["nested"]
    assert "built with static_graph=True" in refusals["static_graph"]
