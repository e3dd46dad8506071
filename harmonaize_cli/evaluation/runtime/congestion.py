"""O2/O4 on the real runtime: a DDP job across the two locality groups while another tenant's bulk flows share the
inter-group uplink, with and without cooperation (`local_cloud.congestion_trial`, the trial `bench_congestion`
runs). Only the testbed has links to congest: on loopback the scenario says so and measures nothing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.evaluation.runtime.congestion_loss import LOG_EVERY, SMOOTH, LossRun, run_to_loss
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
             "reports, uncongested and then congested once the arm's answer is in place. Then, per arm, the same job "
             "submitted while the flows already run, trained to a target loss (the mean of the last "
             f"{SMOOTH} losses rank 0 logs every {LOG_EVERY} steps): the wall time from its first step."),
        arms=arms,
    )
    if not ctx.testbed:
        result.notes.append(f"Not measured: congestion needs the testbed's shaped links ({ctx.info.network}).")
        return result
    congested = result.metric("congested_samples_per_s", unit="samples/s", better="higher", target=">= 1.5x")
    uncongested = result.metric("uncongested_samples_per_s", unit="samples/s", better="higher")
    kept = result.metric("kept_fraction", unit="fraction", better="higher")
    detected = result.metric("event_at_tenant_s", unit="s", better="lower")
    to_loss = result.metric("time_to_target_loss_s", unit="s", better="lower")
    steps_to_loss = result.metric("steps_to_target_loss", unit="steps", better="lower")
    runs: list[ArmResult] = []
    loss_runs: list[LossRun] = []
    for repeat in range(ctx.repeats):
        for arm in arms:
            run = await run_arm(ctx.probe, arm, shape, suffix=f"-r{repeat}")
            runs.append(run)
            congested.add(arm, run.congested.samples_per_s)
            uncongested.add(arm, run.uncongested.samples_per_s)
            kept.add(arm, run.kept)
            detected.add(arm, float("nan") if run.detected_s is None else run.detected_s)
        for arm in arms:
            loss_run = await run_to_loss(ctx, arm, shape, repeat=repeat)
            loss_runs.append(loss_run)
            to_loss.add(arm, float("nan") if loss_run.time_to_target_s is None else loss_run.time_to_target_s)
            steps_to_loss.add(arm, float("nan") if loss_run.steps_to_target is None else loss_run.steps_to_target)
    result.seeds = ctx.repeats
    result.series["runs"] = [run.as_dict() for run in runs]
    result.series["loss_runs"] = [run.as_dict() for run in loss_runs]
    result.notes.append(
        "The repeats are sequential runs on the same cloud (the cross-traffic is not random: the repeats show "
        "the machine's own spread)."
    )
    if ctx.quick:
        result.notes.append("--quick: the tenant-side repartition arm (HSDP by locality) is left out; the full run "
                            "reports it beside the two arms.")
    target = loss_runs[0].target_loss if loss_runs else float("nan")
    result.notes.append(
        f"time_to_target_loss_s: target loss {target:g}; the congestion is on from before the job's submission to "
        "the end of the run (back-to-back episodes of the same slowdown), so each arm's answer time (event, "
        "compression turned on, or negotiation and restart) is inside it. A run that had not reached the target "
        "after its time limit counts as NaN. The same step's loss differs between arms only through the plan and "
        "the compression (the batches are seeded per step and rank)."
    )
    for loss_run in loss_runs:
        reached = ("not reached" if loss_run.time_to_target_s is None else
                   f"{loss_run.time_to_target_s:.1f} s, step {loss_run.steps_to_target}")
        result.notes.append(f"{loss_run.job}: to loss {loss_run.target_loss:g}: {reached}.")
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
    return [name, *_plot_loss(result, out_dir)]


def _plot_loss(result: ScenarioResult, out_dir: Path) -> list[str]:
    """Each arm's smoothed loss over time from its first step (the first repeat), under congestion, and the target."""
    import matplotlib.pyplot as plt

    loss_runs = result.series.get("loss_runs") or []
    if not loss_runs:
        return []
    fig, ax = plt.subplots(figsize=(7, 4))
    seen: set[str] = set()
    for run in loss_runs:
        if run["arm"] in seen or not run["losses"]:
            continue
        seen.add(run["arm"])
        times = [point[0] for point in run["losses"]]
        losses = [point[2] for point in run["losses"]]
        smoothed = [sum(losses[max(0, i - SMOOTH + 1):i + 1]) / len(losses[max(0, i - SMOOTH + 1):i + 1])
                    for i in range(len(losses))]
        ax.plot(times, smoothed, label=str(run["arm"]).replace("_", " "))
    ax.axhline(loss_runs[0]["target_loss"], color="black", linestyle="--", linewidth=0.8, label="target")
    ax.set_xlabel("seconds since the job's first step (link congested throughout)")
    ax.set_ylabel(f"loss (mean of the last {SMOOTH} logged)")
    ax.set_ylim(top=0.1)
    ax.set_title("Time to a target loss under cross-traffic")
    ax.legend()
    fig.tight_layout()
    name = f"{result.key}-loss.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]
