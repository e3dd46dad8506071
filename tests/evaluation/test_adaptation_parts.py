"""The O1 scenario's pure parts: the target test over logged losses, the job specs the API must accept (the global
batch has an exact split at both sizes), and the fleet's schedule, the same in both arms."""

from __future__ import annotations

from api.schemas import JobCreate
from harmonaize.global_batch import plan_global_batch
from harmonaize.ranges import IntRange
from harmonaize_cli.evaluation.results import COOPERATIVE, STATUS_QUO
from harmonaize_cli.evaluation.runtime.adaptation import (
    ACCUMULATION_RANGE,
    BATCH_RANGE,
    FULL,
    GLOBAL_BATCH,
    GUARANTEED,
    MAX_WORKERS,
    QUICK,
    SMOOTH,
    job_spec,
    reached,
)
from harmonaize_cli.evaluation.runtime.job_log import StepLine


def line(step: int, loss: float) -> StepLine:
    return StepLine(ts=float(step), step=step, world=2, loss=loss, source="node-e0.log")


def test_the_target_needs_the_mean_of_the_last_logged_losses_under_it() -> None:
    one_lucky = [line(10 * i, 0.1) for i in range(6)] + [line(60, 0.01)]
    assert reached(one_lucky, 0.05) is None, "one low loss among high ones is noise, not the target"
    steady = one_lucky + [line(70 + 10 * i, 0.04) for i in range(SMOOTH)]
    hit = reached(steady, 0.05)
    assert hit is not None and hit.step == 90, "(0.1 + 0.01 + 3 x 0.04) / 5 = 0.046, the first mean under 0.05"
    assert reached([line(0, 0.01)] * (SMOOTH - 1), 0.05) is None, "fewer logs than the window: not yet"
    assert SMOOTH == 5


def test_both_arms_ask_for_the_same_global_batch_and_the_api_accepts_their_specs() -> None:
    for arm in (STATUS_QUO, COOPERATIVE):
        spec = JobCreate.model_validate(job_spec(f"adapt-{arm.replace('_', '-')}", arm, target_steps=100))
        assert spec.global_batch == GLOBAL_BATCH
        assert spec.min_workers == GUARANTEED
        assert spec.max_workers == (GUARANTEED if arm == STATUS_QUO else MAX_WORKERS)
    batch, accumulation = IntRange(min=BATCH_RANGE[0], max=BATCH_RANGE[1]), IntRange(
        min=ACCUMULATION_RANGE[0], max=ACCUMULATION_RANGE[1])
    splits = {world: plan_global_batch(GLOBAL_BATCH, world=world, batch_size=batch, gradient_accumulation=accumulation)
              for world in (GUARANTEED, MAX_WORKERS)}
    assert all(plan.exact for plan in splits.values())
    assert (splits[GUARANTEED].gradient_accumulation, splits[MAX_WORKERS].gradient_accumulation) == (2, 1)


def test_each_reclaim_is_a_notice_then_an_outage_then_a_return() -> None:
    for shape in (QUICK, FULL):
        assert shape.reclaims_s == tuple(sorted(shape.reclaims_s))
        assert QUICK.target_loss > FULL.target_loss, "the quick run stops earlier on the same curve"
        assert shape.hard_cap_s > shape.reclaims_s[-1] + shape.outage_s
