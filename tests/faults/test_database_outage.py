"""The database is unavailable for 10 s: the API answers 503 with a reason, promptly, without crashing, and
recovers by itself once the database is back (same process, no restart).

The API runs as its own process (`harmonaize api serve`) against PostgreSQL reached through a TCP proxy this test
controls, so the outage is real at the network level: the proxy stops listening (new connections are refused) and
resets every open connection, which is what clients see when PostgreSQL restarts or its host goes away. During the
outage the test keeps asking (a health check, a tenant read, a tenant write); every answer must be a 503 whose JSON
body has a `reason` and a `Retry-After`, within a few seconds. After the proxy listens again, the same requests must
succeed within a few seconds, and what was written before the outage is still there.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import URL

from broker_config.server import NatsServer
from tests.faults.support import ADMIN_TOKEN, ApiService, TcpProxy, scaled

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(scaled(120, 600))]

OUTAGE_S = scaled(10, 60)
PROMPT_S = 5.0
"""An answer during the outage must come within this (a client's timeout is typically longer)."""
RECOVERY_S = 10.0


async def test_the_api_answers_503_while_the_database_is_down_and_recovers_by_itself(
    tmp_path: Path, nats_server: NatsServer, provider_secret: bytes, postgres_url: URL
) -> None:
    proxy = TcpProxy(postgres_url.host or "127.0.0.1", postgres_url.port or 5432)
    await proxy.start()
    url = postgres_url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    api = ApiService(tmp_path / "api", nats_server, provider_secret, database_url=url)
    try:
        await api.start()
        pid = api.process.pid if api.process else 0
        async with httpx.AsyncClient(base_url=api.url, timeout=30,
                                     headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as admin:
            created = await admin.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"})
            assert created.status_code == 201, created.text
        tenant = {"Authorization": f"Bearer {created.json()['api_token']}"}
        async with httpx.AsyncClient(base_url=api.url, headers=tenant, timeout=PROMPT_S + 25) as client:

            async def ask(n: int) -> tuple[str, httpx.Response | Exception, float]:
                """Request `n`: a health check, a tenant read or a tenant write, in turn."""
                name = ("health", "read", "write")[n % 3]
                started = time.monotonic()
                try:
                    if name == "health":
                        reply: httpx.Response | Exception = await client.get("/v1/healthz")
                    elif name == "read":
                        reply = await client.get("/v1/jobs")
                    else:
                        reply = await client.post("/v1/jobs", json={"id": f"job-{n}", "min_workers": 1,
                                                                    "max_workers": 2})
                except httpx.TransportError as exc:
                    reply = exc
                return name, reply, time.monotonic() - started

            for n in (2, 1, 3):  # write, read, then a health check whose session closes just as the database goes
                name, reply, _ = await ask(n)
                assert isinstance(reply, httpx.Response) and reply.status_code < 300, f"{name} before: {reply}"

            await proxy.cut()
            cut_at = time.monotonic()
            during: list[tuple[str, httpx.Response | Exception, float]] = []
            n = 4
            while time.monotonic() - cut_at < OUTAGE_S:
                during.append(await ask(n))
                n += 1
                await asyncio.sleep(0.2)
            await proxy.restore()
            restored_at = time.monotonic()

            recovered: dict[str, float] = {}
            while len(recovered) < 3 and time.monotonic() - restored_at < RECOVERY_S + PROMPT_S:
                name, reply, _ = await ask(n)
                n += 1
                if isinstance(reply, httpx.Response) and reply.status_code < 300:
                    recovered.setdefault(name, time.monotonic() - restored_at)
                else:
                    await asyncio.sleep(0.1)
            jobs = await client.get("/v1/jobs")
        alive = api.process is not None and api.process.alive() and api.process.pid == pid
        stopped = await api.stop(20)
    finally:
        api.kill()
        await proxy.close()

    outcomes = Counter(
        f"{name} {reply.status_code}" if isinstance(reply, httpx.Response) else f"{name} {type(reply).__name__}"
        for name, reply, _ in during
    )
    slowest = max(elapsed for *_, elapsed in during)
    reasons = sorted({reply.json().get("reason", "") for _, reply, _ in during
                      if isinstance(reply, httpx.Response) and reply.headers.get("content-type") == "application/json"})
    print(f"\nduring a {OUTAGE_S} s outage: {dict(outcomes)}, slowest answer {slowest:.2f} s, reasons {reasons}; "
          f"recovered after {', '.join(f'{k} {v:.2f} s' for k, v in sorted(recovered.items()))}")
    assert alive, "the API process must survive the outage (same pid, still running)"
    log = api.process.tail() if api.process else ""
    assert stopped is not None, f"the API did not stop within 20 s of SIGTERM after the outage:\n{log}"
    assert len(during) >= 10
    for name, reply, elapsed in during:
        assert isinstance(reply, httpx.Response), f"{name} during the outage: no answer ({reply!r})"
        assert reply.status_code == 503, f"{name} during the outage: {reply.status_code} {reply.text}"
        assert reply.json()["reason"] and "database" in reply.json()["reason"], reply.text
        assert reply.headers.get("Retry-After"), f"{name}: a 503 says when to retry"
        assert elapsed < PROMPT_S, f"{name} took {elapsed:.1f} s to answer during the outage"
    assert set(recovered) == {"health", "read", "write"}, f"not recovered within {RECOVERY_S} s: {recovered}"
    assert max(recovered.values()) < RECOVERY_S
    assert jobs.status_code == 200 and {"job-2"} <= {j["id"] for j in jobs.json()}, "data written before is there"
