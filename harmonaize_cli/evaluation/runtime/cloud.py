"""One local cloud for the runtime scenarios: started once (on the testbed where this machine can build it, loopback
otherwise), each scenario played in it in turn, both of its arms one after the other on the same hosts, so the arms
share the machine, the broker, the API and the code, and differ only in the cooperation.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from harmonaize.settings import Settings
from harmonaize_cli.evaluation.results import ScenarioResult
from harmonaize_cli.local_cloud.fleet import LocalFleet, fleet_of
from harmonaize_cli.local_cloud.launcher import LocalCloudInfo, run_local_cloud
from harmonaize_cli.local_cloud.tenant_probe import TenantProbe

__all__ = ["EvalContext", "RuntimeScenario", "carbon_speedup", "eval_scenario", "run_runtime_scenarios"]


def carbon_speedup(quick: bool) -> float:
    """How much faster than real time the cloud replays the carbon trace: a trace hour every 5 s with --quick (a
    day in 2 minutes), every 15 s otherwise, so a job's start-up and rescales stay short against the hours."""
    return 720.0 if quick else 240.0


def eval_scenario(speedup: float) -> str:
    """The evaluation cloud's fleet: the local cloud's quiet one (4 hosts of 4 GPUs in 2 groups, nothing scripted)
    with the CAISO carbon trace replayed at `speedup`, the one ambient signal."""
    return (
        "version: 1\nseed: 42\nhosts:\n"
        + "".join(f"  h{i}: {{locality_group: g{(i + 1) // 2}, gpus: 4, region: US-CAL-CISO}}\n" for i in range(1, 5))
        + "fabric: {intra_group_gbps: 400, inter_group_gbps: 100}\n"
        + f"carbon:\n  US-CAL-CISO: {{trace: caiso, speedup: {speedup:g}, forecast_points: 24}}\n"
    )


@dataclass
class EvalContext:
    """What a runtime scenario gets: the running cloud, its demo tenant as a probe, and the run's settings."""

    info: LocalCloudInfo
    fleet: LocalFleet
    probe: TenantProbe
    quick: bool
    repeats: int
    """How many times each arm runs (the spread the report shows); 1 with `--quick`."""
    seed: int
    out_dir: Path
    """Where the scenario may write files of its own (logs it wants to keep); the plots are written by the report."""

    @property
    def testbed(self) -> bool:
        """Whether the hosts are network namespaces with shaped links (congestion is real only then)."""
        return self.fleet.testbed is not None


RuntimeScenario = Callable[[EvalContext], Awaitable[ScenarioResult]]
"""Runs both arms of one scenario in the cloud and returns what they measured; leaves the cloud as it found it
(its jobs released, its hosts up), so the next scenario starts on a quiet fleet."""


async def run_runtime_scenarios(
    scenarios: list[tuple[str, RuntimeScenario]], *, data_dir: Path, out_dir: Path, quick: bool, repeats: int,
    seed: int, uplink_mbit: float | None, on_result: Callable[[ScenarioResult], None] = lambda result: None,
    on_failure: Callable[[str, BaseException], None] = lambda key, error: None,
) -> str:
    """Start the cloud in `data_dir` (fresh), play every scenario, stop it; returns the cloud's network line.

    A scenario that fails is reported through `on_failure` (the evaluation records why) and the next one runs: one
    broken scenario does not take the others' figures with it."""
    network: list[str] = []

    async def story(info: LocalCloudInfo, fleet: LocalFleet | None) -> None:
        network.append(info.network)
        if fleet is None:
            raise RuntimeError("the local cloud started without its fleet")
        probe = TenantProbe(info.data_dir)
        await probe.listen()
        try:
            context = EvalContext(info=info, fleet=fleet, probe=probe, quick=quick, repeats=repeats, seed=seed,
                                  out_dir=out_dir)
            for key, scenario in scenarios:
                try:
                    on_result(await scenario(context))
                except Exception as error:  # noqa: BLE001 - recorded in the report, then the next scenario
                    on_failure(key, error)
        finally:
            await probe.close()

    settings = Settings(_env_file=None, data_dir=data_dir, api_port=0)
    scenario = data_dir / "eval-scenario.yaml"
    scenario.write_text(eval_scenario(carbon_speedup(quick)))
    await run_local_cloud(settings, hosts=fleet_of(4), scenario=scenario, story=story, testbed_mbit=uplink_mbit)
    return network[0] if network else "?"
