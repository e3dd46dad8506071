"""The provider's micro-level decisions about a running job, and what the job did with them.

The micro loop acts fast and on its own, inside the ranges the tenant declared, so the tenant must be able to see
every decision: one event when a directive version is issued (or refused by the control plane because it left the
ranges), and one when the job's own runtime applied or refused it at a step boundary.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from harmonaize.events.base import EventData
from harmonaize.events.fields import UtcDatetime
from harmonaize.events.kinds import EventKind
from harmonaize.jobs import Compression, DirectiveState

__all__ = ["DirectiveState", "DirectiveUpdate"]


class DirectiveUpdate(EventData):
    """A directive version changed state; the settings are the job's full micro-level settings at that version."""

    KIND: ClassVar[EventKind] = EventKind.DIRECTIVE
    VERSION: ClassVar[int] = 1

    version: int | None = Field(
        default=None, ge=0, description="None for a proposal the control plane refused: it never became a version."
    )
    state: DirectiveState
    checkpoint_requests: int = Field(ge=0)
    checkpoint_interval_steps: int | None = Field(default=None, ge=1)
    compression: Compression | None = None
    powersgd_rank: int | None = Field(default=None, ge=1)
    batch_size: int | None = Field(default=None, ge=1)
    gradient_accumulation: int | None = Field(default=None, ge=1)
    reason: str = Field(default="", max_length=500)
    refusals: tuple[str, ...] = Field(default=(), max_length=16)
    step: int | None = Field(default=None, ge=0)
    at: UtcDatetime
