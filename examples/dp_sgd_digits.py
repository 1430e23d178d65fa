"""DP-SGD on scikit-learn's digits with convgrad's exact per-sample clipping and Opacus's RDP accountant.

Each step draws a Poisson sample of the training set (each image independently with
probability q, as the accountant assumes), clips every sample's whole-model gradient
to norm C with ``PerSampleGrads(norms_only=True).clip_and_accumulate`` (ghost norms
where they are cheaper, no per-sample gradient kept), adds Gaussian noise N(0, σ²C²)
and divides by the expected batch size (Abadi et al. 2016). The RDP accountant turns
(σ, q, steps) into ε at the stated δ.

Run (about a minute on two CPU cores; Opacus installed as in benchmarks/README.md):
    PYTHONPATH=src python examples/dp_sgd_digits.py
"""

from __future__ import annotations

import argparse
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
    opt.zero_grad(set_to_none=True)
    with cg.PerSampleGrads(model, loss_reduction="sum", norms_only=True) as psg:
        F.cross_entropy(model(x), y, reduction="sum").backward()
    psg.clip_and_accumulate(args.max_norm)  # .grad = Σ_n clip(g_n, C); zeros for an empty batch
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen) * (args.sigma * args.max_norm)
        p.grad = (p.grad + noise) / expected_batch
    opt.step()


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    return (model(x).argmax(1) == y).float().mean().item()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=256, help="expected Poisson batch size (default 256)")
    p.add_argument("--sigma", type=float, default=2.0, help="noise multiplier σ (default 2.0)")
    p.add_argument("--max-norm", type=float, default=1.0, help="per-sample clipping bound C (default 1.0)")
    p.add_argument("--lr", type=float, default=1.0)
    p.add_argument("--delta", type=float, default=1e-5, help="δ of the (ε, δ) guarantee (default 1e-5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads; one suits a model this small (default 1)")
    args = p.parse_args(argv)
    try:
        from opacus.accountants import RDPAccountant
    except ModuleNotFoundError:
        p.error("the privacy accountant comes from Opacus: pip install --no-deps -c constraints.txt "
                "-r benchmarks/requirements.txt")

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x_tr, y_tr, x_te, y_te = load(args.seed)
    n = x_tr.shape[0]
    q = args.batch_size / n
    steps = round(args.epochs / q)
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.5)
    accountant = RDPAccountant()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        mask = torch.rand(n, generator=gen) < q  # Poisson sampling, as the accountant assumes
        dp_step(model, opt, x_tr[mask], y_tr[mask], args, q * n, gen)
        accountant.step(noise_multiplier=args.sigma, sample_rate=q)
        if step % max(1, steps // 8) == 0 or step == steps:
            print(f"step {step:4d}/{steps}  epoch {step * q:5.1f}  ε = {accountant.get_epsilon(args.delta):5.2f}  "
                  f"held-out accuracy {accuracy(model, x_te, y_te):.3f}")
    eps = accountant.get_epsilon(args.delta)
    print(f"\nDP-SGD (σ={args.sigma}, C={args.max_norm}, q={q:.4f}, {steps} steps, "
          f"{time.perf_counter() - start:.0f} s): ε = {eps:.2f} at δ = {args.delta:g}; "
          f"held-out accuracy {accuracy(model, x_te, y_te):.3f} on {x_te.shape[0]} images")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
