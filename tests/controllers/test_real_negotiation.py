"""Real tier: the negotiation client against the real control plane (`api/routes/negotiations.py`).

Two hosts of 4 GPUs in two locality groups, a job of 1..4 workers placed at 2. Everything the fast tier checks against
the fake is checked here against the provider's own state machine, policy and idempotency store.
"""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path

import pytest

from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationState, NegotiationTerms
from tenant_controllers import ConflictError, Declined, InvalidRequestError, Job, NotFoundError
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.idempotency import HandlerInvocation, invocation
from tests.controllers.live_cloud import LiveCloud


@pytest.fixture
async def placed(cloud: LiveCloud) -> LiveCloud:
    await cloud.add_host("h1", gpus=4, group="rack-a")
    await cloud.add_host("h2", gpus=4, group="rack-b")
    await cloud.create_job("llm-finetune", min_workers=1, max_workers=4, initial_workers=2)
    return cloud


async def test_scale_offer_accept_changes_the_agreed_size(placed: LiveCloud, tmp_path: Path) -> None:
    async with ProviderApi(base_url=placed.api_url, token=placed.token) as api:
        job = await Job("llm-finetune", api=api).refresh()
        assert (job.workers, job.parallel_plan) == (2, ParallelPlan.DDP)
        offer = await job.negotiate(scale_to=4, accept=(3, 4))
        offered = offer.state  # a local, so that mypy's narrowing does not outlive accept()
        assert offered is NegotiationState.OFFERED and offer.options and offer.expires_at is not None
        chosen = await offer.accept(0)
        assert offer.state is NegotiationState.ACCEPTED
        assert chosen.workers is not None
        assert (await job.refresh()).workers == chosen.workers >= 3
        assert await offer.accept(0) == chosen, "accepting again is harmless"

        history = [n async for n in job.negotiations()]
        assert [(n.id, n.state) for n in history] == [(offer.id, NegotiationState.ACCEPTED)]
        full = await api.get_negotiation(offer.id)
        assert [(r.actor, r.action) for r in full.rounds][:2] == [("tenant", "request"), ("provider", "offer")]
        assert (full.rounds[-1].actor, full.rounds[-1].action) == ("tenant", "accept")


async def test_declined_counter_reject_cancel_and_errors_carry_the_servers_reason(placed: LiveCloud) -> None:
    async with ProviderApi(base_url=placed.api_url, token=placed.token) as api:
        job = await Job("llm-finetune", api=api).refresh()
        with pytest.raises(Declined) as declined:
            await job.negotiate(scale_to=6, accept=(5, 6))  # outside the job's own 1..4
        assert declined.value.negotiation.state is NegotiationState.DECLINED
        assert "declined: no worker count you accept (5-6)" in str(declined.value), "the provider's reason is shown"

        first = await job.negotiate(scale_to=3)
        countered = await first.counter(scale_to=4, accept=(3, 4))
        offered = countered.state  # a local, so that mypy's narrowing does not outlive reject()
        assert countered.round == 2 and offered is NegotiationState.OFFERED
        await countered.reject("changed our mind")
        assert countered.state is NegotiationState.REJECTED
        with pytest.raises(ConflictError) as conflict:
            await countered.accept()
        assert conflict.value.status == 409 and "rejected" in conflict.value.reason

        second = await job.repartition(ParallelPlan.HSDP)
        await second.cancel()
        assert second.state is NegotiationState.CANCELLED

        with pytest.raises(NotFoundError) as missing:
            await api.get_negotiation(str(uuid.uuid4()))
        assert missing.value.status == 404 and missing.value.reason
        with pytest.raises(InvalidRequestError) as invalid:
            await api.create_negotiation(job="llm-finetune", kind=NegotiationKind.SCALE, terms=NegotiationTerms(),
                                         idempotency_key="x" * 201)
        assert invalid.value.status == 422 and invalid.value.errors


async def test_idempotency_keys_replay_defer_gets_a_later_start_and_an_unknown_region_is_declined(
    placed: LiveCloud,
) -> None:
    async with ProviderApi(base_url=placed.api_url, token=placed.token) as api:
        job = await Job("llm-finetune", api=api).refresh()
        terms = NegotiationTerms(desired_workers=3)
        once = await api.create_negotiation(job="llm-finetune", kind=NegotiationKind.SCALE, terms=terms,
                                            idempotency_key="retry-me")
        again = await api.create_negotiation(job="llm-finetune", kind=NegotiationKind.SCALE, terms=terms,
                                             idempotency_key="retry-me")
        assert once.id == again.id

        ids = []
        for attempt in (1, 1, 2):
            with invocation(HandlerInvocation("ctl", "event-1", "on_failure", attempt)):
                ids.append((await job.negotiate(scale_to=3)).id)
        assert ids[0] == ids[1] != ids[2], "a redelivered event replays; a retry asks afresh"

        offer = await job.defer(start_after=timedelta(hours=1), deadline=timedelta(hours=12))
        assert offer.kind is NegotiationKind.DEFER and offer.state is NegotiationState.OFFERED
        start_after = offer.terms.start_after
        assert start_after is not None
        assert all(option.start_at is not None and option.start_at >= start_after for option in offer.options)
        await offer.cancel("just looking")
        with pytest.raises(Declined) as declined:
            await job.migrate(region="XX-NOWHERE")
        assert declined.value.negotiation.kind is NegotiationKind.MIGRATE_REGION
