"""Vocabulary of a training job shared by the provider, the tenant SDK and the runtime: plans and compression."""

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
