"""Verified tokens remembered for a moment (`api.services.token_cache`), and revocation outrunning them.

The cache on its own, with a clock moved by hand: an entry lasts `ttl_s`, only active tenants are kept, a lookup
that read the row before a revocation cannot put its answer back after it, the size is bounded, 0 turns it off.
Through the API, with two replicas on one database (each backend): the replica that revokes refuses the token at
once although it had just verified it; the other one, which had it cached too, refuses it once its entry is older
than the window, and at once with the cache off.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import httpx
from fastapi import FastAPI

from api.app import create_app
from api.services.tenants import TokenHolder
from api.services.token_cache import TokenCache
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker
from tests.api.api_testkit import ADMIN, TenantHandle
from tests.support import ManualClock

ACME = TokenHolder(id="acme", revoked_at=None)
GLOBEX = TokenHolder(id="globex", revoked_at=None)


def test_an_entry_lasts_the_window_and_no_longer() -> None:
    ticks = ManualClock()
    cache = TokenCache(1.0, clock=ticks)
    assert cache.get("t-acme") is None
    cache.put("t-acme", ACME, generation=cache.generation)
    assert cache.get("t-acme") == ACME
    assert cache.get("t-other") is None
    ticks.now += 0.999
    assert cache.get("t-acme") == ACME
    ticks.now += 0.001
    assert cache.get("t-acme") is None
    assert len(cache) == 0, "an expired entry is dropped when found"


def test_only_active_tenants_are_cached_and_the_plaintext_is_not_kept() -> None:
    cache = TokenCache(60.0, clock=ManualClock())
    cache.put("t-revoked", TokenHolder(id="acme", revoked_at=datetime(2026, 1, 1, tzinfo=UTC)),
              generation=cache.generation)
    assert cache.get("t-revoked") is None
    cache.put("hzt_secret_value", ACME, generation=cache.generation)
    assert "hzt_secret_value" not in repr(vars(cache))


def test_forgetting_a_tenant_drops_its_tokens_and_refuses_answers_read_before() -> None:
    cache = TokenCache(60.0, clock=ManualClock())
    cache.put("t-acme", ACME, generation=cache.generation)
    cache.put("t-globex", GLOBEX, generation=cache.generation)
    read_before = cache.generation  # a request read acme's row (still active) ...
    cache.forget_tenant("acme")  # ... the revocation committed meanwhile ...
    cache.put("t-acme-2", ACME, generation=read_before)  # ... and its stale answer arrives afterwards
    assert cache.get("t-acme") is None and cache.get("t-acme-2") is None
    assert cache.get("t-globex") == GLOBEX, "other tenants stay cached"


def test_the_size_is_bounded_oldest_first_and_zero_turns_it_off() -> None:
    cache = TokenCache(60.0, max_entries=3, clock=ManualClock())
    for n in range(5):
        cache.put(f"t-{n}", TokenHolder(id=f"tenant-{n}", revoked_at=None), generation=cache.generation)
    assert len(cache) == 3
    assert [cache.get(f"t-{n}") is not None for n in range(5)] == [False, False, True, True, True]
    off = TokenCache(0.0)
    off.put("t-acme", ACME, generation=off.generation)
    assert off.get("t-acme") is None and len(off) == 0


@asynccontextmanager
async def replica(settings: Settings, cache: TokenCache | None = None) -> AsyncIterator[httpx.AsyncClient]:
    """Another API process on the same database (its own broker view: only the database is shared)."""
    app: FastAPI = create_app(settings, broker=InMemoryBroker())
    if cache is not None:  # one whose clock the test moves (it revokes nothing, so nothing else needs wiring)
        app.state.token_cache = cache
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://hz.test") as http:
            yield http


async def test_a_revocation_ends_a_cached_token_at_once_here_and_within_the_window_on_another_replica(
    client: httpx.AsyncClient, migrated_settings: Settings, acme: TenantHandle,
) -> None:
    ticks = ManualClock()
    async with replica(migrated_settings, TokenCache(1.0, clock=ticks)) as other:
        assert (await client.get("/v1/tenant", headers=acme.headers)).status_code == 200  # cached here
        assert (await other.get("/v1/tenant", headers=acme.headers)).status_code == 200  # and there
        assert (await client.delete("/v1/tenants/acme", headers=ADMIN)).status_code == 200
        assert (await client.get("/v1/tenant", headers=acme.headers)).status_code == 401, "the revoking replica"
        assert (await other.get("/v1/tenant", headers=acme.headers)).status_code == 200, "inside the window"
        ticks.now += 1.0
        refused = await other.get("/v1/tenant", headers=acme.headers)
        assert refused.status_code == 401 and "revoked" in refused.json()["reason"]


async def test_with_the_cache_off_another_replica_refuses_a_revoked_token_at_once(
    client: httpx.AsyncClient, migrated_settings: Settings, acme: TenantHandle,
) -> None:
    uncached = migrated_settings.model_copy(update={"api_token_cache_s": 0.0})
    async with replica(uncached) as other:
        assert (await other.get("/v1/tenant", headers=acme.headers)).status_code == 200
        assert (await client.delete("/v1/tenants/acme", headers=ADMIN)).status_code == 200
        assert (await other.get("/v1/tenant", headers=acme.headers)).status_code == 401
