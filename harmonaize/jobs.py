"""Vocabulary of a training job shared by the provider, the tenant SDK and the runtime: plans, compression and what
became of a directive."""

from __future__ import annotations

import enum


class ParallelPlan(enum.StrEnum):
    """How a job partitions its model across workers; the provider may propose switching between them."""

    DDP = "ddp"
    FSDP = "fsdp"
    HSDP = "hsdp"


class Compression(enum.StrEnum):
    """Gradient compression the provider may switch a job to, within what the tenant allowed."""

    NONE = "none"
    FP16 = "fp16"
    POWERSGD = "powersgd"


class DirectiveState(enum.StrEnum):
    """Where one version of the provider's directives stands; the control plane records all three, the job's runtime
    reports only the last two (it never sees a version before it is issued)."""

    ISSUED = "issued"
    """The provider issued this version; the job applies it at its next step boundary."""
    REFUSED = "refused"
    """Outside the tenant's ranges: refused by the control plane (never issued) or by the job's runtime."""
    APPLIED = "applied"
    """The job's runtime applied it, at `step`."""
