"""Pictures of a run: the loss curve."""

from __future__ import annotations


def loss_curve(log: dict, path: str) -> str:
    """Writes a PNG of loss against step from a run log and returns its path.

    Example:
        >>> import os, tempfile
        >>> log = {"config": {"model": "gpt2-tiny"}, "steps": [{"step": 1, "loss": 5.5}, {"step": 2, "loss": 5.1}]}
        >>> png = loss_curve(log, f"{tempfile.mkdtemp()}/loss.png")
        >>> os.path.basename(png), os.path.getsize(png) > 0
        ('loss.png', True)
    """
    import matplotlib  # here, not at import: `import zinfjax` stays free of matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in log["steps"]]
    losses = [s["loss"] for s in log["steps"]]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    ax.plot(steps, losses, color="tab:blue", linewidth=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    cfg = log.get("config", {})
    ax.set_title(f"{cfg.get('model', '')}  stage {cfg.get('stage', '')}  params={cfg.get('params', '')}"
                 f"  optimizer={cfg.get('optimizer', '')}", fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
