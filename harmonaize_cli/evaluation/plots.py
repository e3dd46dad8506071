"""The plot every scenario gets: each metric's arms as a multiple of the status quo (1.0 = no difference), so the
report shows at a glance which way cooperation moved each figure. Scenario-specific plots live with their scenario.
"""

from __future__ import annotations

from pathlib import Path

from harmonaize_cli.evaluation.results import STATUS_QUO, ScenarioResult

__all__ = ["plot_ratios"]


def plot_ratios(result: ScenarioResult, out_dir: Path) -> list[str]:
    """Horizontal bars: per metric, every other arm's mean over the status quo's; none when nothing was measured."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: list[tuple[str, str, float]] = []
    for name, metric in result.metrics.items():
        for arm in metric.arms:
            ratio = metric.ratio(arm, STATUS_QUO) if arm != STATUS_QUO else None
            if ratio is not None:
                rows.append((f"{name} ({metric.better} is better)", arm, ratio))
    if not rows:
        return []
    arms = list(dict.fromkeys(arm for _, arm, _ in rows))
    labels = list(dict.fromkeys(label for label, _, _ in rows))
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.45 * len(labels) * len(arms)))
    height = 0.8 / len(arms)
    for index, arm in enumerate(arms):
        values = {label: ratio for label, a, ratio in rows if a == arm}
        positions = [i + index * height for i, label in enumerate(labels) if label in values]
        ax.barh(positions, [values[label] for label in labels if label in values], height, label=arm)
    ax.axvline(1.0, color="black", linewidth=1)
    ax.set_yticks([i + height * (len(arms) - 1) / 2 for i in range(len(labels))], labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("x the status quo (1.0: no difference)")
    ax.set_title(result.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = f"{result.key}-ratios.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]
