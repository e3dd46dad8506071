"""The per-tenant rate limit on negotiation writes: 429 with Retry-After and a reason; reads and other tenants pass."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI

from api.limits import TokenBuckets
from harmonaize.negotiation import RoundAction
from harmonaize.settings import Settings
from tests.api.api_testkit import create_host, create_job, create_tenant
from tests.api.negotiation_kit import act, negotiate
from tests.security.security_kit import serving
from tests.support import ManualClock

BURST = 3
RATE = 0.01
"""One token per 100 s: nothing refills while the test runs, so the 4th write is refused with Retry-After ~100."""


@pytest.fixture
async def limited(migrated_settings: Settings) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    async with serving(migrated_settings, negotiation_rate_per_s=RATE, negotiation_burst=BURST) as served:
        yield served


async def test_the_fourth_write_in_a_burst_of_three_is_429_with_retry_after(
    limited: tuple[FastAPI, httpx.AsyncClient],
) -> None:
    _, client = limited
    acme = await create_tenant(client, "acme")
    globex = await create_tenant(client, "globex")
    await create_host(client, "h1", gpus=8, group="rack-a")
    await create_job(client, acme, "train", initial_workers=1)
    first = await negotiate(client, acme, "train", key="k1", desired_workers=2)  # 1
    assert (await act(client, acme, first["id"], RoundAction.ACCEPT)).status_code == 200  # 2
    second = await negotiate(client, acme, "train", key="k2", desired_workers=3)  # 3

    refused = await act(client, acme, second["id"], RoundAction.COUNTER)  # 4: an action route, over the limit
    assert refused.status_code == 429, refused.text
    retry_after = int(refused.headers["Retry-After"])
    assert 90 <= retry_after <= 100, retry_after
    body = refused.json()
    assert body["errors"] == [] and "too many negotiation requests" in body["reason"]
    assert f"retry in {retry_after} s" in body["reason"] and f"at most {BURST} at once" in body["reason"]
    opened = await client.post(
        "/v1/negotiations",
        json={"job": "train", "kind": "scale", "terms": {"desired_workers": 4}},
        headers={**acme.headers, "Idempotency-Key": "k3"},
    )
    assert opened.status_code == 429, "opening is limited like the actions"

    unchanged = (await client.get(f"/v1/negotiations/{second['id']}", headers=acme.headers)).json()
    assert (unchanged["state"], unchanged["round"]) == ("offered", 1), "a refused write changes nothing"
    history = await client.get("/v1/negotiations", headers=acme.headers)
    assert history.status_code == 200 and len(history.json()["items"]) == 2, "reads are not limited"
    await create_job(client, globex, "g-train")
    theirs = await negotiate(client, globex, "g-train", key="g1", desired_workers=1)
    assert theirs["state"] in ("offered", "declined"), "each tenant has its own bucket"


async def test_the_limit_can_be_turned_off(migrated_settings: Settings) -> None:
    async with serving(migrated_settings, negotiation_rate_per_s=0.0, negotiation_burst=1) as (_, client):
        acme = await create_tenant(client, "acme")
        await create_job(client, acme, "train")
        for n in range(5):
            await negotiate(client, acme, "train", key=f"k{n}", desired_workers=0)


def test_token_buckets_refill_at_the_rate_up_to_the_burst() -> None:
    clock = ManualClock(1000)
    buckets = TokenBuckets(rate_per_s=2.0, burst=2, clock=clock)
    assert [buckets.take("acme") for _ in range(2)] == [0.0, 0.0]
    assert buckets.take("acme") == pytest.approx(0.5)
    assert buckets.take("globex") == 0.0, "buckets are per key"
    clock.now += 0.25
    assert buckets.take("acme") == pytest.approx(0.25), "half a token refilled, half to go"
    clock.now += 0.25
    assert buckets.take("acme") == 0.0
    clock.now += 3600
    assert [buckets.take("acme") for _ in range(2)] == [0.0, 0.0]
    assert buckets.take("acme") > 0, "an hour idle still refills only up to the burst"
    assert TokenBuckets(rate_per_s=0.0, burst=1, clock=clock).take("acme") == 0.0
