"""`Offer`: the handle a handler holds on one negotiation, from the provider's offer to accept, counter or reject.

The handle always reflects the last state the provider reported. Methods check the outcome they asked for and raise
otherwise, so `await offer.accept()` returning means the provider committed the change: a negotiation that expired
or was already settled differently raises `ConflictError` carrying the provider's reason.

Accepting is idempotent from the handler's point of view: accepting an offer that is already accepted with the same
option returns normally. That matters after a controller restart, when a redelivered event re-runs its handler and the
provider replays the earlier (already accepted) negotiation for the same idempotency key.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta

from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms, OfferOption
from harmonaize.rest import NegotiationSummary
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.errors import ConflictError, Declined
from tenant_controllers.terms import WorkerBounds, build_terms

__all__ = ["Offer"]


class Offer:
    """The provider's current offer in one negotiation."""

    def __init__(
        self, negotiation: NegotiationSummary, *, api: ProviderApi, on_change: Callable[[], None] | None = None
    ) -> None:
        self._negotiation = negotiation
        self._api = api
        self._on_change = on_change or (lambda: None)
        """Called before an answer that may change the job (accept, counter): its view must be re-read."""

    def __repr__(self) -> str:
        return (
            f"Offer(id={self.id!r}, job={self.job!r}, kind={self.kind.value}, state={self.state.value}, "
            f"round={self.round}, options={len(self.options)})"
        )

    @property
    def negotiation(self) -> NegotiationSummary:
        """Everything the provider last reported: a `NegotiationPublic` with its rounds after a request, an answer or
        a refresh; a listed summary (no rounds) for a handle from `Job.open_offers` until then."""
        return self._negotiation

    @property
    def id(self) -> str:
        return self._negotiation.id

    @property
    def job(self) -> str:
        return self._negotiation.job

    @property
    def kind(self) -> NegotiationKind:
        return self._negotiation.kind

    @property
    def state(self) -> NegotiationState:
        return self._negotiation.state

    @property
    def round(self) -> int:
        return self._negotiation.round

    @property
    def terms(self) -> NegotiationTerms:
        """What we asked for in the latest round."""
        return self._negotiation.terms

    @property
    def options(self) -> tuple[OfferOption, ...]:
        """What the provider would do; accept at most one, by index."""
        offer = self._negotiation.offer
        return offer.options if offer is not None else ()

    @property
    def expires_at(self) -> datetime | None:
        offer = self._negotiation.offer
        return offer.expires_at if offer is not None else None

    async def refresh(self) -> Offer:
        """Re-read the negotiation (it may have expired, or been settled by another client)."""
        self._negotiation = await self._api.get_negotiation(self.id)
        return self

    async def accept(self, option: int = 0) -> OfferOption:
        """Accept option `option`; returns it once the provider has committed the change."""
        done = self._accepted_as(option)
        if done is not None:
            return done
        chosen = self._option(option)
        self._on_change()
        try:
            self._negotiation = await self._api.act(self._negotiation, "accept", {"option": option})
        except ConflictError:
            await self.refresh()
            done = self._accepted_as(option)
            if done is not None:
                return done
            raise
        if self.state is not NegotiationState.ACCEPTED:
            raise ConflictError(
                f"negotiation {self.id} is {self.state.value}, not accepted", status=None, method="POST", url="accept"
            )
        return self._accepted_as(option) or chosen

    async def counter(
        self,
        *,
        scale_to: int | None = None,
        accept: WorkerBounds | None = None,
        plan: ParallelPlan | str | None = None,
        start_after: datetime | timedelta | None = None,
        region: str | None = None,
        carbon_cap: float | None = None,
        deadline: datetime | timedelta | None = None,
        budget_gpu_hours: float | None = None,
        terms: NegotiationTerms | None = None,
    ) -> Offer:
        """Answer with new terms (the arguments given replace this round's); returns the provider's next offer.

        Raises Declined when the provider can offer nothing inside the new terms.
        """
        new_terms = terms or build_terms(
            scale_to=scale_to,
            accept=accept,
            plan=plan,
            start_after=start_after,
            region=region,
            carbon_cap=carbon_cap,
            deadline=deadline,
            budget_gpu_hours=budget_gpu_hours,
            base=self.terms,
        )
        self._on_change()
        answer = await self._api.act(self._negotiation, "counter", new_terms.model_dump(mode="json", exclude_none=True))
        self._negotiation = answer
        if answer.state is NegotiationState.DECLINED:
            raise Declined(answer)
        if answer.state is not NegotiationState.OFFERED:
            raise ConflictError(
                f"negotiation {self.id} is {answer.state.value} after the counter", status=None, method="POST",
                url="counter",
            )
        return Offer(answer, api=self._api, on_change=self._on_change)

    async def reject(self, reason: str | None = None) -> None:
        """Turn the offer down; the negotiation ends."""
        await self._settle("reject", NegotiationState.REJECTED, reason)

    async def cancel(self, reason: str | None = None) -> None:
        """Withdraw the request; the negotiation ends."""
        await self._settle("cancel", NegotiationState.CANCELLED, reason)

    async def _settle(self, action: str, wanted: NegotiationState, reason: str | None) -> None:
        if self.state is wanted:
            return
        body = {"reason": reason} if reason else {}
        self._negotiation = await self._api.act(self._negotiation, action, body)
        if self.state is not wanted:
            raise ConflictError(
                f"negotiation {self.id} is {self.state.value}, not {wanted.value}", status=None, method="POST",
                url=action,
            )

    def _option(self, index: int) -> OfferOption:
        options = self.options
        if not options:
            raise ConflictError(
                f"negotiation {self.id} has no offer to accept (state {self.state.value})", status=None
            )
        if not 0 <= index < len(options):
            raise IndexError(f"option {index} does not exist: the offer has {len(options)} option(s)")
        return options[index]

    def _accepted_as(self, index: int) -> OfferOption | None:
        """The accepted option when this negotiation is already accepted with option `index`; else None.

        Raises ConflictError when it was accepted with a different option: the handler must not believe otherwise.
        """
        if self.state is not NegotiationState.ACCEPTED:
            return None
        accepted = self._negotiation.accepted_option
        options = self.options
        wanted = options[index] if 0 <= index < len(options) else None
        if not (accepted is None or wanted is None or accepted == wanted):
            raise ConflictError(
                f"negotiation {self.id} was already accepted with another option", status=None, url="accept"
            )
        return accepted if accepted is not None else wanted
