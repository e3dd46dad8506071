"""The split of a tenant's global batch over a world size (`harmonaize.global_batch`), and the contract's refusal of
directives that would move batch size or accumulation under a fixed global batch."""

from __future__ import annotations

import pytest

from harmonaize.global_batch import inexact_worlds, plan_global_batch
from harmonaize.job_runtime import Directives, JobRanges, violations
from harmonaize.ranges import IntRange

BATCH = IntRange(min=8, max=64)
ACCUMULATION = IntRange(min=1, max=8)


@pytest.mark.parametrize(("world", "batch", "accumulation"), [(4, 64, 1), (2, 64, 2), (1, 64, 4), (8, 32, 1)])
def test_an_exact_split_takes_the_fewest_micro_batches(world: int, batch: int, accumulation: int) -> None:
    plan = plan_global_batch(256, world=world, batch_size=BATCH, gradient_accumulation=ACCUMULATION)
    assert (plan.batch_size, plan.gradient_accumulation) == (batch, accumulation)
    assert plan.exact and plan.global_batch == 256
    assert "global batch 256 kept" in plan.describe()


def test_without_an_exact_split_the_nearest_global_batch_is_taken_and_said() -> None:
    plan = plan_global_batch(256, world=3, batch_size=BATCH, gradient_accumulation=ACCUMULATION)
    assert not plan.exact
    assert abs(plan.global_batch - 256) <= 3 * plan.gradient_accumulation  # within one sample per micro-batch
    assert plan.batch_size in BATCH and plan.gradient_accumulation in ACCUMULATION
    assert "asked 256" in plan.describe()


def test_the_ranges_bound_the_split_even_when_far_from_the_target() -> None:
    plan = plan_global_batch(10_000, world=2, batch_size=IntRange(min=8, max=16),
                             gradient_accumulation=IntRange(min=1, max=2))
    assert (plan.batch_size, plan.gradient_accumulation) == (16, 2)
    pinned = plan_global_batch(96, world=4, batch_size=IntRange(min=8, max=8),
                               gradient_accumulation=IntRange(min=1, max=1_000_000_000))
    assert (pinned.batch_size, pinned.gradient_accumulation) == (8, 3)


def test_inexact_worlds_lists_the_sizes_without_a_split() -> None:
    assert inexact_worlds(256, worlds=range(1, 9), batch_size=BATCH, gradient_accumulation=ACCUMULATION) == [3, 5, 6, 7]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_global_batch(0, world=2, batch_size=BATCH, gradient_accumulation=ACCUMULATION)
    with pytest.raises(ValueError, match="batch_size range"):
        JobRanges(global_batch=256)


def test_directives_may_not_move_batch_or_accumulation_under_a_fixed_global_batch() -> None:
    ranges = JobRanges(batch_size=BATCH, gradient_accumulation=ACCUMULATION, global_batch=256)
    assert violations(ranges, Directives(version=1, compression=None)) == []
    for directives in (Directives(version=1, batch_size=32), Directives(version=1, gradient_accumulation=2)):
        [problem] = violations(ranges, directives)
        assert "global batch the tenant fixed (256" in problem
    free = JobRanges(batch_size=BATCH, gradient_accumulation=ACCUMULATION)
    assert violations(free, Directives(version=1, batch_size=32, gradient_accumulation=2)) == []
