"""The provider's REST replies a tenant reads, declared once for both ends.

The API answers with these models (so its OpenAPI document is generated from them) and the tenant SDK parses the
same bodies with them, so a field the provider adds, renames or retypes changes the SDK's view in the same commit
instead of drifting from a copy kept by hand. Unknown top-level fields are ignored (pydantic's default), so a provider
newer than the SDK may add some; the job's ranges and compression forbid them, being request bodies too. Class names
are the OpenAPI schema names and docstrings their descriptions: renaming one changes the published document.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from harmonaize.jobs import Compression, ParallelPlan
from harmonaize.negotiation import (
    Actor,
    NegotiationKind,
    NegotiationState,
    NegotiationTerms,
    Offer,
    OfferOption,
    RoundAction,
)
from harmonaize.ranges import IntRange

__all__ = [
    "MAX_POWERSGD_RANK",
    "GradientCompression",
    "JobPublic",
    "NegotiationPage",
    "NegotiationPublic",
    "NegotiationSummary",
    "RoundPublic",
]

MAX_POWERSGD_RANK = 1024


class _Reply(BaseModel):
    """Frozen: a reply is what the provider said at one moment; a changed view is a new read, not an edit."""

    model_config = ConfigDict(frozen=True)


class GradientCompression(BaseModel):
    """Which compression the provider may switch the job to, and the largest PowerSGD rank it may pick."""

    model_config = ConfigDict(extra="forbid")  # also a request body (in `JobCreate`): a misspelt field is an error

    allowed: list[Compression] = Field(default_factory=lambda: [Compression.NONE], min_length=1, max_length=3)
    powersgd_max_rank: int | None = Field(default=None, ge=1, le=MAX_POWERSGD_RANK, validate_default=True)

    @field_validator("allowed")
    @classmethod
    def _canonical(cls, value: list[Compression]) -> list[Compression]:
        return [option for option in Compression if option in value]

    @field_validator("powersgd_max_rank")
    @classmethod
    def _rank_iff_powersgd(cls, value: int | None, info: ValidationInfo) -> int | None:
        allowed = info.data.get("allowed")
        if allowed is None:
            return value
        if Compression.POWERSGD in allowed and value is None:
            raise ValueError("required when powersgd is allowed")
        if Compression.POWERSGD not in allowed and value is not None:
            raise ValueError("only allowed together with powersgd in gradient_compression.allowed")
        return value


# `GET /v1/jobs/{id}`: the tenant's job as the provider has it now, its ranges regrouped as the tenant sent them.
# No docstring: the published schema has no description.
class JobPublic(_Reply):
    id: str
    name: str
    min_workers: int
    max_workers: int
    gpus_per_worker: int
    parallel_plan: ParallelPlan
    desired_workers: int
    checkpoint_interval_steps: IntRange
    gradient_compression: GradientCompression
    batch_size: IntRange | None
    gradient_accumulation: IntRange
    global_batch: int | None = None
    entrypoint: list[str]
    placement_epoch: int
    created_at: datetime


class RoundPublic(_Reply):
    """One step of a negotiation: who did what and when, with the terms or offer of that step."""

    round: int
    actor: Actor
    action: RoundAction
    at: datetime
    terms: NegotiationTerms | None
    offer: Offer | None
    option: int | None
    note: str | None


class NegotiationSummary(_Reply):
    """A negotiation's current state (a list item); `accepted_option` is the option taken, once accepted."""

    id: str
    job: str
    kind: NegotiationKind
    state: NegotiationState
    round: int
    terms: NegotiationTerms
    offer: Offer | None
    accepted_option: OfferOption | None
    created_at: datetime
    updated_at: datetime


class NegotiationPublic(NegotiationSummary):
    """A negotiation with every round, oldest first."""

    rounds: list[RoundPublic]


class NegotiationPage(_Reply):
    """Newest first; pass `next_cursor` as `cursor` for the next page (null: no more)."""

    items: list[NegotiationSummary]
    next_cursor: str | None
