"""What an evaluation measured: per scenario, per metric, each arm's values over the seeds and the ratio of the
cooperative arm to the status quo. One shape for the runtime scenarios and the cluster simulation, so the report,
the plots and `results.json` treat them alike and a test can read every ratio.

`results.json`:

    {"meta": {...}, "scenarios": {"<scenario>": {
        "title": ..., "how": ..., "seeds": N, "arms": {"<arm>": "what that arm did"},
        "metrics": {"<metric>": {"unit": ..., "better": "lower" | "higher", "target": ... | null,
                                 "arms": {"<arm>": {"values": [...], "mean": ..., "min": ..., "max": ...}},
                                 "ratio": cooperative mean / status_quo mean | null}},
        "notes": [...], "plots": ["<file>.png", ...]}}}

The two compared arms are always named `status_quo` and `cooperative`; a scenario may add others (the cluster
simulation's `tenant_only`), reported beside them and compared in their own ratios (`ratios`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from statistics import fmean
from typing import Any, Literal

__all__ = ["COOPERATIVE", "STATUS_QUO", "Metric", "ScenarioResult", "write_results"]

STATUS_QUO = "status_quo"
COOPERATIVE = "cooperative"


@dataclass
class Metric:
    """One measured quantity, each arm's value per seed (or per repeat) in the order run."""

    name: str
    unit: str
    better: Literal["lower", "higher"]
    arms: dict[str, list[float]] = field(default_factory=dict)
    target: str | None = None
    """The issue's target in words ("<= 0.5x static"), shown beside the ratio; never used to decide anything."""

    def add(self, arm: str, value: float) -> None:
        self.arms.setdefault(arm, []).append(float(value))

    def mean(self, arm: str) -> float | None:
        values = [v for v in self.arms.get(arm, []) if math.isfinite(v)]
        return fmean(values) if values else None

    def ratio(self, arm: str = COOPERATIVE, to: str = STATUS_QUO) -> float | None:
        """`arm`'s mean over `to`'s; None where either is missing or `to`'s is zero."""
        top, bottom = self.mean(arm), self.mean(to)
        if top is None or bottom is None or bottom == 0:
            return None
        return top / bottom

    def as_dict(self) -> dict[str, Any]:
        arms: dict[str, Any] = {}
        for arm, values in self.arms.items():
            finite = [v for v in values if math.isfinite(v)]
            arms[arm] = {"values": [_clean(v) for v in values], "mean": self.mean(arm),
                         "min": min(finite) if finite else None, "max": max(finite) if finite else None}
        ratios = {arm: self.ratio(arm) for arm in self.arms if arm not in (STATUS_QUO, COOPERATIVE)}
        ratios.update({f"{COOPERATIVE}_vs_{arm}": self.ratio(COOPERATIVE, arm) for arm in list(ratios)})
        return {"unit": self.unit, "better": self.better, "target": self.target, "arms": arms,
                "ratio": self.ratio(), "ratios": ratios}


@dataclass
class ScenarioResult:
    """A scenario's two (or more) arms, run on the same seeds and inputs."""

    key: str
    title: str
    how: str
    """Where it ran and how (the real runtime on the testbed or loopback, or the cluster simulation)."""
    arms: dict[str, str]
    """Arm name -> what that arm did, in words, for the report."""
    seeds: int = 0
    metrics: dict[str, Metric] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    plots: list[str] = field(default_factory=list)
    series: dict[str, Any] = field(default_factory=dict)
    """Time series for the plots (not in results.json): whatever the scenario's plot function reads."""

    def metric(self, name: str, *, unit: str, better: Literal["lower", "higher"],
               target: str | None = None) -> Metric:
        """The metric `name`, created on first use."""
        if name not in self.metrics:
            self.metrics[name] = Metric(name=name, unit=unit, better=better, target=target)
        return self.metrics[name]

    def as_dict(self) -> dict[str, Any]:
        return {"title": self.title, "how": self.how, "seeds": self.seeds, "arms": self.arms,
                "metrics": {name: metric.as_dict() for name, metric in self.metrics.items()},
                "notes": self.notes, "plots": self.plots}


def write_results(path: Path, scenarios: list[ScenarioResult], meta: dict[str, Any]) -> None:
    """`results.json`: NaN and infinity become null, so any JSON reader can load it."""
    body = {"meta": meta, "scenarios": {s.key: s.as_dict() for s in scenarios}}
    path.write_text(json.dumps(body, indent=2, default=str, allow_nan=False))


def _clean(value: float) -> float | None:
    return value if math.isfinite(value) else None
