"""The evaluation as one run: the cluster simulation (seconds), then the runtime scenarios in one local cloud, then
plots, `results.json` and `report.md` in the output directory. A scenario that fails is written into the report
with its reason and the others still run: a partial evaluation that says what is missing beats none.
"""

from __future__ import annotations

import asyncio
import platform
import subprocess
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from harmonaize_cli.evaluation.plots import plot_ratios
from harmonaize_cli.evaluation.report import headline_rows, write_report
from harmonaize_cli.evaluation.results import ScenarioResult, write_results
from harmonaize_cli.evaluation.runtime.cloud import RuntimeScenario, run_runtime_scenarios

__all__ = ["GROUPS", "EvalOptions", "run_evaluation"]

GROUPS = ("cluster", "carbon", "congestion", "adaptation", "reliability")
"""What `--only` selects: the cluster simulation (O3, O5 at scale) and each runtime scenario."""

PlotFn = Callable[[ScenarioResult, Path], list[str]]


@dataclass(frozen=True)
class EvalOptions:
    out: Path
    quick: bool = False
    seeds: int | None = None
    """Seeds of the simulation and repeats of each runtime arm (default: 1 with --quick, else 5 and 3)."""
    only: frozenset[str] = frozenset(GROUPS)
    elastic_json: Path | None = None
    """bench_elastic's JSON the simulation reads its per-action costs from (default: the one shipped)."""
    testbed: bool = True
    uplink_mbit: float = 50.0
    seed: int = 0
    command: str = "harmonaize eval"
    log: Callable[[str], None] = print


@dataclass
class _Collected:
    results: list[ScenarioResult] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    plots: dict[str, PlotFn] = field(default_factory=dict)


def _runtime_scenarios(only: frozenset[str]) -> tuple[list[tuple[str, RuntimeScenario]], dict[str, PlotFn]]:
    scenarios: list[tuple[str, RuntimeScenario]] = []
    plots: dict[str, PlotFn] = {}
    if "carbon" in only:  # first: it finds the carbon replay near its start, whose first solar dip is hours 16-24
        from harmonaize_cli.evaluation.runtime import carbon

        scenarios.append((carbon.KEY, carbon.carbon_scenario))
        plots[carbon.KEY] = carbon.plot_carbon
    if "congestion" in only:
        from harmonaize_cli.evaluation.runtime import congestion

        scenarios.append((congestion.KEY, congestion.congestion_scenario))
        plots[congestion.KEY] = congestion.plot_congestion
    if "adaptation" in only:
        from harmonaize_cli.evaluation.runtime import adaptation

        scenarios.append((adaptation.KEY, adaptation.adaptation_scenario))
        plots[adaptation.KEY] = adaptation.plot_adaptation
    if "reliability" in only:
        from harmonaize_cli.evaluation.runtime import reliability

        scenarios.append((reliability.KEY, reliability.reliability_scenario))
        plots[reliability.KEY] = reliability.plot_reliability
    return scenarios, plots


def _cluster(options: EvalOptions, collected: _Collected) -> None:
    from harmonaize_cli.evaluation.cluster import plot_cluster, run_cluster_scenarios

    seeds = options.seeds or (1 if options.quick else 5)
    started = time.monotonic()
    try:
        results = run_cluster_scenarios(quick=options.quick, seeds=seeds, costs=options.elastic_json)
    except Exception as error:  # noqa: BLE001 - the report says why; the runtime scenarios still run
        collected.failures["cluster"] = f"{type(error).__name__}: {error}"
        options.log(f"cluster simulation failed: {error}")
        return
    for result in results:
        collected.results.append(result)
        collected.plots[result.key] = plot_cluster
    options.log(f"cluster simulation: {len(results)} scenarios, {seeds} seed(s), {time.monotonic() - started:.0f} s")


def _runtime(options: EvalOptions, collected: _Collected) -> str:
    scenarios, plots = _runtime_scenarios(options.only)
    if not scenarios:
        return "not started"
    collected.plots.update(plots)
    repeats = options.seeds or (1 if options.quick else 3)

    def done(result: ScenarioResult) -> None:
        collected.results.append(result)
        options.log(f"{result.key}: done")

    def failed(key: str, error: BaseException) -> None:
        collected.failures[key] = f"{type(error).__name__}: {error}"
        options.log(f"{key} failed: {error}")

    with tempfile.TemporaryDirectory(prefix="hz-eval-cloud-") as data_dir:
        return asyncio.run(run_runtime_scenarios(
            scenarios, data_dir=Path(data_dir), out_dir=options.out, quick=options.quick, repeats=repeats,
            seed=options.seed, uplink_mbit=options.uplink_mbit if options.testbed else None,
            on_result=done, on_failure=failed,
        ))


def _draw(collected: _Collected, out: Path) -> None:
    for result in collected.results:
        specific = collected.plots.get(result.key)
        try:
            result.plots = (specific(result, out) if specific is not None else []) + plot_ratios(result, out)
        except Exception as error:  # noqa: BLE001 - a broken plot must not lose the figures
            result.notes.append(f"Plot failed: {type(error).__name__}: {error}")


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() if head.returncode == 0 else "unknown (not a git checkout)"


def run_evaluation(options: EvalOptions) -> dict[str, Any]:
    """Run what `options` selects; write report.md, results.json and the plots into `options.out`; return the
    meta block (it also lands in results.json)."""
    options.out.mkdir(parents=True, exist_ok=True)
    started, clock = datetime.now(UTC), time.monotonic()
    collected = _Collected()
    if "cluster" in options.only:
        _cluster(options, collected)
    network = _runtime(options, collected)
    _draw(collected, options.out)
    meta: dict[str, Any] = {
        "command": options.command, "commit": _commit(), "started": started.isoformat(timespec="seconds"),
        "machine": f"{platform.node()}: {platform.system()} {platform.release()}, Python {platform.python_version()}",
        "duration_s": time.monotonic() - clock, "quick": options.quick, "seed": options.seed, "network": network,
        "failures": collected.failures,
    }
    order = {key: index for index, key in enumerate(sorted(r.key for r in collected.results))}
    results = sorted(collected.results, key=lambda r: order[r.key])
    write_results(options.out / "results.json", results, meta)
    write_report(options.out / "report.md", results, meta, collected.failures)
    for row in headline_rows(results):
        options.log("  " + " | ".join(row))
    return meta
