"""Keyword arguments of the negotiation methods, turned into the contract's `NegotiationTerms`.

Handlers speak in the job's terms (`scale_to=4, accept=(3, 4), carbon_cap=250`); the wire format nests them
(`desired_workers`, `accept_workers: {min, max}`, `constraints: {carbon_cap_g_per_kwh}`). Validation happens here,
before any request is sent, so a handler bug (`accept=(5, 3)`) fails in the handler with the contract's message.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import Constraints, NegotiationTerms
from harmonaize.ranges import WorkerRange

__all__ = ["WorkerBounds", "build_terms"]

WorkerBounds = tuple[int, int] | WorkerRange
"""What `accept=` takes: an inclusive (low, high) pair of worker counts, the short form a handler writes, or the
contract's `WorkerRange` itself (e.g. one read from an offer's terms). The name stays because handlers annotate
with it."""


def _when(value: datetime | timedelta | None) -> datetime | None:
    """Absolute times pass through; a timedelta is "from now"."""
    if isinstance(value, timedelta):
        return datetime.now(UTC) + value
    return value


def build_terms(
    *,
    scale_to: int | None = None,
    accept: WorkerBounds | None = None,
    plan: ParallelPlan | str | None = None,
    start_after: datetime | timedelta | None = None,
    region: str | None = None,
    carbon_cap: float | None = None,
    deadline: datetime | timedelta | None = None,
    budget_gpu_hours: float | None = None,
    replace: Sequence[str] | None = None,
    base: NegotiationTerms | None = None,
) -> NegotiationTerms:
    """Terms from keyword arguments; with `base`, only the arguments given replace the base's values (a counter)."""
    values: dict[str, Any] = base.model_dump(exclude={"constraints"}) if base is not None else {}
    constraints: dict[str, Any] = base.constraints.model_dump() if base is not None else {}
    if scale_to is not None:
        values["desired_workers"] = scale_to
    if isinstance(accept, WorkerRange):
        values["accept_workers"] = accept
    elif accept is not None:
        low, high = accept
        values["accept_workers"] = WorkerRange(min=low, max=high)
    if plan is not None:
        values["parallel_plan"] = ParallelPlan(plan)
    if start_after is not None:
        values["start_after"] = _when(start_after)
    if region is not None:
        values["region"] = region
    if replace is not None:
        values["replace_hosts"] = tuple(replace) or None
    if carbon_cap is not None:
        constraints["carbon_cap_g_per_kwh"] = carbon_cap
    if deadline is not None:
        constraints["deadline"] = _when(deadline)
    if budget_gpu_hours is not None:
        constraints["budget_gpu_hours"] = budget_gpu_hours
    return NegotiationTerms.model_validate({**values, "constraints": Constraints.model_validate(constraints)})
