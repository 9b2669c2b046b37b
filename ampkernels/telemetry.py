"""Plots of FusedGradScaler's device-side telemetry (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def plot_scale_history(source, path: str | Path, *, title: str = "Loss scale") -> Path:
    """Write a PNG of the loss scale after each update (log scale), with skipped steps marked.

    Args:
        source: a ``FusedGradScaler`` built with ``telemetry=True``, or a sequence of scale values.
        path: where to write the PNG.
    Returns the path written. Raises ``ImportError`` naming matplotlib when it is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # optional dependency
        raise ImportError("plot_scale_history needs matplotlib: pip install matplotlib") from exc

    if hasattr(source, "telemetry"):
        info = source.telemetry()
        history: Sequence[float] = info["scale_history"]
        first_step = info["updates"] - len(history)
        subtitle = f"{info['updates']} updates, {info['skipped_steps']} skipped"
    else:
        history, first_step, subtitle = list(source), 0, f"{len(source)} updates"
    steps = list(range(first_step + 1, first_step + len(history) + 1))
    # A step was skipped exactly when the scale went down.
    drops = [s for s, prev, cur in zip(steps[1:], history, history[1:]) if cur < prev]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.step(steps, history, where="post", color="tab:blue", label="scale")
    if drops:
        ax.scatter(
            drops,
            [history[s - first_step - 1] for s in drops],
            color="tab:red",
            s=12,
            zorder=3,
            label="overflow (step skipped)",
        )
    ax.set_yscale("log", base=2)
    ax.set_xlabel("update")
    ax.set_ylabel("loss scale")
    ax.set_title(f"{title} ({subtitle})")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
