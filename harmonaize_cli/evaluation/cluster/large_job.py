"""O5 at scale: one synchronous training job on 16,384 GPUs for 54 days, interrupted at the Llama 3 405B rates (a
seeded Monte-Carlo). One GPU's interruption stops the whole job. Metric: the effective training time ratio (ETTR,
useful time / wall time), and the work and time lost per event, split by events with and without notice.

Per event, by arm (seconds from costs.py):

* status quo: no notice of anything. torchrun finds the failure and the job restarts from its last periodic
  checkpoint (`recovery_timeout_s`); everything since that checkpoint is redone. Planned maintenance is met the same
  way: the provider knows, the tenant does not.
* cooperative: with notice (planned; and the `predictable` share of unexpected failures), the job saves a checkpoint
  before and restarts from it on the replacement (`checkpoint_write_s + launch_ours_s`): nothing lost. Without
  notice, the provider's event ends detection (`detection_event_s`), then a restart from the last checkpoint
  (`launch_ours_s`), work since it redone: a job this size shards its model and optimizer state (FSDP/ZeRO), so a
  lost host's shard exists only in the checkpoint.
* cooperative with replicated state (sensitivity): the state is replicated across data-parallel groups (HSDP), so
  a survivor holds every shard: recovery in place (`recovery_event_s`, then the replacement joins), nothing lost;
  a notice is a move in place.

Every arm saves every `checkpoint_interval_s` and blocks `checkpoint_write_s` per save. Events that fall while the
job is down are absorbed (they hit a job that is not running). All arms of one seed meet the same events.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from statistics import fmean

from harmonaize_cli.evaluation.cluster.costs import ActionCosts
from harmonaize_cli.evaluation.cluster.failures import LLAMA3, FailureEvent, FailureSource, event_stream
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO

__all__ = [
    "LargeJobArm", "LargeJobOutcome", "LargeJobSetup", "large_job_arms", "mean_of", "replay", "simulate_large_job",
]


@dataclass(frozen=True)
class LargeJobSetup:
    gpus: int = 16_384
    days: float = 54.0
    checkpoint_interval_s: float = 1800.0
    """Assumed (the report gives none): the same for every arm."""
    source: FailureSource = LLAMA3


@dataclass(frozen=True)
class LargeJobArm:
    name: str
    description: str
    notice_aware: bool
    predictable: float
    """Share of unexpected failures that come with notice (an assumption)."""
    notice_pause_s: float
    failure_pause_s: float
    failure_loses_work: bool


def large_job_arms(costs: ActionCosts, *, predictable_sensitivity: float = 0.3) -> list[LargeJobArm]:
    c = costs
    in_place_notice = c.shrink_ours_s + c.negotiation_s + c.rescale_ours_s
    in_place_failure = c.recovery_event_s + c.negotiation_s + c.rescale_ours_s
    coop_notice = c.checkpoint_write_s + c.launch_ours_s
    coop_failure = c.detection_event_s + c.launch_ours_s
    share = f"{predictable_sensitivity:.0%}"
    return [
        LargeJobArm(STATUS_QUO, "torchrun: every event found by torchrun, restart from the last checkpoint "
                    f"({c.recovery_timeout_s:.0f} s + work since it); maintenance without notice", False, 0.0,
                    0.0, c.recovery_timeout_s, True),
        LargeJobArm(COOPERATIVE, "provider events: notice -> checkpoint before, restart from it "
                    f"({coop_notice:.0f} s, nothing lost); failure -> event, restart from the last checkpoint "
                    f"({coop_failure:.0f} s + work since it); no failure predicted", True, 0.0, coop_notice,
                    coop_failure, True),
        LargeJobArm(f"cooperative_predict_{share.rstrip('%')}pct", f"as cooperative, with {share} of unexpected "
                    "failures predicted (notice) - an assumption", True, predictable_sensitivity, coop_notice,
                    coop_failure, True),
        LargeJobArm("cooperative_replicated_state", "as cooperative, state replicated across data-parallel groups: "
                    f"failure recovered in place ({in_place_failure:.1f} s, nothing lost), notice -> moved in place "
                    f"({in_place_notice:.1f} s)", True, 0.0, in_place_notice, in_place_failure, False),
    ]


@dataclass
class LargeJobOutcome:
    ettr: float
    lost_h_notice: list[float] = field(default_factory=list)
    """Hours of the whole job's training redone, per event with notice (known to the provider ahead)."""
    lost_h_no_notice: list[float] = field(default_factory=list)
    pause_s: list[float] = field(default_factory=list)
    """Detection + recovery per event."""
    absorbed: int = 0


def replay(events: list[FailureEvent], arm: LargeJobArm, setup: LargeJobSetup, write_s: float,
           predicted: list[bool]) -> LargeJobOutcome:
    """One run: the events in time order, `predicted[i]` whether event i (if unexpected) came with notice."""
    wall = setup.days * 24 * 3600.0
    cycle = setup.checkpoint_interval_s + write_s
    anchor = 0.0
    """A time from which saves complete every `cycle` (the start, or the last restart)."""
    resume = 0.0
    down = lost_total = 0.0
    out = LargeJobOutcome(ettr=0.0)
    for event, was_predicted in zip(events, predicted, strict=True):
        if event.t_s < resume:
            out.absorbed += 1
            continue
        notice = event.planned or was_predicted
        since = (event.t_s - anchor) % cycle
        if notice and arm.notice_aware:
            pause, lost = arm.notice_pause_s, 0.0
            if arm.failure_loses_work:
                anchor = event.t_s + pause
        elif arm.failure_loses_work:
            pause, lost = arm.failure_pause_s, since
            anchor = event.t_s + pause
        else:
            pause, lost = arm.failure_pause_s, 0.0
        resume = event.t_s + pause
        down += pause
        lost_total += lost
        out.pause_s.append(pause)
        (out.lost_h_notice if notice else out.lost_h_no_notice).append(lost / 3600.0)
    running = wall - down
    useful = running * setup.checkpoint_interval_s / cycle - lost_total
    out.ettr = useful / wall
    return out


def simulate_large_job(arms: list[LargeJobArm], costs: ActionCosts, *, seed: int, runs: int,
                       setup: LargeJobSetup | None = None) -> dict[str, list[LargeJobOutcome]]:
    """`runs` Monte-Carlo runs per arm; run i of every arm meets the same events (and the same draws for which
    failures are predicted, so a higher `predictable` only adds notices)."""
    setup = setup or LargeJobSetup()
    rng = random.Random(seed)
    outcomes: dict[str, list[LargeJobOutcome]] = {arm.name: [] for arm in arms}
    for _ in range(runs):
        events = event_stream(setup.source, gpus=setup.gpus, horizon_s=setup.days * 24 * 3600.0, rng=rng)
        draws = [rng.random() for _ in events]
        for arm in arms:
            predicted = [not e.planned and d < arm.predictable for e, d in zip(events, draws, strict=True)]
            outcomes[arm.name].append(replay(events, arm, setup, costs.checkpoint_write_s, predicted))
    return outcomes


def mean_of(values: list[float]) -> float:
    return fmean(values) if values else float("nan")
