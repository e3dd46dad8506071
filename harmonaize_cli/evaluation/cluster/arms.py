"""The three arms: a policy (policies.py) plus what each action costs a job on that arm's runtime (costs.py). One
simulator runs them all; nothing else differs.

Pauses are counted as full stops of the whole job (no step on any GPU), from the bench's trigger -> first step at
the new size. For torchrun that is what happens (every worker restarts); for ours the running ranks' measured step
gap is shorter (`rescale_ours_gap_s`), so this errs against the cooperative arm.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmonaize_cli.evaluation.cluster.costs import ActionCosts
from harmonaize_cli.evaluation.cluster.policies import FifoStatic, Negotiated, Policy, TenantGreedy
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO

__all__ = ["ARM_NAMES", "KEEP_REQUEST", "TENANT_ONLY", "ArmSpec", "keep_request_arm", "make_arms"]

TENANT_ONLY = "tenant_only"
KEEP_REQUEST = "cooperative_keep_request"
"""Sensitivity arm: the cooperative arm without shrinking any job below its requested size."""
ARM_NAMES = (STATUS_QUO, TENANT_ONLY, COOPERATIVE)


@dataclass(frozen=True)
class ArmSpec:
    """How one arm allocates, and what each event costs a job there (seconds)."""

    name: str
    description: str
    policy: Policy
    launch_s: float
    """Admitted -> first step."""
    admit_wait_s: float
    """Extra wait of a job admitted with GPUs taken back from others (the shrink's negotiation)."""
    grow_hold_s: float
    """Offer -> accept: the job keeps stepping at its old size, the new GPUs already placed (warming the joiner)."""
    grow_pause_s: float
    shrink_pause_s: float
    notice_aware: bool
    """Acts on notice (planned maintenance, predicted failure): moves off the host before, losing nothing."""
    notice_pause_s: float
    """That move for a multi-GPU job: shrink off the host, negotiate and grow onto the replacement."""
    notice_single_pause_s: float
    """That move for a 1-GPU job (no peer to hold its state): checkpoint now, relaunch on the replacement."""
    in_place_recovery: bool
    """After an unexpected failure a multi-GPU job continues from its survivors' state (no work lost)."""
    in_place_pause_s: float
    restart_pause_s: float
    """Failure -> first step again after a restart from the last periodic checkpoint (work since it is lost)."""
    checkpoint_write_s: float
    """Blocking time of one periodic save (the same in every arm)."""


def make_arms(costs: ActionCosts) -> dict[str, ArmSpec]:
    c = costs
    restart_baseline = c.recovery_timeout_s
    status_quo = ArmSpec(
        name=STATUS_QUO,
        description="static allocation at the requested size, FIFO without backfilling; failures found by torchrun "
                    f"and recovered by a restart from the last checkpoint ({restart_baseline:.1f} s, work since the "
                    "checkpoint lost); no notice of maintenance",
        policy=FifoStatic(), launch_s=c.launch_torchrun_s, admit_wait_s=0.0, grow_hold_s=0.0, grow_pause_s=0.0,
        shrink_pause_s=0.0, notice_aware=False, notice_pause_s=0.0, notice_single_pause_s=0.0,
        in_place_recovery=False, in_place_pause_s=0.0, restart_pause_s=restart_baseline,
        checkpoint_write_s=c.checkpoint_write_s,
    )
    tenant_grow = c.checkpoint_write_s + c.rescale_torchrun_s
    tenant_only = ArmSpec(
        name=TENANT_ONLY,
        description="FIFO admission as the status quo; each job's tenant grows it into idle GPUs (up to its cap) with "
                    f"a checkpoint + torchrun restart ({tenant_grow:.1f} s) and keeps them until it ends (it cannot "
                    "see the queue); failures and maintenance as the status quo",
        policy=TenantGreedy(grow_pause_s=tenant_grow), launch_s=c.launch_torchrun_s, admit_wait_s=0.0,
        grow_hold_s=0.0, grow_pause_s=tenant_grow, shrink_pause_s=0.0, notice_aware=False, notice_pause_s=0.0,
        notice_single_pause_s=0.0, in_place_recovery=False, in_place_pause_s=0.0, restart_pause_s=restart_baseline,
        checkpoint_write_s=c.checkpoint_write_s,
    )
    cooperative = _cooperative(c, name=COOPERATIVE, floor_one=True)
    return {arm.name: arm for arm in (status_quo, tenant_only, cooperative)}


def keep_request_arm(costs: ActionCosts) -> ArmSpec:
    """Sensitivity: the cooperative arm without shrinking any job below its requested size."""
    return _cooperative(costs, name=KEEP_REQUEST, floor_one=False)


def _cooperative(c: ActionCosts, *, name: str, floor_one: bool) -> ArmSpec:
    shrink = ("the provider admits the queue in order, shrinking grown jobs toward their request and, to admit a "
              "waiting job, one GPU from a job below its request (never below 1)" if floor_one else
              "as cooperative, but no job is shrunk below its requested size (a queued job waits for idle GPUs or "
              "others' surplus): sensitivity")
    return ArmSpec(
        name=name,
        description=f"negotiated elasticity: {shrink}; idle GPUs offered by marginal throughput; in-place rescales "
                    f"({c.rescale_ours_s:.2f} s after {c.negotiation_s:.1f} s of negotiation); failures come with the "
                    f"provider's event and recover in place ({c.recovery_event_s:.2f} s); notice -> moved before, "
                    "nothing lost",
        policy=Negotiated(grow_pause_s=c.rescale_ours_s, floor_one=floor_one), launch_s=c.launch_ours_s,
        admit_wait_s=c.negotiation_s, grow_hold_s=c.negotiation_s, grow_pause_s=c.rescale_ours_s,
        shrink_pause_s=c.shrink_ours_s, notice_aware=True,
        notice_pause_s=c.shrink_ours_s + c.negotiation_s + c.rescale_ours_s,
        notice_single_pause_s=c.checkpoint_write_s + c.launch_ours_s, in_place_recovery=True,
        in_place_pause_s=c.recovery_event_s + c.negotiation_s + c.rescale_ours_s,
        restart_pause_s=c.detection_event_s + c.launch_ours_s,
        checkpoint_write_s=c.checkpoint_write_s,
    )
