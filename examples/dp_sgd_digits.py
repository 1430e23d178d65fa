"""DP-SGD on scikit-learn's digits with convgrad's exact per-sample clipping and Opacus's RDP accountant.

Each step draws a Poisson sample of the training set (each image independently with
probability q, as the accountant assumes), clips every sample's whole-model gradient
to norm C with ``PerSampleGrads(norms_only=True).clip_and_accumulate`` (ghost norms
where they are cheaper, no per-sample gradient kept), adds Gaussian noise N(0, σ²C²)
and divides by the expected batch size (Abadi et al. 2016). The RDP accountant turns
(σ, q, steps) into ε at the stated δ.

Beside it, the same architecture trains without privacy on the same batches, one plain
step (forward, backward, optimizer step) right after each private one, so that both
times per step come from the same run under the same load; the last lines print the
median of each, their ratio, and both held-out accuracies.

Run (about a minute on two CPU cores; the accountant comes from the ``opacus`` extra,
``pip install -e ".[opacus]" -c constraints.txt``):
    PYTHONPATH=src python examples/dp_sgd_digits.py
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import convgrad as cg


def make_model() -> nn.Module:
    """A small CNN for 8x8 digits; GroupNorm, not BatchNorm, which would mix the samples."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1, padding_mode="replicate"), nn.GroupNorm(4, 16), nn.Tanh(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.Tanh(),  # (N, 32, 4, 4)
        nn.Conv2d(32, 32, 3, padding=1, groups=2), nn.Tanh(),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 10),
    )


def load(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0 - 0.5  # (1797, 1, 8, 8)
    y = torch.tensor(digits.target)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    return x_tr, y_tr, x_te, y_te


def dp_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, args: argparse.Namespace,
            expected_batch: float, gen: torch.Generator) -> None:
    """One DP-SGD step on a Poisson batch (possibly empty): clip per sample, sum, add noise, average."""
    opt.zero_grad(set_to_none=True)  # clip_and_accumulate adds to .grad: start the batch from nothing
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    psg.clip_and_accumulate(args.max_norm)  # .grad = Σ_n clip(g_n, C); zeros for an empty batch
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen) * (args.sigma * args.max_norm)
        p.grad = (p.grad + noise) / expected_batch
    opt.step()


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               expected_batch: float) -> None:
    """The non-private step it replaces: the same loss and scale, no clipping, no noise."""
    opt.zero_grad(set_to_none=True)
    (F.cross_entropy(model(x), y, reduction="sum") / expected_batch).backward()
    opt.step()


def timed(step: object, *args: object) -> float:
    start = time.perf_counter()
    step(*args)  # type: ignore[operator]
    return time.perf_counter() - start


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--steps", type=int, default=None, help="stop after this many steps (default: --epochs' worth)")
    p.add_argument("--batch-size", type=int, default=256, help="expected Poisson batch size (default 256)")
    p.add_argument("--sigma", type=float, default=2.0, help="noise multiplier σ (default 2.0)")
    p.add_argument("--max-norm", type=float, default=1.0, help="per-sample clipping bound C (default 1.0)")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--plain-lr", type=float, default=0.1,
                   help="learning rate of the non-private model; unclipped gradients need a smaller one (default 0.1)")
    p.add_argument("--delta", type=float, default=1e-5, help="δ of the (ε, δ) guarantee (default 1e-5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads; one suits a model this small (default 1)")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps {args.steps} must be at least 1")
    try:
        from opacus.accountants import RDPAccountant
    except ModuleNotFoundError:
        p.error('the privacy accountant comes from Opacus: pip install -e ".[opacus]" -c constraints.txt')

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x_tr, y_tr, x_te, y_te = load(args.seed)
    n = x_tr.shape[0]
    q = args.batch_size / n
    steps = round(args.epochs / q) if args.steps is None else args.steps
    model = make_model()
    plain = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=args.plain_lr, momentum=0.5)
    accountant = RDPAccountant()
    times: dict[str, list[float]] = {"DP-SGD": [], "plain": []}
    for step in range(1, steps + 1):
        mask = torch.rand(n, generator=gen) < q  # Poisson sampling, as the accountant assumes
        x, y = x_tr[mask], y_tr[mask]
        times["DP-SGD"].append(timed(dp_step, model, opt, x, y, args, q * n, gen))
        times["plain"].append(timed(plain_step, plain, plain_opt, x, y, q * n))
        accountant.step(noise_multiplier=args.sigma, sample_rate=q)
        if step % max(1, steps // 8) == 0 or step == steps:
            print(f"step {step:4d}/{steps}  epoch {step * q:5.1f}  ε = {accountant.get_epsilon(args.delta):5.2f}  "
                  f"held-out accuracy {accuracy(model, x_te, y_te):.3f}")
    eps = accountant.get_epsilon(args.delta)
    dp_ms, plain_ms = (1e3 * statistics.median(times[k]) for k in ("DP-SGD", "plain"))
    print(f"\nDP-SGD (σ={args.sigma}, C={args.max_norm}, q={q:.4f}, {steps} steps): ε = {eps:.2f} at "
          f"δ = {args.delta:g}; held-out accuracy {accuracy(model, x_te, y_te):.3f} on {x_te.shape[0]} images "
          f"(without privacy: {accuracy(plain, x_te, y_te):.3f})")
    print(f"time per step, median of {steps} paired steps: DP-SGD {dp_ms:.1f} ms, plain {plain_ms:.1f} ms "
          f"({dp_ms / plain_ms:.2f}x plain)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
