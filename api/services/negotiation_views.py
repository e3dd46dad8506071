"""A negotiation as the API shows it: its offer parsed once, its summary, and its full record with every round.

Apart from the store, so that what a negotiation looks like to a reader does not depend on how it is written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.models import Negotiation, NegotiationRound
from harmonaize.negotiation import NegotiationTerms, Offer, OfferOption
from harmonaize.rest import NegotiationPublic, NegotiationSummary, RoundPublic


@dataclass(frozen=True)
class NegotiationRecord:
    """A negotiation row with its rounds (oldest first)."""

    negotiation: Negotiation
    rounds: list[NegotiationRound]


def offer_of(negotiation: Negotiation) -> Offer | None:
    """The negotiation's current offer, parsed once per stored value: one request reads it for the step, the
    event, the warm joiners and the answer, and validating it each time was most of what those reads cost. The
    column is replaced, never changed in place, so the stored dict's identity says whether the parse is current."""
    raw = negotiation.offer
    if raw is None:
        return None
    parsed: tuple[object, Offer] | None = getattr(negotiation, _PARSED_OFFER, None)
    if parsed is None or parsed[0] is not raw:
        parsed = (raw, Offer.model_validate(raw))
        setattr(negotiation, _PARSED_OFFER, parsed)
    return parsed[1]


_PARSED_OFFER = "_hz_parsed_offer"
"""A plain attribute of the row's object (not mapped: the ORM ignores it) holding (stored dict, parsed offer)."""


def accepted_option_of(negotiation: Negotiation) -> OfferOption | None:
    offer = offer_of(negotiation)
    if offer is None or negotiation.accepted_option is None:
        return None
    return offer.options[negotiation.accepted_option]


def _summary_fields(negotiation: Negotiation) -> dict[str, Any]:
    """A summary's fields, parsed models where they are models (passed on as they are, not validated again)."""
    return {
        "id": negotiation.id,
        "job": negotiation.job_id,
        "kind": negotiation.kind,
        "state": negotiation.state,
        "round": negotiation.round,
        "terms": NegotiationTerms.model_validate(negotiation.terms),
        "offer": offer_of(negotiation),
        "accepted_option": accepted_option_of(negotiation),
        "created_at": negotiation.created_at,
        "updated_at": negotiation.updated_at,
    }


def summary(negotiation: Negotiation) -> NegotiationSummary:
    return NegotiationSummary(**_summary_fields(negotiation))


def public(record: NegotiationRecord) -> NegotiationPublic:
    rounds = [
        RoundPublic(
            round=step.round,
            actor=step.actor,
            action=step.action,
            at=step.at,
            terms=None if step.terms is None else NegotiationTerms.model_validate(step.terms),
            offer=None if step.offer is None else Offer.model_validate(step.offer),
            option=step.option,
            note=step.note,
        )
        for step in record.rounds
    ]
    return NegotiationPublic(**_summary_fields(record.negotiation), rounds=rounds)
