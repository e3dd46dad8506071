"""The negotiation lifecycle as an explicit transition table: every allowed (state, action) pair and where it leads.

Anything not in the table is refused with `InvalidTransitionError`, whose reason names the current state
("negotiation is accepted: cannot counter"); the API answers it with 409. Two steps exist only inside one
transaction and are never stored: `NEW` (before the request is written) and `AWAITING_PROVIDER` (the tenant has
spoken, the provider's policy answers before the transaction commits). Stored states are `NegotiationState`s.
The rounds that record what became of an accepted maintenance approval change no state: their own table is
`approval_lifecycle.TRANSITIONS`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from api.services.errors import ConflictError
from harmonaize.negotiation import Actor, NegotiationState, RoundAction


class Step(enum.StrEnum):
    """Transient steps inside one transaction (never stored, never shown to a tenant)."""

    NEW = "new"
    AWAITING_PROVIDER = "awaiting_provider"


Status = NegotiationState | Step

_OFFERED = NegotiationState.OFFERED

TRANSITIONS: Final[Mapping[tuple[Status, RoundAction], Status]] = {
    # The tenant opens a negotiation (job, kind, terms); the provider answers in the same transaction.
    (Step.NEW, RoundAction.REQUEST): Step.AWAITING_PROVIDER,
    # The provider answers with an offer: one or more options, valid until the offer's expiry.
    (Step.AWAITING_PROVIDER, RoundAction.OFFER): _OFFERED,
    # The provider can offer nothing inside the tenant's terms; the reason is in the round's note. Terminal.
    (Step.AWAITING_PROVIDER, RoundAction.DECLINE): NegotiationState.DECLINED,
    # The tenant counters with new terms: the offer is withdrawn and the provider answers again, in a new round.
    (_OFFERED, RoundAction.COUNTER): Step.AWAITING_PROVIDER,
    # The tenant takes one option; ledger, job and desired placement change in the same transaction. Terminal.
    # For approve_maintenance nothing is placed: the approval is queued for the agents of the job's hosts, and what
    # they report is recorded as provider rounds after it (`approval_lifecycle`), the state staying accepted.
    (_OFFERED, RoundAction.ACCEPT): NegotiationState.ACCEPTED,
    # The tenant turns the offer down and ends the negotiation. Terminal.
    (_OFFERED, RoundAction.REJECT): NegotiationState.REJECTED,
    # The tenant withdraws its request (e.g. the condition that prompted it has passed). Terminal.
    (_OFFERED, RoundAction.CANCEL): NegotiationState.CANCELLED,
    # The offer's expiry passed unanswered (sweeper, or lazily on the next read or action). Terminal.
    (_OFFERED, RoundAction.EXPIRE): NegotiationState.EXPIRED,
}

ACTORS: Final[Mapping[RoundAction, Actor]] = {
    RoundAction.REQUEST: Actor.TENANT,
    RoundAction.COUNTER: Actor.TENANT,
    RoundAction.ACCEPT: Actor.TENANT,
    RoundAction.REJECT: Actor.TENANT,
    RoundAction.CANCEL: Actor.TENANT,
    RoundAction.OFFER: Actor.PROVIDER,
    RoundAction.DECLINE: Actor.PROVIDER,
    RoundAction.EXPIRE: Actor.PROVIDER,
    RoundAction.APPROVAL_PENDING: Actor.PROVIDER,
    RoundAction.APPROVED: Actor.PROVIDER,
    RoundAction.APPROVAL_FAILED: Actor.PROVIDER,
}
"""Who takes each action (recorded with every round)."""

TENANT_ACTIONS: Final = (RoundAction.ACCEPT, RoundAction.COUNTER, RoundAction.REJECT, RoundAction.CANCEL)
"""What a tenant may do to an existing negotiation (one route each)."""


class InvalidTransitionError(ConflictError):
    """The action is not allowed in the negotiation's current state; nothing changed."""

    def __init__(self, state: Status, action: RoundAction) -> None:
        super().__init__(f"negotiation is {state.value}: cannot {action.value}")
        self.state = state
        self.action = action


def next_status(state: Status, action: RoundAction) -> Status:
    """Where `action` leads from `state`, or InvalidTransitionError."""
    try:
        return TRANSITIONS[(state, action)]
    except KeyError:
        raise InvalidTransitionError(state, action) from None
