"""Negotiation outcomes, published to the tenant as events as well as stored for REST history.

A controller that reacts to its own negotiations (or a dashboard) can follow them on the event feed without polling;
the REST history stays the record of every round.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from harmonaize.events.base import EventData
from harmonaize.events.fields import UtcDatetime
from harmonaize.events.kinds import EventKind
from harmonaize.negotiation import NegotiationKind, NegotiationState, Offer, OfferOption

__all__ = ["NegotiationUpdate"]


class NegotiationUpdate(EventData):
    """A negotiation changed state: offered (round n), accepted, rejected, declined, cancelled or expired."""

    KIND: ClassVar[EventKind] = EventKind.NEGOTIATION
    VERSION: ClassVar[int] = 1

    negotiation_id: str = Field(pattern=r"^[0-9a-f-]{32,36}$")
    kind: NegotiationKind
    state: NegotiationState
    round: int = Field(ge=1, le=1000)
    offer: Offer | None = None
    accepted_option: OfferOption | None = None
    at: UtcDatetime
