"""The provider's answers as the SDK reads them: a negotiation with its rounds, and a page of the history.

These mirror `NegotiationPublic` of the REST contract. They ignore fields they do not know (the provider may add some)
but validate the ones they use, so a handler works with typed options (`OfferOption`) rather than dicts.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms, OfferOption
from harmonaize.negotiation import Offer as OfferTerms

__all__ = ["Negotiation", "NegotiationPage", "Round"]


class _Reply(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")


class Round(_Reply):
    """One step of a negotiation, as the provider recorded it."""

    round: int
    actor: str
    action: str
    at: datetime
    terms: NegotiationTerms | None = None
    offer: OfferTerms | None = None
    option: int | None = None
    note: str | None = None


class Negotiation(_Reply):
    """A negotiation's current state and full history."""

    id: str
    job: str
    kind: NegotiationKind
    state: NegotiationState
    round: int
    terms: NegotiationTerms
    offer: OfferTerms | None = None
    accepted_option: OfferOption | int | None = None
    created_at: datetime
    updated_at: datetime
    rounds: list[Round] = Field(default_factory=list)


class NegotiationPage(_Reply):
    items: list[Negotiation]
    next_cursor: str | None = None


def parse_negotiation(body: Any) -> Negotiation:
    return Negotiation.model_validate(body)
