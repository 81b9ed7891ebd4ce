"""PNG figures of attack results (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from senseshield.plotting import pyplot

plt = pyplot()

__all__ = ["heterogeneity_figure", "image_grid", "label_bars", "sweep_figure"]

_ORDER_STYLE = {
    "high": ("tab:red", "high sensitivity first"),
    "random": ("tab:blue", "random"),
    "low": ("tab:green", "low sensitivity first"),
}


def _show(ax: Any, image: np.ndarray) -> None:
    img = np.asarray(image)
    if img.shape[0] == 1:
        ax.imshow(img[0], cmap="gray", vmin=0, vmax=1, interpolation="nearest")
    else:
        ax.imshow(np.clip(np.transpose(img, (1, 2, 0)), 0, 1), interpolation="nearest")
    ax.set_xticks([])
    ax.set_yticks([])


def image_grid(
    panels: Sequence[dict[str, Any]], path: Path, *, title: str, max_images: int = 16
) -> Path:
    """True (upper row) vs reconstructed (lower row) images, with each image's PSNR.

    Each panel is one captured update: ``truth`` and ``reconstruction`` arrays
    ``(B, C, H, W)`` in matched order and a short ``caption`` (client, trial, HE ratio).
    Up to ``max_images`` images in rows of at most 8.
    """
    from senseshield.attacks.metrics import psnr

    items = []
    for panel in panels:
        values = psnr(panel["reconstruction"], panel["truth"])
        for j in range(len(panel["truth"])):
            db = "exact" if not np.isfinite(values[j]) else f"{values[j]:.1f} dB"
            items.append((panel["truth"][j], panel["reconstruction"][j], f"{panel['caption']}\n{db}"))
    items = items[:max_images]
    cols = min(8, len(items))
    blocks = -(-len(items) // cols)
    fig, axes = plt.subplots(
        2 * blocks, cols, figsize=(max(1.5 * cols, 6.0), 3.3 * blocks + 0.7), squeeze=False
    )
    for n in range(blocks * cols):
        b, j = divmod(n, cols)
        top, bottom = axes[2 * b][j], axes[2 * b + 1][j]
        if n >= len(items):
            top.axis("off")
            bottom.axis("off")
            continue
        truth, recon, caption = items[n]
        _show(top, truth)
        _show(bottom, recon)
        top.set_title(caption, fontsize=7)
        if j == 0:
            top.set_ylabel("true", fontsize=9)
            bottom.set_ylabel("attack", fontsize=9)
    fig.suptitle(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def label_bars(panels: Sequence[dict[str, Any]], path: Path, *, title: str) -> Path:
    """True vs restored instances per class, one subplot per captured update (iLRG)."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(7, 1.9 * len(panels) + 0.6), squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        true = np.asarray(panel["true_counts"])
        restored = np.asarray(panel["restored_counts"])
        cls = np.arange(true.size)
        ax.bar(cls - 0.2, true, width=0.4, label="true", color="0.6")
        ax.bar(cls + 0.2, restored, width=0.4, label="restored", color="tab:red")
        ax.set_xticks(cls)
        ax.set_ylabel("instances")
        ax.set_title(panel["label"], fontsize=9, loc="left")
    axes[0, 0].legend(fontsize=8)
    axes[-1, 0].set_xlabel("class")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep_figure(result: dict[str, Any], path: Path) -> Path:
    """SenseCrypt App. H: LeAcc, LnAcc, MI and PSNR against the encryption ratio."""
    panels = [("leacc", "LeAcc (iLRG)"), ("lnacc", "LnAcc (iLRG)"), ("mi", "MI I(W; (1-X)W) [bits]"),
              ("psnr", "PSNR of reconstruction [dB]")]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    blind = result.get("blind", {})
    for ax, (key, label) in zip(axes.ravel(), panels):
        for order in result["orders"]:
            pts = [p for p in result["points"] if p["order"] == order]
            xs = [p["ratio"] for p in pts]
            ys = [p[key] for p in pts]
            if all(y is None for y in ys):
                continue
            color, name = _ORDER_STYLE.get(order, ("k", order))
            ax.plot(xs, [np.nan if y is None else y for y in ys], "o-", color=color, label=name, ms=4)
        if blind.get(key) is not None:
            ax.axhline(blind[key], color="0.4", ls="--", lw=1, label="blind (all hidden)")
        ax.set_xlabel("encryption ratio")
        if key in ("leacc", "lnacc"):
            ax.set_ylim(-0.05, 1.05)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=8)
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def heterogeneity_figure(result: dict[str, Any], path: Path) -> Path:
    """Per client: HE ratio, LeAcc/LnAcc and PSNR (the reference client is unprotected)."""
    rows = result["clients"]
    names = [("ref" if r["unprotected"] else f"{r['cpu']:g} CPU") for r in rows]
    x = np.arange(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].bar(x, [r["he_ratio"] for r in rows], color="tab:purple")
    axes[0].set_title("HE ratio", fontsize=10)
    axes[1].bar(x - 0.2, [r["leacc"] for r in rows], width=0.4, label="LeAcc", color="0.6")
    axes[1].bar(x + 0.2, [r["lnacc"] for r in rows], width=0.4, label="LnAcc", color="tab:red")
    axes[1].set_title("iLRG label restoration", fontsize=10)
    axes[1].set_ylim(0, 1.05)
    axes[1].legend(fontsize=8)
    axes[2].bar(x, [np.nan if r["psnr"] is None else r["psnr"] for r in rows], color="tab:blue")
    axes[2].set_title("PSNR of reconstruction [dB]", fontsize=10)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=45, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle(result["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
