"""Capacity: what the job could grow into right now, without revealing the provider's fleet.

Free GPUs are reported per locality group as a bucket, not a count: a count per group, sampled over time, would
let a tenant watch other tenants come and go. The bucket thresholds live in one function
(`bucket_for_free_gpus`) so the provider's projection and any test agree on them. The one exact number is
`max_workers`, the size the provider would grant this job now, which is the job's own business.

The bucket edges sit on powers of two (0 | 1-3 | 4-15 | 16+) so that they coincide with edges of the API's
power-of-two capacity buckets (`GET` capacity reports 0, 1, 2-3, 4-7, ...): a tenant comparing the two views never
sees them contradict each other, and either can be derived from the other's lower bound.
"""

from __future__ import annotations

from enum import StrEnum
from typing import ClassVar, Self

from pydantic import Field, model_validator

from harmonaize.events.base import ContractModel, EventData
from harmonaize.events.fields import GroupPseudonym, UtcDatetime, WorkerCount
from harmonaize.events.kinds import EventKind

__all__ = ["Availability", "Capacity", "GroupCapacity", "bucket_for_free_gpus"]

MAX_GROUPS = 64


class Availability(StrEnum):
    """Free GPUs in a group, coarsely; ordered from nothing to plenty."""

    NONE = "none"  # 0
    FEW = "few"  # 1-3
    SOME = "some"  # 4-15
    MANY = "many"  # 16 or more


def bucket_for_free_gpus(free_gpus: int) -> Availability:
    """The bucket a provider reports for an exact number of free GPUs."""
    if free_gpus < 0:
        raise ValueError(f"free_gpus must be >= 0, got {free_gpus}")
    if free_gpus == 0:
        return Availability.NONE
    if free_gpus < 4:
        return Availability.FEW
    if free_gpus < 16:
        return Availability.SOME
    return Availability.MANY


class GroupCapacity(ContractModel):
    """Availability in one locality group."""

    group: GroupPseudonym
    free_gpus: Availability


class Capacity(EventData):
    """Coarse availability around the job, and how far it could scale now."""

    KIND: ClassVar[EventKind] = EventKind.CAPACITY
    VERSION: ClassVar[int] = 1

    groups: tuple[GroupCapacity, ...] = Field(default=(), max_length=MAX_GROUPS)
    max_workers: WorkerCount
    as_of: UtcDatetime

    @model_validator(mode="after")
    def _unique_groups(self) -> Self:
        names = [entry.group for entry in self.groups]
        if len(set(names)) != len(names):
            raise ValueError("groups: each group may appear once")
        return self
