"""Vocabulary of a training job shared by the provider, the tenant SDK and the runtime: plans, compression, what
became of a directive and where the job stands."""

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


class JobPhase(enum.StrEnum):
    """Where a job stands, as the control plane tracks it (the transition table lives with the provider).

        pending    --new epoch-->        placed      (workers placed: its nodes start)
        placed     --progress-->         running     (the first report of the epoch)
        running    --new epoch-->        restarting  (an agreement, a host down or a hung node moved the epoch)
        restarting --progress-->         running     (the trainer resumed from its checkpoint in the new epoch)
        running    --finished-->         finished    (the training run ended on its own)
        running    --node given up-->    failed      (stands still until its epoch moves on)
        running    --last worker lost--> failed      (failures took every worker)
        failed     --new epoch-->        restarting  (a replacement or a smaller size)
        running    --released all-->     pending     (an agreement left it no worker)
    """

    PENDING = "pending"
    """No worker runs: not placed yet, waiting for reserved workers, or scaled to none by an agreement."""
    PLACED = "placed"
    """Workers are placed and their nodes start; no progress reported in this epoch yet."""
    RUNNING = "running"
    """The job reported progress in its current epoch."""
    RESTARTING = "restarting"
    """The epoch moved on since the job ran: its nodes restart at the new size and plan and resume."""
    FINISHED = "finished"
    """The training run ended on its own (its last step, or the script closed it without a stop request)."""
    FAILED = "failed"
    """A node of the current epoch was given up (out of restarts), or failures took the job's last worker; a new
    epoch (the tenant's replacement or a smaller size) moves it on."""
