"""The shape every scenario reports in, and the report written from it: ratios, missing values, NaN."""

from __future__ import annotations

import json
import math
from pathlib import Path

from harmonaize_cli.evaluation.report import render_report
from harmonaize_cli.evaluation.results import ScenarioResult, write_results


def _scenario() -> ScenarioResult:
    result = ScenarioResult(key="demo", title="Demo", how="by hand", arms={"status_quo": "a", "cooperative": "b"},
                            seeds=2)
    metric = result.metric("jct_s", unit="s", better="lower", target="<= 0.5x")
    for value in (100.0, 120.0):
        metric.add("status_quo", value)
    for value in (40.0, 60.0):
        metric.add("cooperative", value)
    metric.add("tenant_only", 80.0)
    result.metric("lost", unit="steps", better="lower").add("status_quo", 3.0)
    return result


def test_ratio_is_the_means_and_missing_arms_give_none() -> None:
    result = _scenario()
    assert result.metrics["jct_s"].ratio() == 50.0 / 110.0
    assert result.metrics["jct_s"].ratio("cooperative", "tenant_only") == 50.0 / 80.0
    assert result.metrics["lost"].ratio() is None


def test_results_json_is_strict_json_with_nan_as_null(tmp_path: Path) -> None:
    result = _scenario()
    result.metrics["jct_s"].add("cooperative", math.nan)
    write_results(tmp_path / "r.json", [result], {"quick": True})
    body = json.loads((tmp_path / "r.json").read_text())
    jct = body["scenarios"]["demo"]["metrics"]["jct_s"]
    assert jct["arms"]["cooperative"]["values"] == [40.0, 60.0, None]
    assert jct["arms"]["cooperative"]["mean"] == 50.0
    assert jct["ratios"]["cooperative_vs_tenant_only"] == 50.0 / 80.0
    assert body["scenarios"]["demo"]["metrics"]["lost"]["ratio"] is None


def test_report_shows_both_arms_spread_ratio_target_and_failures() -> None:
    text = render_report([_scenario()], {"commit": "abc", "duration_s": 3.0}, {"o5_runtime": "TimeoutError: x"})
    assert "| demo | jct_s (s, lower is better) | 110 (100–120) | 50.00 (40.00–60.00) | 0.45x | <= 0.5x |" in text
    assert "| lost (steps) | 3.00 | – | – |" in text
    assert "`o5_runtime`: TimeoutError: x" in text
