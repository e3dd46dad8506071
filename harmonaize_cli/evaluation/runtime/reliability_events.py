"""The O5 reliability scenario's inputs and bookkeeping: the clouds' notice channels and their lead times, the
seeded sequence of failures (the same in both arms), and what a round of one job measured (steps lost per event,
recovery, effective training time ratio), all read from rank 0's step lines."""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from statistics import fmean
from typing import Any, Literal

from harmonaize_cli.evaluation.runtime.job_log import (
    StepLine,
    ettr,
    first_reaching,
    median_step_s,
    steps_lost,
)

LEAD_SCALE = 0.1
"""Every cloud's notice lead time is run 10x shorter (AWS's 2 min become 12 s)."""
STEP_S_ESTIMATE = 0.13
"""What a healthy step takes on the machine this was sized on (100 ms of delay + compute): sizes the gaps between
events in steps, nothing else."""
FIRST_EVENT_STEPS = (40, 140)
"""The first event fires at a step drawn from this range (its phase against the checkpoint interval is random)."""
HANDLING_STEPS = 130
"""Steps the cooperative job runs while an event is handled (host down, agent restarted, back to 3 workers): the next
event is at least this far on, plus the previous notice's lead."""
EXTRA_GAP_STEPS = (0, 80)
TAIL_STEPS = 40
"""The round ends this many steps after its last event's step: the target of `time_to_target_s`."""

LOSS_WINDOW = 20
"""Logged losses (one per step) averaged into the loss at the target step."""

Kind = Literal["unplanned", "announced"]


@dataclass(frozen=True)
class NoticeChannel:
    """A cloud's advance notice of a disruption and its documented lead time."""

    key: str
    label: str
    real_lead_s: float

    def lead_s(self, scale: float = LEAD_SCALE) -> float:
        return self.real_lead_s * scale


CHANNELS: tuple[NoticeChannel, ...] = (
    NoticeChannel("azure_preempt", "Azure Scheduled Events: Preempt (Spot eviction)", 30.0),
    NoticeChannel("gcp_preemption", "GCP preemption notice (Spot / preemptible VM)", 30.0),
    NoticeChannel("gcp_maintenance", "GCP host maintenance event (metadata server notice)", 60.0),
    NoticeChannel("aws_spot", "AWS EC2 Spot instance interruption notice", 120.0),
    NoticeChannel("azure_freeze_reboot", "Azure Scheduled Events: Freeze / Reboot / Redeploy", 900.0),
)
DRAWN_CHANNELS: tuple[NoticeChannel, ...] = (CHANNELS[3], CHANNELS[2], CHANNELS[0], CHANNELS[1])
"""The channels the announced failures use, in turn: seed s, round k takes `(s x rounds + k) mod 4` (AWS 12 s,
GCP maintenance 6 s, Azure Preempt 3 s, GCP preemption 3 s), so consecutive seeds cover the range. Azure's 15 min
notices (90 s at this scale) are listed but not used: the run's time budget, and a notice longer than the few
seconds a move takes gives the cooperative arm the same outcome (the status quo ignores notices)."""


FULL_ROUNDS = 1
"""Rounds (jobs) per repeat in a full run; each ~3.5 min for both arms on a 2-core machine, so 3 repeats stay near
the full run's ~15 min budget."""
QUICK_KINDS: tuple[Kind, ...] = ("unplanned", "announced")
FULL_KINDS: tuple[Kind, ...] = ("unplanned", "unplanned", "announced")
"""A round's failures, in a seeded order. One announced failure per job: the provider keeps a job off a host it moved
away from for an hour (`api.services.worker_replacement.QUARANTINE`), and on 4 hosts a 3-worker job has one spare,
so a second notice for the same job could only shrink it."""


@dataclass(frozen=True)
class FailureEvent:
    """One host failure: it fires when the job first logs `at_step` (the notice, for an announced one; the failure
    lead_s later), on the victim `victim` picks (a fraction: the index into the arm's candidate hosts)."""

    kind: Kind
    at_step: int
    victim: float
    channel: str | None = None
    real_lead_s: float = 0.0
    lead_s: float = 0.0


@dataclass(frozen=True)
class Round:
    """One job's life: its events in order, then training until `target_step`."""

    events: tuple[FailureEvent, ...]
    target_step: int


def event_rounds(seed: int, *, quick: bool, scale: float = LEAD_SCALE, rounds: int | None = None) -> tuple[Round, ...]:
    """The seed's event sequence: per round (one job) its failures (quick: one unplanned, one announced; full: two
    unplanned, one announced) in a seeded order, at seeded steps, on seeded victims; the announced one on the seed's
    notice channel (`DRAWN_CHANNELS`).

    Quick: one round; full: `rounds` (default 1 per repeat: see `FULL_ROUNDS`)."""
    if not 0 < scale <= 1:
        raise ValueError(f"the lead-time scale must be in (0, 1], got {scale}")
    rng = random.Random(seed)
    count = 1 if quick else (FULL_ROUNDS if rounds is None else rounds)
    out: list[Round] = []
    for index in range(count):
        kinds = list(QUICK_KINDS if quick else FULL_KINDS)
        rng.shuffle(kinds)
        channel = DRAWN_CHANNELS[(seed * count + index) % len(DRAWN_CHANNELS)]
        step = rng.randint(*FIRST_EVENT_STEPS)
        events: list[FailureEvent] = []
        for kind in kinds:
            if events:
                previous = events[-1]
                step += HANDLING_STEPS + math.ceil(previous.lead_s / STEP_S_ESTIMATE) + rng.randint(*EXTRA_GAP_STEPS)
            victim = rng.random()
            if kind == "announced":
                events.append(FailureEvent(kind, step, victim, channel.key, channel.real_lead_s,
                                           round(channel.lead_s(scale), 3)))
            else:
                events.append(FailureEvent(kind, step, victim))
        last = events[-1]
        target = last.at_step + math.ceil(last.lead_s / STEP_S_ESTIMATE) + TAIL_STEPS
        out.append(Round(events=tuple(events), target_step=target))
    return tuple(out)


# -- what a round measured ------------------------------------------------------------------------------------------


@dataclass
class EventOutcome:
    kind: Kind
    channel: str | None
    lead_s: float
    at_step: int
    victim: str
    notice_ts: float | None
    fail_ts: float
    fired_at_step: int
    recovered_ts: float | None = None
    left_before: bool | None = None
    """Cooperative, announced: whether the job's node on the host had exited when the host died."""
    steps_lost: int | None = None
    note: str = ""

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_ts is None else self.recovered_ts - self.fail_ts

    @property
    def start_ts(self) -> float:
        return self.notice_ts if self.notice_ts is not None else self.fail_ts


@dataclass
class RoundRun:
    arm: str
    repeat: int
    seed: int
    index: int
    target_step: int
    steps: list[StepLine] = field(default_factory=list)
    events: list[EventOutcome] = field(default_factory=list)
    start: StepLine | None = None
    end: StepLine | None = None
    healthy_step_s: float | None = None
    notes: list[str] = field(default_factory=list)

    def account(self) -> None:
        """Steps lost per event (each event's window: from its notice or failure to the next event's), the healthy
        step time, and the round's start and end (the first logged step; the target reached after the last event)."""
        self.start = self.steps[0] if self.steps else None
        after = self.events[-1].fail_ts if self.events else -math.inf
        self.end = first_reaching(self.steps, self.target_step, after=after)
        ends = [event.start_ts for event in self.events[1:]] + [self.end.ts if self.end else math.inf]
        for event, end in zip(self.events, ends, strict=True):
            event.steps_lost = steps_lost(self.steps, event.start_ts, end)
        self.healthy_step_s = median_step_s(self.steps)

    @property
    def wall_s(self) -> float | None:
        return None if self.start is None or self.end is None else self.end.ts - self.start.ts

    @property
    def useful_s(self) -> float | None:
        if self.start is None or self.end is None or self.healthy_step_s is None:
            return None
        return (self.end.step - self.start.step) * self.healthy_step_s

    @property
    def loss_at_target(self) -> float | None:
        """The mean of the last `LOSS_WINDOW` losses logged up to the target step: the loss `wall_s` is the time to
        (one step's loss is noisy; the steps before the target are the same steps in both arms)."""
        if self.end is None:
            return None
        before = [line.loss for line in self.steps if line.ts <= self.end.ts and math.isfinite(line.loss)]
        return fmean(before[-LOSS_WINDOW:]) if before else None

    @property
    def ettr(self) -> float | None:
        if self.start is None or self.end is None or self.healthy_step_s is None:
            return None
        return ettr(start=self.start, end=self.end, healthy_step_s=self.healthy_step_s)

    def as_series(self) -> dict[str, Any]:
        t0 = self.start.ts if self.start else (self.steps[0].ts if self.steps else 0.0)
        return {
            "arm": self.arm, "repeat": self.repeat, "seed": self.seed, "round": self.index,
            "target_step": self.target_step, "healthy_step_s": self.healthy_step_s, "ettr": self.ettr,
            "time_to_target_s": self.wall_s, "loss_at_target": self.loss_at_target,
            "steps": [[round(line.ts - t0, 3), line.step, line.world] for line in self.steps
                      if self.end is None or line.ts <= self.end.ts],  # not the job's release after its target
            "events": [
                {**{k: v for k, v in asdict(event).items() if not k.endswith("_ts")},
                 "notice_t": None if event.notice_ts is None else round(event.notice_ts - t0, 3),
                 "fail_t": round(event.fail_ts - t0, 3),
                 "recovered_t": None if event.recovered_ts is None else round(event.recovered_ts - t0, 3),
                 "recovery_s": event.recovery_s}
                for event in self.events
            ],
            "notes": self.notes,
        }
