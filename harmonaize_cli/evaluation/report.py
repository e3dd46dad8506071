"""`report.md`: the headline table (every metric of every scenario: status quo, cooperative, the ratio, the issue's
target), then one section per scenario with what each arm did, how it ran, the number of seeds or repeats and the
spread, its notes (assumptions, what was not measured) and its plots. Numbers only from the results: nothing here
judges whether a target was met beyond printing both side by side.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, Metric, ScenarioResult

__all__ = ["headline_rows", "render_report", "write_report"]


def _num(value: float | None, unit: str = "") -> str:
    if value is None or not math.isfinite(value):
        return "–"
    if unit == "fraction" or (unit == "" and abs(value) <= 1.5):
        return f"{value:.3f}"
    magnitude = abs(value)
    text = f"{value:,.0f}" if magnitude >= 100 else f"{value:.2f}" if magnitude >= 1 else f"{value:.3f}"
    return text


def _spread(metric: Metric, arm: str) -> str:
    values = [v for v in metric.arms.get(arm, []) if math.isfinite(v)]
    mean = metric.mean(arm)
    if not values:
        return "–"
    text = _num(mean, metric.unit)
    if len(values) > 1:
        text += f" ({_num(min(values), metric.unit)}–{_num(max(values), metric.unit)})"
    return text


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def headline_rows(scenarios: list[ScenarioResult]) -> list[list[str]]:
    """One row per metric: scenario, metric (unit, which way is better), both arms, the ratio, the target."""
    rows = []
    for scenario in scenarios:
        for name, metric in scenario.metrics.items():
            rows.append([
                scenario.key, f"{name} ({metric.unit}, {metric.better} is better)",
                _spread(metric, STATUS_QUO), _spread(metric, COOPERATIVE), _ratio(metric.ratio()),
                metric.target or "",
            ])
    return rows


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _scenario_section(scenario: ScenarioResult) -> str:
    parts = [f"## {scenario.title} (`{scenario.key}`)", "", scenario.how, ""]
    parts += [f"- **{arm}**: {what}" for arm, what in scenario.arms.items()]
    parts += ["", f"Seeds or repeats per arm: {scenario.seeds or 'none run'}.", ""]
    extra = [arm for metric in scenario.metrics.values() for arm in metric.arms
             if arm not in (STATUS_QUO, COOPERATIVE)]
    arms = [STATUS_QUO, COOPERATIVE, *dict.fromkeys(extra)]
    if scenario.metrics:
        header = ["metric", *arms, "cooperative / status quo",
                  *[f"cooperative / {arm}" for arm in dict.fromkeys(extra)], "target"]
        rows = []
        for name, metric in scenario.metrics.items():
            rows.append([f"{name} ({metric.unit})", *[_spread(metric, arm) for arm in arms],
                         _ratio(metric.ratio()),
                         *[_ratio(metric.ratio(COOPERATIVE, arm)) for arm in dict.fromkeys(extra)],
                         metric.target or ""])
        parts += [_table(header, rows), ""]
    if scenario.notes:
        parts += ["Notes:", ""] + [f"- {note}" for note in scenario.notes] + [""]
    parts += [f"![{scenario.key}]({plot})" for plot in scenario.plots]
    return "\n".join(parts).rstrip() + "\n"


def render_report(scenarios: list[ScenarioResult], meta: dict[str, Any], failures: dict[str, str]) -> str:
    head = [
        "# HarmonAIze evaluation: what cooperation buys over the status quo", "",
        f"`{meta.get('command', 'harmonaize eval')}` at commit {meta.get('commit', '?')}, {meta.get('started', '?')}; "
        f"{meta.get('machine', '')}; {meta.get('duration_s', 0):.0f} s in all. Runtime network: "
        f"{meta.get('network', 'not started')}.", "",
        "Each scenario runs a *status quo* arm (no provider signals: failures found by timeouts, a fixed plan and "
        "size, periodic checkpoints, no carbon signal) and a *cooperative* arm (HarmonAIze's events, negotiation "
        "and micro loop) on the same seed, inputs and machine. The ratio is cooperative / status quo of the means; "
        "ranges are min–max over the seeds or repeats. A target the figures do not meet is reported as measured.",
        "", "## Headline", "",
        _table(["scenario", "metric", "status quo", "cooperative", "ratio", "target"], headline_rows(scenarios)),
        "",
    ]
    if failures:
        head += ["Scenarios that did not finish (their figures are missing, not zero):", ""]
        head += [f"- `{key}`: {why}" for key, why in failures.items()] + [""]
    return "\n".join(head) + "\n" + "\n".join(_scenario_section(s) for s in scenarios)


def write_report(path: Path, scenarios: list[ScenarioResult], meta: dict[str, Any], failures: dict[str, str]) -> None:
    path.write_text(render_report(scenarios, meta, failures))
