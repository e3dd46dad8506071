"""The cluster scenarios' own plots, from `ScenarioResult.series`: JCT CDFs and GPUs in use per arm (O3, O5 stress),
average JCT per workload (all workloads), ETTR and work lost per event (O5 at scale). PNGs, matplotlib's Agg backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from harmonaize_cli.evaluation.results import ScenarioResult

__all__ = ["plot_cluster"]


def plot_cluster(result: ScenarioResult, out_dir: Path) -> list[str]:
    """The plots `result.series` has data for; the file names written into `out_dir`."""
    import matplotlib

    matplotlib.use("Agg")
    names: list[str] = []
    series = result.series
    if "jct_s" in series:
        names.append(_jct_cdf(result, out_dir))
    if "usage" in series:
        names.append(_usage(result, out_dir))
    if "avg_jct_by_workload" in series:
        names.append(_by_workload(result, out_dir))
    if "ettr" in series:
        names.append(_ettr(result, out_dir))
    return names


def _label(arm: str) -> str:
    return arm.replace("_", " ")


def _save(fig: Any, out_dir: Path, name: str) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return name


def _jct_cdf(result: ScenarioResult, out_dir: Path) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, jcts in result.series["jct_s"].items():
        ordered = sorted(float(x) / 3600.0 for x in jcts)
        ax.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post", label=_label(arm))
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log scale)")
    ax.set_ylabel("fraction of jobs")
    ax.set_title(f"{result.title}\nJCT CDF, first seed", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, f"{result.key}-jct-cdf.png")


def _usage(result: ScenarioResult, out_dir: Path) -> str:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for arm, points in result.series["usage"].items():
        ax.step([float(t) / 3600.0 for t, _ in points], [n for _, n in points], where="post", label=_label(arm),
                linewidth=1)
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("GPUs placed (of 64)")
    ax.set_title(f"{result.title}\nGPUs placed over time, first seed", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out_dir, f"{result.key}-gpus-in-use.png")


def _by_workload(result: ScenarioResult, out_dir: Path) -> str:
    import matplotlib.pyplot as plt

    data: dict[str, list[float]] = result.series["avg_jct_by_workload"]
    workloads: list[int] = result.series["workloads"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / max(len(data), 1)
    for i, (arm, values) in enumerate(data.items()):
        ax.bar([w + (i - (len(data) - 1) / 2) * width for w in workloads], [v / 3600.0 for v in values], width,
               label=_label(arm))
    ax.set_xticks(workloads)
    ax.set_xlabel("Pollux workload")
    ax.set_ylabel("average JCT (h)")
    ax.set_title(result.title, fontsize=9)
    ax.legend(fontsize=8)
    return _save(fig, out_dir, f"{result.key}-avg-jct.png")


def _ettr(result: ScenarioResult, out_dir: Path) -> str:
    import matplotlib.pyplot as plt

    ettr: dict[str, list[float]] = result.series["ettr"]
    notice: dict[str, list[float]] = result.series.get("lost_with_notice", {})
    no_notice: dict[str, list[float]] = result.series.get("lost_without_notice", {})
    arms = list(ettr)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    means = [sum(v) / len(v) for v in ettr.values()]
    spread = [[m - min(v) for m, v in zip(means, ettr.values(), strict=True)],
              [max(v) - m for m, v in zip(means, ettr.values(), strict=True)]]
    left.bar(range(len(arms)), means, yerr=spread, capsize=3)
    left.axhline(0.97, color="black", linestyle="--", linewidth=1, label="target 0.97")
    left.set_ylim(min(0.85, min(means) - 0.02), 1.0)
    left.set_xticks(range(len(arms)), [_label(a) for a in arms], rotation=20, ha="right", fontsize=7)
    left.set_ylabel("effective training time ratio")
    left.legend(fontsize=8)

    def mean(values: list[float]) -> float:
        finite = [v for v in values if v == v]
        return sum(finite) / len(finite) if finite else 0.0

    x = range(len(arms))
    right.bar([i - 0.2 for i in x], [mean(notice.get(a, [])) for a in arms], 0.4, label="with notice")
    right.bar([i + 0.2 for i in x], [mean(no_notice.get(a, [])) for a in arms], 0.4, label="without notice")
    right.set_xticks(list(x), [_label(a) for a in arms], rotation=20, ha="right", fontsize=7)
    right.set_ylabel("training redone per event (h)")
    right.legend(fontsize=8)
    fig.suptitle(result.title, fontsize=9)
    return _save(fig, out_dir, f"{result.key}-ettr.png")
