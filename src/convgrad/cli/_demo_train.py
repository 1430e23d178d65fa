"""The demo's network, data and twin-checked training loop (the command itself is ``convgrad.cli.demo``)."""

from __future__ import annotations

import warnings
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

import convgrad.nn as cgnn
from convgrad.spec import ConvSpec

BATCH = 64
LR = 3e-3  # constant: on these 8x8 digits it beat a cosine decay at equal steps
RECONSTRUCTION_WEIGHT = 0.5

# layer -> the hard case it exercises (shown in the report)
EXERCISES: dict[str, str] = {
    "same_even": "'same', even k",
    "dilated": "dilation > 1",
    "grouped": "1 < groups < C_in",
    "strided": "real row unread",
    "depthwise": "groups = C_in",
    "decoder": "transposed conv",
}


class DigitsNet(torch.nn.Module):
    """A small CNN for 8x8 digits whose conv layers are the hard cases of EXERCISES.

    Args:
        layers: the module namespace that provides Conv2d / ConvTranspose2d: ``convgrad.nn`` or ``torch.nn``.
        **conv_kwargs: passed to every conv (``backend=`` for convgrad.nn).

    Shape:
        Input ``(N, 1, 8, 8)``; output ``(logits (N, 10), reconstruction (N, 1, 8, 8))``.
    """

    def __init__(self, layers: ModuleType, **conv_kwargs: Any) -> None:
        super().__init__()
        kw = conv_kwargs
        self.same_even = layers.Conv2d(1, 16, 4, padding="same", **kw)  # 8x8 -> 8x8, pads (1, 2)
        self.dilated = layers.Conv2d(16, 16, 3, dilation=2, padding=2, **kw)  # 8x8 -> 8x8
        self.grouped = layers.Conv2d(16, 32, 3, padding=1, groups=4, **kw)  # 8x8 -> 8x8
        self.strided = layers.Conv2d(32, 32, 3, stride=2, **kw)  # 8x8 -> 3x3: o = 3, r = 1, row 7 unread
        self.depthwise = layers.Conv2d(32, 32, 3, padding=1, groups=32, **kw)  # 3x3 -> 3x3
        self.classify = torch.nn.Linear(32 * 3 * 3, 10)
        self.decoder = layers.ConvTranspose2d(32, 1, 3, stride=2, output_padding=1, **kw)  # 3x3 -> 8x8

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x
        for conv in (self.same_even, self.dilated, self.grouped, self.strided, self.depthwise):
            h = F.relu(conv(h))
        return self.classify(h.flatten(1)), self.decoder(h)  # (N, 10), (N, 1, 8, 8)


def load_digits(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 1,797 real 8x8 digits scaled to [0, 1], split 80/20 stratified.

    Returns:
        x_train ``(1437, 1, 8, 8)``, y_train ``(1437,)``, x_test ``(360, 1, 8, 8)``, y_test ``(360,)``.
    """
    from sklearn.datasets import load_digits as sk_load_digits
    from sklearn.model_selection import train_test_split

    digits = sk_load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16  # (1797, 1, 8, 8), pixels 0..16
    y = torch.tensor(digits.target)
    train, test = train_test_split(range(len(y)), test_size=0.2, random_state=seed, stratify=digits.target)
    return x[train], y[train], x[test], y[test]


def _loss(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits, reconstruction = net(x)
    return F.cross_entropy(logits, y) + RECONSTRUCTION_WEIGHT * F.mse_loss(reconstruction, x)


def _relative_difference(module: torch.nn.Module, ref: torch.nn.Module) -> float:
    """||g - g_ref|| / ||g_ref|| of a layer, computed in float64: the larger of weight alone and weight + bias.

    The weight alone, so that a large bias gradient cannot hide an error in the weight gradient (which is what a
    backend computes); the bias only together with the weight, because a bias entry is one long sum that can nearly
    cancel (a single output channel's, late in training), making its own relative difference ill-conditioned in
    float32 whatever the backend.
    """
    def rel(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
        g, g_ref = torch.cat([t.flatten() for t in a]).double(), torch.cat([t.flatten() for t in b]).double()  # (P,)
        scale = torch.linalg.vector_norm(g_ref).item()
        return torch.linalg.vector_norm(g - g_ref).item() / (scale if scale > 0 else 1.0)

    grads = [p.grad for p in module.parameters()]
    ref_grads = [p.grad for p in ref.parameters()]
    return max(rel(grads[:1], ref_grads[:1]), rel(grads, ref_grads))  # parameters(): weight first, then bias


def _compact(spec: ConvSpec) -> str:
    """One short line per layer for the table, e.g. ``32->32 k3 s2 8x8->3x3 r1``; defaults left out."""
    def v(t: tuple[Any, ...]) -> str:
        return str(t[0]) if len(set(t)) == 1 else "x".join(map(str, t))

    pads = v(tuple(str(lo) if lo == hi else f"({lo},{hi})" for lo, hi in spec.padding))
    parts = [f"{spec.in_channels}->{spec.out_channels} k{v(spec.kernel_size)}"]
    for label, value, default in (("s", spec.stride, 1), ("d", spec.dilation, 1), ("g", (spec.groups,), 1),
                                  ("p", (pads,), "0"), ("op", spec.output_padding, 0), ("r", spec.leftover, 0)):
        if set(value) != {default}:
            parts.append(f"{label}{v(value)}")
    parts.insert(1, f"{'x'.join(map(str, spec.input_size))}->{'x'.join(map(str, spec.output_size))}")
    return " ".join(parts)


def layer_specs(net: DigitsNet, x: torch.Tensor) -> dict[str, ConvSpec]:
    """Each conv's ConvSpec for input x, read from the shapes it actually receives."""
    shapes: dict[str, tuple[int, ...]] = {}
    handles = [getattr(net, name).register_forward_pre_hook(
        lambda _, args, name=name: shapes.__setitem__(name, tuple(args[0].shape))) for name in EXERCISES]
    with torch.no_grad():
        net(x)
    for h in handles:
        h.remove()
    specs = {}
    for name in EXERCISES:
        m = getattr(net, name)
        specs[name] = ConvSpec.from_shapes(shapes[name], m.weight.shape, m.stride, m.padding, m.dilation,
                                           m.transposed, m.output_padding, m.groups, fn="convgrad demo")
    return specs


def train(backend: str, epochs: int, seed: int, max_steps: int | None, console: Any) -> dict[str, Any]:
    """Train DigitsNet (convgrad.nn, ``backend``) and compare its conv gradients with a torch.nn twin at every step.

    Returns:
        dict with losses (per step), diffs (layer -> per-step relative difference), accuracy (held-out),
        steps (run), steps_per_epoch, layers (layer -> config and what it exercises), train_images and test_images.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    x_train, y_train, x_test, y_test = load_digits(seed)
    torch.manual_seed(seed)
    net = DigitsNet(cgnn, backend=backend)
    twin = DigitsNet(torch.nn)  # plain torch autograd; receives net's weights at every step
    optimizer = torch.optim.Adam(net.parameters(), lr=LR)
    order = torch.Generator().manual_seed(seed)
    per_epoch = -(-len(y_train) // BATCH)
    total = epochs * per_epoch if max_steps is None else min(max_steps, epochs * per_epoch)
    losses: list[float] = []
    diffs: dict[str, list[float]] = {name: [] for name in EXERCISES}
    columns = (TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn())
    with Progress(*columns, console=console) as progress, warnings.catch_warnings():
        # torch's own 'same' conv with an even kernel warns that it copies the input; that is the twin's business
        warnings.filterwarnings("ignore", message="Using padding='same' with even kernel")
        task = progress.add_task(f"training ({backend})", total=total, loss=float("nan"))
        while len(losses) < total:
            for batch in torch.randperm(len(y_train), generator=order).split(BATCH):
                if len(losses) == total:
                    break
                x, y = x_train[batch], y_train[batch]
                twin.load_state_dict(net.state_dict())
                optimizer.zero_grad()
                loss = _loss(net, x, y)
                loss.backward()
                twin.zero_grad()
                _loss(twin, x, y).backward()
                for name in EXERCISES:
                    diffs[name].append(_relative_difference(getattr(net, name), getattr(twin, name)))
                optimizer.step()
                losses.append(loss.item())
                progress.update(task, advance=1, loss=loss.item())
    net.eval()
    with torch.no_grad():
        accuracy = (net(x_test)[0].argmax(1) == y_test).float().mean().item()
    specs = layer_specs(net, x_test[:1])
    layers = {name: {"config": _compact(spec), "spec": spec.describe(), "unread_input_rows": spec.unread_input_rows,
                     "exercises": EXERCISES[name]} for name, spec in specs.items()}
    return {"losses": losses, "diffs": diffs, "accuracy": accuracy, "steps": len(losses),
            "steps_per_epoch": per_epoch, "layers": layers,
            "train_images": len(y_train), "test_images": len(y_test)}
