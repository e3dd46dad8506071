"""Fast tier: the Job handle and negotiation client against a fake of the REST contract
(tests/controllers/fake_provider).

The same behaviours run against the real API in test_real_negotiation.py; here they are cheap enough to cover every
error mapping and every retry path.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import pytest

from harmonaize.jobs import ParallelPlan
from harmonaize.negotiation import NegotiationKind, NegotiationState
from tenant_controllers import (
    ApiUnavailableError,
    AuthenticationError,
    ConflictError,
    Declined,
    InvalidRequestError,
    Job,
    NotFoundError,
    PermanentError,
    TemporaryError,
)
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.idempotency import HandlerInvocation, invocation
from tests.controllers.fake_provider import FakeProvider


async def loaded(api: ProviderApi, job_id: str = "llm-finetune") -> Job:
    return await Job(job_id, api=api).refresh()


async def test_job_reads_the_agreed_size_and_negotiate_accept_changes_it(
    provider: FakeProvider, api: ProviderApi
) -> None:
    job = await loaded(api)
    assert (job.workers, job.min_workers, job.max_workers, job.parallel_plan) == (2, 1, 4, ParallelPlan.DDP)

    offer = await job.negotiate(scale_to=4, accept=(3, 4), carbon_cap=250)
    offered = offer.state  # a local, so that mypy's narrowing does not outlive accept()
    assert offered is NegotiationState.OFFERED and offer.kind is NegotiationKind.SCALE
    assert [o.workers for o in offer.options] == [4] and offer.expires_at is not None
    accepted = await offer.accept()
    assert accepted.workers == 4 and offer.state is NegotiationState.ACCEPTED
    assert (await job.refresh()).workers == 4

    [post] = provider.posts()
    body = json.loads(post.content)
    assert body == {"job": "llm-finetune", "kind": "scale", "terms": {
        "desired_workers": 4, "accept_workers": {"min": 3, "max": 4}, "constraints": {"carbon_cap_g_per_kwh": 250.0}}}
    assert post.headers["idempotency-key"].startswith("hz-")


async def test_a_declined_request_raises_declined_with_the_negotiation(
    provider: FakeProvider, api: ProviderApi
) -> None:
    provider.capacity["llm-finetune"] = 2
    job = await loaded(api)
    with pytest.raises(Declined) as caught:
        await job.negotiate(scale_to=4, accept=(3, 4))
    assert caught.value.negotiation.state is NegotiationState.DECLINED
    assert "no capacity" in str(caught.value)
    assert isinstance(caught.value, PermanentError)


async def test_counter_returns_a_new_offer_or_raises_declined(provider: FakeProvider, api: ProviderApi) -> None:
    provider.capacity["llm-finetune"] = 3
    job = await loaded(api)
    offer = await job.negotiate(scale_to=3, accept=(2, 3))
    better = await offer.counter(scale_to=3, accept=(3, 3))
    assert better is not offer and better.round == 2 and [o.workers for o in better.options] == [3]
    assert better.terms.constraints == offer.terms.constraints
    with pytest.raises(Declined):
        await better.counter(scale_to=4, accept=(4, 4))


async def test_reject_and_cancel_end_the_negotiation_and_later_actions_conflict(
    provider: FakeProvider, api: ProviderApi
) -> None:
    job = await loaded(api)
    first = await job.negotiate(scale_to=3)
    await first.reject("too slow")
    assert first.state is NegotiationState.REJECTED
    second = await job.repartition(ParallelPlan.HSDP)
    await second.cancel()
    assert second.state is NegotiationState.CANCELLED
    with pytest.raises(ConflictError) as caught:
        await second.counter(plan="fsdp")
    assert caught.value.status == 409 and "cancelled" in caught.value.reason
    assert not isinstance(caught.value, (PermanentError, TemporaryError)), "409 is retried by the handler policy"


async def test_http_errors_map_to_exceptions_carrying_the_servers_reason(
    provider: FakeProvider, api: ProviderApi
) -> None:
    with pytest.raises(NotFoundError) as missing:
        await Job("no-such-job", api=api).refresh()
    assert missing.value.status == 404 and "no-such-job" in missing.value.reason
    job = await loaded(api)
    offer = await job.negotiate(scale_to=3)
    with pytest.raises(IndexError):
        await offer.accept(option=5)
    provider.negotiations[offer.id]["offer"]["options"].append({"workers": 1})
    await offer.refresh()
    provider.negotiations[offer.id]["offer"]["options"].pop()
    with pytest.raises(InvalidRequestError) as invalid:
        await offer.accept(option=1)
    assert invalid.value.status == 422 and invalid.value.errors[0]["field"] == "body.option"
    bad = ProviderApi(base_url="http://provider", token="wrong", transport=provider.transport)
    async with bad:
        with pytest.raises(AuthenticationError):
            await bad.get_job("llm-finetune")


async def test_5xx_is_resent_with_the_same_idempotency_key_and_then_becomes_a_temporary_error(
    provider: FakeProvider, api: ProviderApi
) -> None:
    job = await loaded(api)
    provider.fail_next(2, status=503, path_contains="/negotiations")
    offer = await job.negotiate(scale_to=3)
    keys = {r.headers["idempotency-key"] for r in provider.posts()}
    assert len(provider.posts()) == 3 and len(keys) == 1 and len(provider.negotiations) == 1
    assert offer.state is NegotiationState.OFFERED

    provider.fail_next(3, status=502, path_contains="/negotiations")
    with pytest.raises(ApiUnavailableError) as caught:
        await job.negotiate(scale_to=3)
    assert isinstance(caught.value, TemporaryError) and caught.value.status == 502


async def test_a_post_whose_reply_was_lost_is_replayed_not_duplicated(provider: FakeProvider, api: ProviderApi) -> None:
    job = await loaded(api)
    provider.fail_next(1, status=0, lose_reply=True, path_contains="/negotiations")  # applied, then a read timeout
    offer = await job.negotiate(scale_to=3)
    assert len(provider.negotiations) == 1 and offer.id in provider.negotiations
    assert len({r.headers["idempotency-key"] for r in provider.posts()}) == 1


async def test_a_counter_whose_reply_was_lost_is_not_sent_twice(provider: FakeProvider, api: ProviderApi) -> None:
    job = await loaded(api)
    offer = await job.negotiate(scale_to=3)
    provider.fail_next(1, status=503, lose_reply=True, path_contains="/counter")
    countered = await offer.counter(scale_to=4, accept=(3, 4))
    assert countered.round == 2
    assert len(provider.negotiations[offer.id]["rounds"]) == 4, "request, offer, one counter, one offer"


async def test_accepting_twice_or_after_a_lost_reply_is_harmless(provider: FakeProvider, api: ProviderApi) -> None:
    job = await loaded(api)
    offer = await job.negotiate(scale_to=3)
    provider.fail_next(1, status=0, lose_reply=True, path_contains="/accept")
    assert (await offer.accept()).workers == 3
    assert (await offer.accept()).workers == 3
    accepts = [r for r in provider.requests if r.url.path.endswith("/accept")]
    assert len(accepts) == 1, "the retry saw the negotiation already accepted; the second call sent nothing"


async def test_inside_a_handler_the_same_attempt_gets_the_same_keys_and_a_retry_new_ones(
    provider: FakeProvider, api: ProviderApi
) -> None:
    """A redelivered event re-runs attempt 1: the provider replays instead of opening a second negotiation."""
    job = await loaded(api)
    ids = []
    for attempt in (1, 1, 2):
        with invocation(HandlerInvocation("ctl", "event-1", "on_failure", attempt)):
            ids.append((await job.negotiate(scale_to=3)).id)
    assert ids[0] == ids[1] != ids[2]
    assert len(provider.negotiations) == 2


async def test_history_pages_through_every_negotiation_of_the_job(provider: FakeProvider, api: ProviderApi) -> None:
    job = await loaded(api)
    for n in range(5):
        await job.negotiate(scale_to=1 + n % 4)
    await (await Job("other-job", api=api).refresh()).negotiate(scale_to=2)
    pages = ProviderApi(base_url="http://provider", token=provider.token, transport=provider.transport)
    async with pages:
        listed = [n async for n in pages.list_negotiations(job="llm-finetune", limit=2)]
    assert len(listed) == 5 and {n.job for n in listed} == {"llm-finetune"}
    assert len(await job.open_offers()) == 5


def test_terms_are_validated_before_anything_is_sent() -> None:
    from tenant_controllers.terms import build_terms

    with pytest.raises(ValueError, match="desired_workers must lie inside accept_workers"):
        build_terms(scale_to=5, accept=(1, 4))
    with pytest.raises(ValueError, match="min must be <= max"):
        build_terms(scale_to=2, accept=(3, 1))


async def test_defer_and_migrate_send_their_kinds_and_terms(provider: FakeProvider, api: ProviderApi) -> None:
    job = await loaded(api)
    offer = await job.defer(start_after=timedelta(hours=2), scale_to=3, accept=(2, 3), carbon_cap=180)
    assert offer.kind is NegotiationKind.DEFER and offer.options[0].start_at is not None
    await job.migrate(region="DE")
    defer_body, migrate_body = (json.loads(r.content) for r in provider.posts())
    assert defer_body["kind"] == "defer" and defer_body["terms"]["desired_workers"] == 3
    assert defer_body["terms"]["constraints"] == {"carbon_cap_g_per_kwh": 180.0}
    assert datetime.fromisoformat(defer_body["terms"]["start_after"]) > datetime.now(UTC) + timedelta(minutes=119)
    assert migrate_body == {
        "job": "llm-finetune", "kind": "migrate_region", "terms": {"region": "DE", "constraints": {}},
    }


async def test_a_scale_request_in_a_failure_handler_replaces_the_failing_host_unless_told_otherwise(
    provider: FakeProvider, api: ProviderApi
) -> None:
    failing, other = "h-0123456789abcdef", "h-fedcba9876543210"
    job = await loaded(api)
    with invocation(HandlerInvocation("ctl", "event-1", "on_failure", 1, failed_host=failing)):
        await job.negotiate(scale_to=2, accept=(1, 2))
        await job.negotiate(scale_to=2, replace=())
        await job.negotiate(scale_to=2, replace=other)
    with invocation(HandlerInvocation("ctl", "event-2", "on_carbon", 1)):
        await job.negotiate(scale_to=2)
    await job.negotiate(scale_to=2, replace=[failing, other])
    sent = [json.loads(r.content)["terms"].get("replace_hosts") for r in provider.posts()]
    assert sent == [[failing], None, [other], None, [failing, other]]
    with pytest.raises(ValueError, match="replace_hosts"):
        await job.negotiate(scale_to=2, replace="h1")
