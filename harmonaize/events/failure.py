"""Failure: a host or GPU of the job is down, erroring, degraded, or predicted to fail; or the job's node on a host hung
or kept failing while the host itself is fine (`node_hung`, `node_failed`, with `frozen`, `stalled` or
`out_of_restarts` or, for an in-place node that exited with an error, `crashed` as the reason).

Why this event exists: without it an elastic job learns of a failure by a rendezvous or collective timeout, tens
of seconds to hours later. With it, the job checkpoints before a predicted failure and rescales as soon as a host
is lost.

`eta` and `confidence` belong to predictions only. They are required for `predicted_failure` and refused for
every other kind: a consumer can then branch on `kind` alone and never meet a "host_down with a 30 % confidence".
`reason`, when given, is a short machine code (`xid_79`, `ecc_uncorrectable`) and never free text, so that a
provider cannot leak an internal name through it by accident.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, ClassVar, Self

from pydantic import StringConstraints, model_validator

from harmonaize.events.base import EventData
from harmonaize.events.fields import GpuIndex, HostPseudonym, Probability, UtcDatetime
from harmonaize.events.kinds import EventKind

__all__ = ["Failure", "FailureKind", "Severity"]


def _listing(names: list[str]) -> str:
    return f"{' and '.join(names)} {'is' if len(names) == 1 else 'are'}"


class FailureKind(StrEnum):
    """What happened (or is expected to)."""

    HOST_DOWN = "host_down"
    GPU_ERROR = "gpu_error"
    DEGRADED = "degraded"
    PREDICTED_FAILURE = "predicted_failure"
    NODE_HUNG = "node_hung"
    """The job's node on this host hung; the provider killed it and the job goes on without it."""
    NODE_FAILED = "node_failed"
    """The job's node on this host kept exiting with an error; the provider stopped restarting it."""


class Severity(StrEnum):
    """How urgently the job should react; ordered from least to most urgent."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class Failure(EventData):
    """A failure (or a predicted one) on one of the job's hosts."""

    KIND: ClassVar[EventKind] = EventKind.FAILURE
    VERSION: ClassVar[int] = 1

    kind: FailureKind
    host: HostPseudonym
    gpu_index: GpuIndex | None = None
    detected_at: UtcDatetime
    severity: Severity
    eta: UtcDatetime | None = None
    confidence: Probability | None = None
    reason: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_]{0,47}$")] | None = None

    @model_validator(mode="after")
    def _prediction_fields(self) -> Self:
        if self.kind is FailureKind.PREDICTED_FAILURE:
            missing = [name for name in ("eta", "confidence") if getattr(self, name) is None]
            if missing:
                raise ValueError(f"{_listing(missing)} required when kind is 'predicted_failure'")
            if self.eta is not None and self.eta < self.detected_at:
                raise ValueError("eta must not be before detected_at")
        else:
            present = [name for name in ("eta", "confidence") if getattr(self, name) is not None]
            if present:
                raise ValueError(
                    f"{_listing(present)} only allowed when kind is 'predicted_failure' (kind is {self.kind.value!r})"
                )
        return self
