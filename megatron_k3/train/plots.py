"""PNG plots of a run's metrics.jsonl: loss (and lr), and routing health per MoE layer."""
from __future__ import annotations

import json
import os


def load_metrics(run_dir: str) -> list[dict]:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}")
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_run(run_dir: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = load_metrics(run_dir)
    steps = [r["step"] for r in recs]
    out = []
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [r["lm_loss"] for r in recs], label="lm loss")
    if "mtp_loss" in recs[0]:
        ax.plot(steps, [r["mtp_loss"] for r in recs], label="mtp loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax2 = ax.twinx()
    ax2.plot(steps, [r["lr"] for r in recs], color="grey", alpha=0.5, label="lr")
    ax2.set_ylabel("lr")
    ax.legend(loc="upper right")
    ax.set_title("loss")
    fig.tight_layout()
    out.append(os.path.join(run_dir, "loss.png"))
    fig.savefig(out[-1], dpi=100)
    plt.close(fig)
    layers = sorted({k.split("/")[1] for k in recs[0] if k.startswith("moe/")}, key=lambda s: (len(s), s))
    if layers:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        for name in layers:
            for ax, key in zip(axes, ("entropy", "dead", "max_mean")):
                ax.plot(steps, [r[f"moe/{name}/{key}"] for r in recs], label=f"layer {name}")
        for ax, title in zip(axes, ("routing entropy (0..1)", "dead experts", "max / mean load")):
            ax.set_title(title)
            ax.set_xlabel("step")
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        out.append(os.path.join(run_dir, "routing.png"))
        fig.savefig(out[-1], dpi=100)
        plt.close(fig)
    return out
