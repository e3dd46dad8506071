"""Three API replicas behind one address on one PostgreSQL database (`harmonaize api serve --replicas 3`), with a
real nats-server: what one process guaranteed holds across them, and a replica killed mid-request loses nothing.

* Connections spread: a burst of keep-alive connections reaches every replica (each listens on a socket of its own,
  so the kernel spreads them; one shared socket gave almost all of them to one replica).
* Idempotency: the same request with the same Idempotency-Key, sent at once over many connections (the kernel
  spreads them among the replicas), opens one negotiation and every caller gets its response.
* The capacity ledger: concurrent accepts over many connections never place more workers than the hosts have.
* The outbox: every row is delivered, and every tenant event is stored in the tenant's stream exactly once.
* The negotiation pace: a tenant's burst is one bucket for all replicas, not one per replica.
* A replica SIGKILLed under load: each client retries with its key; every request ends with its answer, each key's
  negotiation exists once, and the supervisor starts a new replica.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import text
from sqlalchemy.engine import URL

from api.db import make_engine
from broker_config.provisioner import NatsTenantBroker
from broker_config.server import NatsServer
from tests.faults.support import ADMIN_TOKEN, ApiService, duplicates, stored_event_ids
from tests.support import eventually

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(300)]

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
REPLICAS = 3
HOSTS, GPUS = 4, 4
BURST = 40


def established_on(pid: int, port: int) -> int:
    """Connections process `pid` holds, established on its local TCP `port` (Linux /proc: its socket inodes, then
    the kernel's TCP tables seen from its network namespace)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    held = 0
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local_port, state, inode = int(fields[1].rsplit(":", 1)[1], 16), fields[3], fields[9]
            held += local_port == port and state == "01" and inode in inodes  # 01: ESTABLISHED
    return held


def children(pid: int) -> set[int]:
    """The supervisor's replica processes."""
    try:
        return {int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


async def query(url: str, sql: str) -> Any:
    engine = make_engine(url, single_use=True)
    try:
        async with engine.connect() as db:
            return (await db.execute(text(sql))).scalar_one()
    finally:
        await engine.dispose()


async def world(api: ApiService, jobs: int) -> dict[str, str]:
    """Tenant acme, 4 hosts of 4 GPUs, `jobs` jobs of 1 worker each; the tenant's auth header."""
    async with httpx.AsyncClient(base_url=api.url, headers=ADMIN, timeout=30) as admin:
        acme = await admin.post("/v1/tenants", json={"id": "acme", "display_name": "Acme"})
        assert acme.status_code == 201, acme.text
        for i in range(1, HOSTS + 1):
            host = await admin.post("/v1/hosts", json={"id": f"h{i}", "gpus": GPUS, "locality_group": "g1"})
            assert host.status_code == 201, host.text
    tenant = {"Authorization": f"Bearer {acme.json()['api_token']}"}
    async with httpx.AsyncClient(base_url=api.url, headers=tenant, timeout=30) as client:
        for j in range(jobs):
            job = await client.post("/v1/jobs", json={"id": f"j{j}", "min_workers": 1, "max_workers": 8,
                                                      "initial_workers": 1})
            assert job.status_code == 201, job.text
    return tenant


async def post_until_answered(api: ApiService, tenant: dict[str, str], path: str, body: dict[str, Any],
                              key: str | None = None, *, timeout: float = 90.0) -> tuple[httpx.Response, int]:
    """POST on a connection of its own, retried (same key) whenever the connection breaks; the answer and how many
    tries broke."""
    headers = {**tenant, **({"Idempotency-Key": key} if key else {})}
    broken = 0
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            async with httpx.AsyncClient(base_url=api.url, headers=headers, timeout=30) as client:
                return await client.post(path, json=body), broken
        except httpx.TransportError:
            broken += 1
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)  # the next try may reach a replica still starting


def scale(job: str, workers: int) -> dict[str, Any]:
    return {"job": job, "kind": "scale", "terms": {"desired_workers": workers, "accept_workers": {"min": workers,
                                                                                                  "max": workers}}}


@pytest.fixture
async def replicas(request: pytest.FixtureRequest, tmp_path: Path, nats_server: NatsServer, provider_secret: bytes,
                   postgres_url: URL) -> Any:
    """`harmonaize api serve --replicas 3`; an indirect parameter sets the tenant's burst (refill 0.01/s)."""
    burst = getattr(request, "param", 1000)
    url = postgres_url.render_as_string(hide_password=False)
    api = ApiService(tmp_path / "api", nats_server, provider_secret, database_url=url, replicas=REPLICAS,
                     extra_env={"HZ_NEGOTIATION_BURST": str(burst), "HZ_NEGOTIATION_RATE_PER_S": "0.01"})
    try:
        await api.start()
        assert api.process is not None
        supervisor = api.process.pid
        await eventually(lambda: len(children(supervisor)) == REPLICAS, timeout=30, what="3 replicas running")
        yield api, url
    finally:
        await api.stop()


async def test_a_burst_of_keep_alive_connections_reaches_every_replica(replicas: tuple[ApiService, str]) -> None:
    api, _ = replicas
    assert api.process is not None
    connections = 30  # by chance alone, one replica left without any: 3 * (2/3)**30, about 2e-5
    clients = [httpx.AsyncClient(base_url=api.url, timeout=30) for _ in range(connections)]
    try:
        answers = await asyncio.gather(*(client.get("/v1/healthz") for client in clients))
        assert {answer.status_code for answer in answers} == {200}
        held = {pid: established_on(pid, api.port) for pid in children(api.process.pid)}
        assert sum(held.values()) == connections, f"every kept-alive connection held by a replica: {held}"
        assert min(held.values()) >= 1, f"every replica got some of the burst's connections: {held}"
        assert max(held.values()) <= 2 * connections // 3, f"no replica got nearly all of them: {held}"
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))


@pytest.mark.parametrize("replicas", [BURST], indirect=True)
async def test_three_replicas_keep_idempotency_the_ledger_the_outbox_and_the_pace(
    replicas: tuple[ApiService, str], tenant_broker: NatsTenantBroker
) -> None:
    api, url = replicas
    tenant = await world(api, jobs=8)  # 8 of 16 GPUs in use

    same = await asyncio.gather(*(post_until_answered(api, tenant, "/v1/negotiations", scale("j0", 2), "same-key")
                                  for _ in range(12)))
    assert {r.status_code for r, _ in same} == {201}, [r.text for r, _ in same]
    assert len({r.json()["id"] for r, _ in same}) == 1, "one negotiation for one key, whichever replica answered"
    assert await query(url, "SELECT COUNT(*) FROM negotiations WHERE job_id = 'j0'") == 1

    # every job asks for 3 workers (+2 GPUs each, 16 wanted, 8 free): concurrent accepts on many connections
    opened = await asyncio.gather(*(post_until_answered(api, tenant, "/v1/negotiations", scale(f"j{j}", 3),
                                                        f"grow-{j}") for j in range(1, 8)))
    offers = [r.json() for r, _ in opened if r.status_code == 201 and r.json()["state"] == "offered"]
    accepted = await asyncio.gather(*(post_until_answered(api, tenant, f"/v1/negotiations/{o['id']}/accept",
                                                          {"option": 0}) for o in offers))
    assert {r.status_code for r, _ in accepted} <= {200, 409}, [r.text for r, _ in accepted]
    placed = await query(url, "SELECT COALESCE(SUM(gpus), 0) FROM allocations WHERE released_at IS NULL")
    assert placed <= HOSTS * GPUS, f"{placed} GPUs placed on {HOSTS * GPUS}"
    per_host = await query(url, "SELECT MAX(allocated_gpus) FROM hosts")
    assert per_host <= GPUS
    wins = sum(1 for r, _ in accepted if r.status_code == 200)
    assert placed == 8 + 2 * wins, "each accepted growth placed exactly its 2 workers"

    # the pace: BURST writes in all, whichever replica each lands on (the refill is negligible here)
    spent = len(same) + len(opened) + len(accepted)
    rest = await asyncio.gather(*(post_until_answered(api, tenant, "/v1/negotiations", scale("j0", 2), f"pace-{i}")
                                  for i in range(BURST)))
    codes = Counter(r.status_code for r, _ in rest)
    assert codes[429] >= spent - 2, f"the tenant's one bucket ran out across replicas: {codes} after {spent} writes"

    await eventually(lambda: _all_delivered(url), timeout=30, what="every outbox row delivered")
    events = await query(url, "SELECT COUNT(*) FROM outbox WHERE topic = 'tenant_event'")
    provider = await tenant_broker.provider_connection()
    try:
        stored = await stored_event_ids(provider, "HZ_T_acme")
    finally:
        await provider.close()
    assert not duplicates(stored), f"tenant events stored twice: {duplicates(stored)}"
    assert sum(stored.values()) == events, "every tenant event in the outbox is in the stream"


async def test_a_replica_killed_under_load_loses_no_request(replicas: tuple[ApiService, str]) -> None:
    api, url = replicas
    assert api.process is not None
    tenant = await world(api, jobs=4)
    before = children(api.process.pid)
    requests = 120

    async def load() -> list[tuple[httpx.Response, int]]:
        return await asyncio.gather(*(post_until_answered(api, tenant, "/v1/negotiations", scale(f"j{i % 4}", 2),
                                                          f"load-{i}") for i in range(requests)))

    running = asyncio.create_task(load())

    async def under_way() -> bool:
        return await _count(url, "negotiations") >= 10

    await eventually(under_way, timeout=30, what="the load under way")
    victim = min(before)
    os.kill(victim, signal.SIGKILL)
    answers = await running
    assert {r.status_code for r, _ in answers} == {201}, Counter(r.status_code for r, _ in answers)
    assert len({r.json()["id"] for r, _ in answers}) == requests, "one negotiation per key"
    assert await _count(url, "negotiations") == requests, "no key opened twice, none lost"
    supervisor = api.process.pid
    await eventually(lambda: len(children(supervisor)) == REPLICAS and victim not in children(supervisor),
                     timeout=30, what="the supervisor replacing the killed replica")
    await eventually(lambda: _all_delivered(url), timeout=30, what="every outbox row delivered")


async def _all_delivered(url: str) -> bool:
    return await query(url, "SELECT COUNT(*) FROM outbox WHERE delivered_at IS NULL") == 0


async def _count(url: str, table: str) -> int:
    return int(await query(url, f"SELECT COUNT(*) FROM {table}"))
