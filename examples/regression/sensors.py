"""Worked example (docs/training.md): regression on per-device sensor data, a custom loss
and a custom training function. The data are sklearn's bundled diabetes set (no download),
split across devices."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def write_devices(folder: str | Path, devices: int = 3) -> list[Path]:
    """One .npz per device (x: 10 standardised features, y: the disease progression, scaled)."""
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    x = ((x - x.mean(0)) / x.std(0)).astype(np.float32)
    y = ((y - y.mean()) / y.std()).astype(np.float32)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, part in enumerate(np.array_split(np.arange(len(y)), devices)):
        path = folder / f"sensor-{i}.npz"
        np.savez(path, x=x[part], y=y[part])
        paths.append(path)
    return paths


def log_cosh(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A custom loss: log(cosh(error)), like MSE near 0 and like MAE far from it."""
    return torch.mean(torch.log(torch.cosh(outputs - targets.reshape(outputs.shape))))


def train(model, loader, config):  # noqa: ANN001 - the contract of docs/training.md
    """A custom training function: the job's optimizer and loss, with gradient clipping."""
    model.train()
    seen, total = 0, 0.0
    for _ in range(config.epochs):
        for x, y in loader:
            config.optimizer.zero_grad()
            loss = config.loss(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            config.optimizer.step()
            seen += len(y)
            total += float(loss.detach()) * len(y)
    return {"loss": total / max(seen, 1), "samples": float(seen)}
