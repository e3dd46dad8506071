"""O2/O4 on the real runtime: a DDP job across the two locality groups while another tenant's bulk flows share the
inter-group uplink, with and without cooperation (`local_cloud.congestion_trial`, the trial `bench_congestion`
runs). Only the testbed has links to congest: on loopback the scenario says so and measures nothing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.local_cloud.congestion_trial import ArmResult, TrialShape, run_arm

__all__ = ["KEY", "congestion_scenario", "plot_congestion"]

KEY = "o2_o4_congestion"
REPARTITION = "repartition"
QUICK_WINDOW_S = 8.0
ARMS = {
    STATUS_QUO: "DDP kept, no compression allowed, no controller: the job does not know the link is shared.",
    COOPERATIVE: "fp16 and PowerSGD allowed in the job's ranges: the provider's micro loop, seeing the congestion "
                 "its agents measured on the job's path, turns compression on in place.",
}
REPARTITION_ARM = ("no compression allowed; the tenant's congestion repartitioner negotiates HSDP grouped by "
                   "locality at the congestion event, and the job restarts into it from its checkpoint.")


async def congestion_scenario(ctx: EvalContext) -> ScenarioResult:
    shape = TrialShape()
    if ctx.quick:
        shape = replace(shape, window_s=QUICK_WINDOW_S)
    arms = dict(ARMS) if ctx.quick else {**ARMS, REPARTITION: REPARTITION_ARM}
    result = ScenarioResult(
        key=KEY, title="O2/O4 congestion: another tenant's traffic on the inter-group link",
        how=(f"Real runtime, {ctx.info.network}. One DDP job of {shape.workers} workers (one per host, two per "
             f"locality group; the example MLP, hidden {shape.hidden}: ~1 MB of gradients all-reduced per step, "
             f"{shape.step_delay_ms:g} ms of compute stand-in). Cross-traffic: a congestion episode of slowdown "
             f"{shape.slowdown:g}, played as {round(shape.slowdown) - 1} bulk TCP flows between neighbour namespaces "
             f"over the same uplinks. samples/s over {shape.window_s:g} s windows from the job's own progress "
             "reports, uncongested and then congested once the arm's answer is in place."),
        arms=arms,
    )
    if not ctx.testbed:
        result.notes.append(f"Not measured: congestion needs the testbed's shaped links ({ctx.info.network}).")
        return result
    congested = result.metric("congested_samples_per_s", unit="samples/s", better="higher", target=">= 1.5x")
    uncongested = result.metric("uncongested_samples_per_s", unit="samples/s", better="higher")
    kept = result.metric("kept_fraction", unit="fraction", better="higher")
    detected = result.metric("event_at_tenant_s", unit="s", better="lower")
    runs: list[ArmResult] = []
    for _ in range(ctx.repeats):
        for arm in arms:
            run = await run_arm(ctx.probe, arm, shape)
            runs.append(run)
            congested.add(arm, run.congested.samples_per_s)
            uncongested.add(arm, run.uncongested.samples_per_s)
            kept.add(arm, run.kept)
            detected.add(arm, float("nan") if run.detected_s is None else run.detected_s)
    result.seeds = ctx.repeats
    result.series["runs"] = [run.as_dict() for run in runs]
    result.notes.append(
        "The repeats are sequential runs on the same cloud (the cross-traffic is not random: the repeats show "
        "the machine's own spread)."
    )
    if ctx.quick:
        result.notes.append("--quick: the tenant-side repartition arm (HSDP by locality) is left out; the full run "
                            "reports it beside the two arms.")
    result.notes.append("Time to a target loss is not reported here: the arms run for fixed windows.")
    return result


def plot_congestion(result: ScenarioResult, out_dir: Path) -> list[str]:
    """Grouped bars: each arm's samples/s uncongested and congested (mean over repeats, range as error bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "congested_samples_per_s" not in result.metrics:
        return []
    arms = list(result.metrics["congested_samples_per_s"].arms)
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.38
    for offset, (name, label) in enumerate((("uncongested_samples_per_s", "uncongested"),
                                            ("congested_samples_per_s", "congested"))):
        metric = result.metrics[name]
        means = [metric.mean(arm) or 0.0 for arm in arms]
        lows = [mean - min(metric.arms[arm]) for arm, mean in zip(arms, means, strict=True)]
        highs = [max(metric.arms[arm]) - mean for arm, mean in zip(arms, means, strict=True)]
        positions = [i + (offset - 0.5) * width for i in range(len(arms))]
        ax.bar(positions, means, width, yerr=[lows, highs], capsize=4, label=label)
    ax.set_xticks(range(len(arms)), [arm.replace("_", " ") for arm in arms])
    ax.set_ylabel("samples/s")
    ax.set_title("DDP job under cross-traffic on the inter-group link")
    ax.legend()
    fig.tight_layout()
    name = f"{result.key}.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]
