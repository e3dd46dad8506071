"""O5 reliability on the real runtime: a 3-worker DDP job lives through host failures, some unannounced, some
announced ahead with the clouds' real notice lead times (scaled down), in two arms on the same seeded event sequence.

* `cooperative`: the job runs in the local cloud (one worker per host, the demo tenant) and the tenant runs the
  example failure guard (`tenant_controllers/examples/failure_guard.py`). An announced failure is a predicted
  failure injected on the victim host (`PredictedFailureSpec`, at = now, eta = now + lead): the guard negotiates a
  replacement with the eta as deadline, the provider starts the joiner on a healthy host and the job moves in place.
  At the eta the host dies (kill -9 of its agent and its node, `LocalFleet.kill_host`), whether the job is still
  there or not. An unplanned failure is the same kill without notice: the survivors re-form in place.
* `status_quo`: the same script with the same arguments under plain torchrun (`torchrun_job`): c10d rendezvous,
  `--nnodes=1:3`, `--max-restarts=3`, checkpoints every N steps to a shared directory; no provider signal, so an
  announced failure simply happens at its eta. torchrun finds it through the failed collective and restarts every
  worker from the latest checkpoint; a replacement node is started at once.

Every figure is read from rank 0's step lines in the node logs (`job_log`), the same way in both arms. The events fire
at fixed training steps (the same in both arms), so both arms face them at the same point of the job's progress.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable
from pathlib import Path
from statistics import fmean
from typing import Any

from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO, ScenarioResult
from harmonaize_cli.evaluation.runtime.cloud import EvalContext
from harmonaize_cli.evaluation.runtime.reliability_arms import (
    CHECKPOINT_INTERVAL,
    CHECKPOINT_RANGE,
    ENTRYPOINT,
    STEP_DELAY_MS,
    WORKERS,
    cooperative_round,
    status_quo_round,
)
from harmonaize_cli.evaluation.runtime.reliability_events import (
    CHANNELS,
    DRAWN_CHANNELS,
    FIRST_EVENT_STEPS,
    LEAD_SCALE,
    LOSS_WINDOW,
    TAIL_STEPS,
    FailureEvent,
    RoundRun,
    event_rounds,
)
from harmonaize_cli.evaluation.runtime.torchrun_job import reap, run_marker_prefix

__all__ = ["KEY", "plot_reliability", "reliability_scenario"]

KEY = "o5_reliability"
_log = logging.getLogger(__name__)
TITLE = "O5 reliability: host failures without and with notice"

# -- the scenario -----------------------------------------------------------------------------------------------------

ARMS = {
    STATUS_QUO: (f"Plain torchrun: {WORKERS} nodes (`--nnodes=1:{WORKERS}`, c10d on a loopback port, "
                 f"`--max-restarts=3`, `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`), checkpoints every "
                 f"{CHECKPOINT_INTERVAL} steps to a shared directory. No provider signal: an announced failure "
                 "happens unannounced at its eta; torchrun finds it through the failed collective and restarts "
                 "every worker from the latest checkpoint. A replacement node is started at once (a generous "
                 "status quo: an auto-restarting scheduler); the first node hosts the rendezvous store and is "
                 "never the victim (torchrun's favourable case: killing it ends the job)."),
    COOPERATIVE: (f"The local cloud: {WORKERS} workers, one per host, in place (DDP), checkpoint interval "
                  f"{CHECKPOINT_RANGE[0]}..{CHECKPOINT_RANGE[1]} allowed (starting at {CHECKPOINT_INTERVAL}); the "
                  "tenant runs the example failure guard. A notice reaches the tenant as a predicted failure "
                  "(eta = the failure): the guard negotiates a replacement before it and the job moves in place; "
                  "with a notice shorter than a worker's start (the guard's HZ_REPLACE_MIN_LEAD_S, 10 s) it moves "
                  "the worker off first, one fewer, instead of waiting for a joiner the host may not outlive. "
                  "Without notice the survivors re-form in place; once the host is back up the tenant asks for "
                  f"{WORKERS} workers again."),
}


async def reliability_scenario(ctx: EvalContext) -> ScenarioResult:
    """Both arms on the same seeded events, `ctx.repeats` times (seeds seed, seed + 1, ...)."""
    started = time.monotonic()
    result = ScenarioResult(key=KEY, title=TITLE, how=_how(ctx), arms=dict(ARMS))
    metrics = {
        "steps_lost_per_event": result.metric("steps_lost_per_event", unit="steps", better="lower"),
        "steps_lost_with_notice": result.metric("steps_lost_with_notice", unit="steps", better="lower", target="0"),
        "ettr": result.metric("ettr", unit="fraction", better="higher", target=">= 0.97"),
        "recovery_s_per_event": result.metric("recovery_s_per_event", unit="s", better="lower"),
        "time_to_target_s": result.metric("time_to_target_s", unit="s", better="lower"),
        "loss_at_target": result.metric("loss_at_target", unit="MSE", better="lower"),
    }
    prefix = run_marker_prefix()
    workdir = ctx.info.data_dir / "o5-status-quo"
    runs: list[RoundRun] = []

    def log(line: str) -> None:
        _log.info("[%6.1f s] %s", time.monotonic() - started, line)

    try:
        for repeat in range(ctx.repeats):
            seed = ctx.seed + repeat
            rounds = event_rounds(seed, quick=ctx.quick)
            order = (STATUS_QUO, COOPERATIVE) if repeat % 2 == 0 else (COOPERATIVE, STATUS_QUO)
            for arm in order:
                arm_runs: list[RoundRun] = []
                for index, rnd in enumerate(rounds):
                    log(f"o5 reliability: repeat {repeat + 1}/{ctx.repeats}, {arm}, round {index + 1}/{len(rounds)}: "
                        + ", ".join(_describe(event) for event in rnd.events))
                    runner: Awaitable[RoundRun]
                    if arm == STATUS_QUO:
                        runner = status_quo_round(workdir, prefix, rnd, repeat=repeat, seed=seed, index=index,
                                                   log=log)
                    else:
                        runner = cooperative_round(ctx, rnd, repeat=repeat, seed=seed, index=index, log=log)
                    arm_runs.append(await runner)
                _add(metrics, arm, arm_runs)
                runs.extend(arm_runs)
    finally:
        left = reap(prefix)
        if left:
            log(f"o5 reliability: reaped {len(left)} leftover status-quo process(es)")
    result.seeds = ctx.repeats
    result.series = {"runs": [run.as_series() for run in runs]}
    result.notes.extend(_notes(ctx, runs, time.monotonic() - started))
    return result


def _describe(event: FailureEvent) -> str:
    if event.kind == "announced":
        return f"announced ({event.channel}, {event.lead_s:g} s notice) at step {event.at_step}"
    return f"unplanned at step {event.at_step}"


def _add(metrics: dict[str, Any], arm: str, runs: list[RoundRun]) -> None:
    """One value per metric for the arm's repeat: means over its events, ETTR over all its rounds' time."""
    events = [event for run in runs for event in run.events]
    lost = [event.steps_lost for event in events if event.steps_lost is not None]
    noticed = [event.steps_lost for event in events if event.kind == "announced" and event.steps_lost is not None]
    recovery = [event.recovery_s for event in events if event.recovery_s is not None]
    useful = [run.useful_s for run in runs]
    wall = [run.wall_s for run in runs]
    metrics["steps_lost_per_event"].add(arm, fmean(lost) if lost else math.nan)
    metrics["steps_lost_with_notice"].add(arm, fmean(noticed) if noticed else math.nan)
    metrics["recovery_s_per_event"].add(arm, fmean(recovery) if recovery else math.nan)
    losses = [run.loss_at_target for run in runs if run.loss_at_target is not None]
    metrics["loss_at_target"].add(arm, fmean(losses) if len(losses) == len(runs) else math.nan)
    if all(u is not None for u in useful) and all(w is not None for w in wall) and sum(w or 0 for w in wall) > 0:
        metrics["ettr"].add(arm, sum(u or 0 for u in useful) / sum(w or 0 for w in wall))
        metrics["time_to_target_s"].add(arm, fmean(w or 0 for w in wall))
    else:
        metrics["ettr"].add(arm, math.nan)
        metrics["time_to_target_s"].add(arm, math.nan)


def _how(ctx: EvalContext) -> str:
    where = ("the cooperative arm's hosts are network namespaces (gloo across the shaped uplinks), the status quo's "
             "torchrun nodes run on loopback" if ctx.testbed else
             "both arms on loopback (on the testbed the cooperative arm's hosts are network namespaces)")
    return (f"Real runtime, {ctx.info.network}; {where}. One DDP job of {WORKERS} workers (the example MLP, "
            f"`{' '.join(ENTRYPOINT)}`: ~{STEP_DELAY_MS} ms of compute stand-in per step), one per host. Failures "
            "are kill -9 of a whole host (its agent and its node; in the status quo, a torchrun node's agent and "
            "worker). Notices use the clouds' documented lead times scaled by "
            f"{LEAD_SCALE:g}. Each failure fires when the job first logs a seeded step (the same in both arms), so "
            "both face it at the same point of training; every figure comes from rank 0's per-step log lines.")


def _notes(ctx: EvalContext, runs: list[RoundRun], duration_s: float) -> list[str]:
    channels = "; ".join(f"{c.label}: {c.real_lead_s:g} s -> {c.lead_s():g} s" for c in CHANNELS)
    notes = [
        f"Notice lead times, scaled by {LEAD_SCALE:g}: {channels}. Seed s (round k) uses "
        + ", ".join(c.key for c in DRAWN_CHANNELS) + " in turn ((s x rounds + k) mod 4); Azure's 15 min notices "
        "are listed, not used (the time budget; any notice longer than the few seconds a move takes gives the "
        "cooperative arm the same outcome, and the status quo ignores notices).",
        "Event sequence: random.Random(seed) for each repeat (seeds seed, seed + 1, ...): per round (one job) "
        + ("one unplanned and one announced failure" if ctx.quick else "two unplanned failures and one announced")
        + " in a seeded order, at seeded steps (first in "
        f"{FIRST_EVENT_STEPS[0]}..{FIRST_EVENT_STEPS[1]}, so its phase against the checkpoint interval varies), on "
        "a seeded victim (among the job's hosts; in the status quo among its nodes but the store host). "
        + ("--quick: one round. " if ctx.quick else "")
        + "One notice per job: the provider keeps a job off a host it moved away from for an hour, and on 4 "
        "hosts a 3-worker job has a single spare, so a second notice for the same job could only shrink it.",
        "steps_lost_per_event: for each event, in its window (from its notice, or its failure, to the next event's), "
        "every time rank 0's logged step goes back, the steps between the step resumed from and the last one logged "
        "before (a restart from the checkpoint of step c after step a loses a - c; an in-place re-formation none). "
        "Value per repeat: the mean over the repeat's events; steps_lost_with_notice: the same over announced ones.",
        "recovery_s_per_event: from the kill to the first step logged more than 50 ms after it (a line logged "
        "sooner is the step that was finishing when the host died); for an announced failure the job had already "
        "left, that is its next step. Mean over the repeat's events.",
        "ettr (effective training time ratio) = useful time / wall time, over each round from the job's first logged "
        "step to the first logged step at or past the round's target step after its last failure; useful time = "
        "steps kept (target line's step - first line's step: a step done twice counts once) x the arm's own median "
        "healthy step time (the median time between two consecutive logged steps n, n + 1 in that round). "
        "Everything else (detection, restart, rendezvous, reload, steps redone, slower steps around a change, "
        "checkpoint saves) is lost time. Job start-up before the first step is left out in both arms.",
        f"time_to_target_s: wall time from the job's first logged step to its target step (the last event's step + "
        f"{TAIL_STEPS} plus the notice's lead in steps), the same target in both arms. It is the time to a target "
        "loss, the loss the job has at that step: the arms' batches are seeded per step and rank, so the same step "
        "means the same training progress in both (a step redone after a restart replays the same batches), while "
        "a threshold on the loss itself, which falls slowly and noisily on this job past step 150, would be "
        f"crossed by chance. loss_at_target shows it: the mean of the last {LOSS_WINDOW} losses logged up to the "
        "target step, per arm (the same within noise when the two arms reached the same point of training).",
        "Cooperative arm: after each failure the killed host's agent is restarted once the job has recovered and the "
        "host was reported down; if the job is below its size then, the harness, as the tenant, asks for "
        f"{WORKERS} workers again (the counterpart of the status quo's replacement node), accepting once the "
        "joiner stands by. At the end of each round the job is released and every host is back up and free.",
        "When an in-place job moves off a host, the leaving rank 0 logs its last step once more after the new rank "
        "0 logged it (the script's final line); that repeat, announced by its 'leaving the job at step N' line, is "
        "not a step done again and is not counted.",
        "The status quo's processes each carry a marker unique to this run; all of them are killed at the end of "
        f"each round and of the scenario. Duration of the scenario: {duration_s:.0f} s.",
    ]
    for run in runs:
        parts = []
        for event in run.events:
            what = event.kind if event.channel is None else f"{event.kind} ({event.channel}, {event.lead_s:g} s)"
            rec = "-" if event.recovery_s is None else f"{event.recovery_s:.1f} s"
            parts.append(f"{what} on {event.victim} at step {event.fired_at_step}: {event.steps_lost} step(s) lost, "
                         f"recovery {rec}" + (f" [{event.note}]" if event.note else ""))
        ettr_text = "-" if run.ettr is None else f"{run.ettr:.3f}"
        wall = "-" if run.wall_s is None else f"{run.wall_s:.1f} s"
        step = "-" if run.healthy_step_s is None else f"{run.healthy_step_s * 1000:.0f} ms"
        notes.append(f"{run.arm}, seed {run.seed}, round {run.index + 1}: " + "; ".join(parts)
                     + f"; healthy step {step}, ettr {ettr_text}, to step {run.target_step} in {wall}."
                     + "".join(f" Note: {note}." for note in run.notes))
    return notes


# -- the plot ---------------------------------------------------------------------------------------------------------


def plot_reliability(result: ScenarioResult, out_dir: Path) -> list[str]:
    """Per round of the first repeat: the training step over time, both arms on one axis, each event marked (notice:
    dotted, failure: solid, in the arm's colour, with the steps it lost), and the world size below. A stretch with no
    step (a restart) is left blank; a dotted grey line joins it to the step the job resumed from."""
    runs = [run for run in result.series.get("runs", []) if run.get("repeat") == 0]
    if not runs:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rounds = sorted({int(run["round"]) for run in runs})
    fig, axes = plt.subplots(2 * len(rounds), 1, figsize=(9, 4.6 * len(rounds)), squeeze=False,
                             gridspec_kw={"height_ratios": [3, 1] * len(rounds)})
    colours = {STATUS_QUO: "tab:red", COOPERATIVE: "tab:blue"}
    for row, index in enumerate(rounds):
        ax, world_ax = axes[2 * row][0], axes[2 * row + 1][0]
        for run in (r for r in runs if r["round"] == index):
            arm = str(run["arm"])
            colour = colours.get(arm, "tab:gray")
            points = run["steps"]
            for number, segment in enumerate(_segments(points)):
                ax.plot([p[0] for p in segment], [p[1] for p in segment], color=colour, linewidth=1.3,
                        label=arm.replace("_", " ") if number == 0 else None)
            for before, after in zip(points, points[1:], strict=False):
                if after[1] <= before[1] or after[0] - before[0] > GAP_S:
                    ax.plot([before[0], after[0]], [before[1], after[1]], color="gray", linestyle=":", linewidth=0.8)
            world_ax.step([p[0] for p in points], [p[2] for p in points], where="post", color=colour, linewidth=1.2)
            for event in run["events"]:
                if event.get("notice_t") is not None:
                    ax.axvline(event["notice_t"], color=colour, linestyle=":", linewidth=1)
                ax.axvline(event["fail_t"], color=colour, linestyle="-", linewidth=0.8, alpha=0.6)
                label = f"{event['channel']} notice" if event["kind"] == "announced" else "no notice"
                ax.annotate(f"{label}: {event['steps_lost']} step(s) lost", (event["fail_t"], event["fired_at_step"]),
                            fontsize=7, color=colour, xytext=(4, -14 if arm == STATUS_QUO else 8),
                            textcoords="offset points")
        ax.set_ylabel("training step (rank 0)")
        ax.set_title(f"seed {runs[0]['seed']}, round {index + 1}: failures (solid), notices (dotted)", fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
        world_ax.set_ylabel("world size")
        world_ax.set_ylim(0, WORKERS + 1)
        world_ax.set_xlim(ax.get_xlim())
        world_ax.set_xlabel("seconds since the job's first step")
        world_ax.grid(alpha=0.3)
    fig.suptitle(result.title, fontsize=10)
    fig.tight_layout()
    name = f"{result.key}.png"
    fig.savefig(out_dir / name, dpi=110)
    plt.close(fig)
    return [name]


GAP_S = 1.0
"""Two logged steps further apart than this are drawn as a gap (the job stood still)."""


def _segments(points: list[list[float]]) -> list[list[list[float]]]:
    """The runs of consecutive steps with no gap longer than `GAP_S` and no step going back."""
    segments: list[list[list[float]]] = []
    for point in points:
        if segments and point[1] > segments[-1][-1][1] and point[0] - segments[-1][-1][0] <= GAP_S:
            segments[-1].append(point)
        else:
            segments.append([point])
    return segments
