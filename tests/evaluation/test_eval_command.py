"""`harmonaize eval --quick --out DIR`, the real command, as CI runs it: a cluster simulation and the runtime
scenarios in a fresh local cloud (on the testbed where the machine can build one). The test checks what the
evaluation writes (report.md, one PNG or more per measured scenario, results.json with both arms and the ratio for
every metric), not whether cooperation won: the benefit is the evaluation's finding, not a test's assumption.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from provider_agents.testbed.netns import unavailable

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

RUNTIME = {"o6_carbon", "o2_o4_congestion", "o1_adaptation", "o5_reliability"}
CLUSTER = {"o3_cluster", "o5_cluster_stress", "o5_large_job"}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _eval(*args: str, timeout: float = 1400) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harmonaize_cli", "eval", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _finite(values: list[Any]) -> list[float]:
    return [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]


def _diagnosis(out: Path, scenario: dict[str, Any], lines: int = 30) -> str:
    """The scenario's notes and the end of every log the evaluation kept (`kept_logs`): what a missing value needs."""
    parts = [f"notes: {note}" for note in scenario["notes"]]
    for log in sorted((out / "logs").glob("*/*.log")):
        text = log.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"--- {log.relative_to(out)} (last {len(text)} lines)\n" + "\n".join(text))
    return "\n".join(parts) or "no notes, no kept logs"


def test_quick_eval_writes_report_plots_and_every_metric_for_both_arms(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    done = _eval("--quick", "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    report = (out / "report.md").read_text()
    scenarios: dict[str, Any] = results["scenarios"]
    assert RUNTIME | CLUSTER <= set(scenarios), sorted(scenarios)
    assert results["meta"]["failures"] == {}
    testbed = unavailable() is None
    assert results["meta"]["network"].startswith("testbed" if testbed else "loopback"), results["meta"]["network"]
    for key, scenario in scenarios.items():
        assert f"`{key}`" in report
        if key == "o2_o4_congestion" and not testbed:
            assert not scenario["metrics"] and "Not measured" in " ".join(scenario["notes"])
            continue
        assert scenario["metrics"], f"{key} measured nothing"
        assert scenario["seeds"] >= 1
        assert {"status_quo", "cooperative"} <= set(scenario["arms"]), key
        for name, metric in scenario["metrics"].items():
            for arm in ("status_quo", "cooperative"):
                assert _finite(metric["arms"][arm]["values"]), f"{key}.{name}: no value for {arm}\n" + _diagnosis(
                    out, scenario)
            expected = metric["arms"]["cooperative"]["mean"] / metric["arms"]["status_quo"]["mean"] \
                if metric["arms"]["status_quo"]["mean"] else None
            assert metric["ratio"] == pytest.approx(expected), f"{key}.{name}"
            assert metric["better"] in ("lower", "higher")
        assert scenario["plots"], f"{key}: no plot"
        for plot in scenario["plots"]:
            assert (out / plot).read_bytes()[:8] == PNG_MAGIC, plot
            assert f"]({plot})" in report


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "bogus"], "--only: unknown part(s) bogus"),
        (["--elastic-json", "no-such.json"], "--elastic-json: no such file"),
    ],
)
def test_bad_options_are_refused_naming_the_problem(tmp_path: Path, args: list[str], message: str) -> None:
    done = _eval("--out", str(tmp_path / "x"), *args, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert not (tmp_path / "x").exists()
