"""Failure and maintenance events from a public production report, as per-GPU-hour rates, and a seeded Poisson
stream of them for the simulations.

Source: Meta, "The Llama 3 Herd of Models" (2024), §3.3.4: in a 54-day snapshot of Llama 3 405B pre-training on
16,384 H100 GPUs, 466 job interruptions, 47 planned (maintenance, known ahead: with notice) and 419 unexpected.
Interruptions are taken as independent per GPU (Poisson), so a cluster of G GPUs sees G/16,384 of the job's rate.

How many unexpected failures could be predicted early enough to act on is not in the report: `predictable` is an
assumption (a parameter; 0 in the headline runs).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

__all__ = ["LLAMA3", "FailureEvent", "FailureSource", "event_stream"]


@dataclass(frozen=True)
class FailureSource:
    """Interruptions observed on a fleet: `unexpected` and `planned` events on `gpus` GPUs over `days`."""

    reference: str
    gpus: int
    days: float
    unexpected: int
    planned: int

    @property
    def gpu_hours(self) -> float:
        return self.gpus * self.days * 24.0

    @property
    def unexpected_per_gpu_h(self) -> float:
        return self.unexpected / self.gpu_hours

    @property
    def planned_per_gpu_h(self) -> float:
        return self.planned / self.gpu_hours

    def mtbf_h(self, gpus: int, multiplier: float = 1.0) -> float:
        """Mean hours between interruptions of any kind on `gpus` GPUs at `multiplier` times the rate."""
        return 1.0 / ((self.unexpected_per_gpu_h + self.planned_per_gpu_h) * gpus * multiplier)


LLAMA3 = FailureSource(
    reference="Meta, 'The Llama 3 Herd of Models' (2024), s3.3.4: 466 job interruptions in 54 days on 16,384 H100 "
              "GPUs, 47 planned and 419 unexpected",
    gpus=16_384, days=54.0, unexpected=419, planned=47,
)


@dataclass(frozen=True)
class FailureEvent:
    """One interruption. `notice`: known ahead (planned maintenance, or a predicted failure); `gpu`: which of the
    cluster's GPUs it hits, as a fraction in [0, 1) (the simulation maps it onto its current allocation)."""

    t_s: float
    planned: bool
    notice: bool
    gpu: float


def event_stream(source: FailureSource, *, gpus: int, horizon_s: float, rng: random.Random,
                 multiplier: float = 1.0, predictable: float = 0.0) -> list[FailureEvent]:
    """Poisson events on `gpus` GPUs over [0, horizon_s): planned ones carry notice; each unexpected one is
    predicted (carries notice) with probability `predictable`. All draws come from `rng`, in a fixed order."""
    if not 0.0 <= predictable <= 1.0:
        raise ValueError(f"predictable is a fraction, not {predictable}")
    per_s = (source.unexpected_per_gpu_h + source.planned_per_gpu_h) * gpus * multiplier / 3600.0
    events: list[FailureEvent] = []
    if per_s <= 0:
        return events
    planned_share = source.planned / (source.planned + source.unexpected)
    t = 0.0
    while True:
        t += rng.expovariate(per_s)
        if t >= horizon_s:
            break
        planned = rng.random() < planned_share
        predicted = rng.random() < predictable
        events.append(FailureEvent(t_s=t, planned=planned, notice=planned or predicted, gpu=rng.random()))
    return events
