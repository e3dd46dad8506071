"""The global batch a tenant fixed, kept across every change of the job's world size.

Scaling a data-parallel job from 4 workers to 2 halves the samples per optimizer step unless something gives: the
learning-rate schedule, the loss curve per step and the time to a target loss all depend on that number, so a
tenant who lets the provider resize its job declares the global batch it wants kept and the ranges the per-rank
micro-batch and the accumulation may move in. Whoever knows the world size at that moment (the training runtime, at
every start and every in-place change) derives both with `plan_global_batch`; the control plane uses the same
function to refuse, at submission, a declaration that its own worker range cannot meet.

The choice: an exact split if one exists, with the fewest micro-batches (the largest per-rank batch: fewer passes,
the same samples); otherwise the split whose global batch is nearest (ties: the fewer micro-batches), marked inexact
so the runtime can say so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from harmonaize.ranges import IntRange

__all__ = ["BatchPlan", "inexact_worlds", "plan_global_batch"]

NEAREST_SCAN = 1024
"""Accumulation values tried one by one when no exact split exists (beyond the range's ends and the values the
batch bounds imply): enough for any real range, bounded for a declared one of a billion."""


@dataclass(frozen=True)
class BatchPlan:
    """A per-rank micro-batch and an accumulation for `world` workers."""

    batch_size: int
    gradient_accumulation: int
    world: int
    target: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step with this plan."""
        return self.batch_size * self.gradient_accumulation * self.world

    @property
    def exact(self) -> bool:
        return self.global_batch == self.target

    def describe(self) -> str:
        sizes = f"batch {self.batch_size} x accumulation {self.gradient_accumulation} x {self.world} workers"
        if self.exact:
            return f"global batch {self.target} kept: {sizes}"
        return f"global batch {self.global_batch} (asked {self.target}; no exact split): {sizes}"


def plan_global_batch(
    global_batch: int, *, world: int, batch_size: IntRange, gradient_accumulation: IntRange
) -> BatchPlan:
    """The split of `global_batch` over `world` workers within the two ranges (see the module docstring)."""
    if global_batch < 1 or world < 1:
        raise ValueError(f"global_batch and world must be at least 1, got {global_batch} and {world}")
    exact = _exact(global_batch, world, batch_size, gradient_accumulation)
    if exact is not None:
        return BatchPlan(batch_size=exact[0], gradient_accumulation=exact[1], world=world, target=global_batch)
    best: tuple[int, int, int] | None = None  # (distance, accumulation, batch)
    for accumulation in _candidates(global_batch, world, batch_size, gradient_accumulation):
        batch = min(batch_size.max, max(batch_size.min, round(global_batch / (world * accumulation))))
        key = (abs(batch * accumulation * world - global_batch), accumulation, batch)
        if best is None or key < best:
            best = key
    assert best is not None  # the range's own ends are always candidates
    return BatchPlan(batch_size=best[2], gradient_accumulation=best[1], world=world, target=global_batch)


def inexact_worlds(global_batch: int, *, worlds: range, batch_size: IntRange,
                   gradient_accumulation: IntRange) -> list[int]:
    """The world sizes in `worlds` with no exact split (the control plane checks the ends of a job's range)."""
    return [world for world in worlds if _exact(global_batch, world, batch_size, gradient_accumulation) is None]


def _exact(global_batch: int, world: int, batch_size: IntRange, accumulation: IntRange) -> tuple[int, int] | None:
    """(batch, accumulation) with batch x accumulation x world == global_batch, fewest micro-batches; None if none."""
    if global_batch % world:
        return None
    per_worker = global_batch // world
    found: list[tuple[int, int]] = []
    for small in range(1, math.isqrt(per_worker) + 1):
        if per_worker % small:
            continue
        for acc in {small, per_worker // small}:
            batch = per_worker // acc
            if acc in accumulation and batch in batch_size:
                found.append((acc, batch))
    if not found:
        return None
    acc, batch = min(found)
    return batch, acc


def _candidates(global_batch: int, world: int, batch_size: IntRange, accumulation: IntRange) -> list[int]:
    """Accumulation values worth trying for the nearest split: the range's ends, the values the batch bounds imply
    (their floor and ceiling), and the first `NEAREST_SCAN` values of the range."""
    def clamp(value: int) -> int:
        return min(accumulation.max, max(accumulation.min, value))

    values = {accumulation.min, accumulation.max}
    for batch in (batch_size.min, batch_size.max):
        ideal = global_batch / (world * batch)
        values.update({clamp(math.floor(ideal)), clamp(math.ceil(ideal))})
    values.update(range(accumulation.min, min(accumulation.max, accumulation.min + NEAREST_SCAN) + 1))
    return sorted(values)
