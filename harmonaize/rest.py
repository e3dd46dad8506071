"""The provider's REST replies a tenant reads, declared once for both ends.

The API answers with these models (so its OpenAPI document is generated from them) and the tenant SDK parses the
same bodies with them, so a field the provider adds, renames or retypes changes the SDK's view in the same commit
instead of drifting from a copy kept by hand. Unknown fields are ignored (pydantic's default), so a provider newer
than the SDK may add some. Class names are the OpenAPI schema names and docstrings their descriptions: renaming one
changes the published document.
"""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, ConfigDict

from harmonaize.negotiation import (
    Actor,
    NegotiationKind,
    NegotiationState,
    NegotiationTerms,
    Offer,
    OfferOption,
    RoundAction,
)

__all__ = ["NegotiationPage", "NegotiationPublic", "NegotiationSummary", "RoundPublic"]


class _Reply(BaseModel):
    """Frozen: a reply is what the provider said at one moment; a changed view is a new read, not an edit."""

    model_config = ConfigDict(frozen=True)


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
