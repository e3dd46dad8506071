"""Outbox relays of several API replicas on one PostgreSQL database: one delivers, each row once, in order; when it
stops, or its database session is cut, another takes over and nothing is left behind.

Each relay has its own engine (its own connections), as a replica process would, and all publish into one recording
bus. The rows are what any API transaction commits into the outbox.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, select, text

from api.db import make_engine, make_sessionmaker
from api.models import OutboxMessage, OutboxTopic
from api.services.outbox_relay import OutboxRelay
from api.services.relay_leadership import RelayLeadership
from harmonaize.settings import Settings
from tests.api.api_memory_bus import MemoryProviderBus
from tests.support import eventually

REPLICAS = 3


@pytest.fixture
def backend() -> str:
    return "postgres"


pytestmark = pytest.mark.postgres


class _Replica:
    def __init__(self, settings: Settings, bus: MemoryProviderBus, *, poll_interval: float = 0.05) -> None:
        self.engine = make_engine(settings.resolved_database_url)
        self.leadership = RelayLeadership(self.engine)
        self.relay = OutboxRelay(make_sessionmaker(self.engine), bus, poll_interval=poll_interval,
                                 leadership=self.leadership)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.create_task(self.relay.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def lock_backend_pid(self) -> int | None:
        """The server process of this replica's lock session, if it holds one."""
        connection = self.leadership._connection  # the session a crash or a cut network would end
        if connection is None:
            return None
        pid: int | None = await connection.scalar(text("SELECT pg_backend_pid()"))
        return pid


@pytest.fixture
async def replicas(migrated_settings: Settings) -> AsyncIterator[tuple[list[_Replica], MemoryProviderBus]]:
    bus = MemoryProviderBus()
    started = [_Replica(migrated_settings, bus) for _ in range(REPLICAS)]
    try:
        yield started, bus
    finally:
        for replica in started:
            await replica.stop()
            await replica.engine.dispose()


async def _commit_rows(replica: _Replica, first: int, count: int) -> list[str]:
    """`count` tenant events committed to the outbox (as a request's transaction would); their message ids."""
    ids = [f"evt-{n:05d}" for n in range(first, first + count)]
    async with make_sessionmaker(replica.engine)() as session:
        session.add_all(OutboxMessage(topic=OutboxTopic.TENANT_EVENT, subject="hz.t.acme.events.test.j",
                                      payload=msg_id.encode(), msg_id=msg_id, created_at=datetime.now(UTC))
                        for msg_id in ids)
        await session.commit()
    return ids


async def _undelivered(replica: _Replica) -> int:
    async with make_sessionmaker(replica.engine)() as session:
        count = await session.scalar(select(func.count()).where(OutboxMessage.delivered_at.is_(None)))
        return int(count or 0)


async def _all_marked(replica: _Replica) -> bool:
    """Every row marked delivered (a relay marks a row just after its publish is confirmed)."""
    return await _undelivered(replica) == 0


async def _start_all(group: list[_Replica]) -> _Replica:
    """Start every replica's relay; the one that takes the lead."""
    for replica in group:
        replica.start()
    await eventually(lambda: len(_leaders(group)()) == 1, timeout=10, what="one replica leading the relay")
    (leader,) = _leaders(group)()
    return leader


def _published(bus: MemoryProviderBus, ids: list[str]) -> Callable[[], bool]:
    return lambda: {msg_id for _, _, msg_id in bus.events} >= set(ids)


def _leaders(replicas: list[_Replica]) -> Callable[[], list[_Replica]]:
    return lambda: [r for r in replicas if r.task is not None and r.leadership.leader]


async def test_one_replica_delivers_each_row_once_in_order(
    replicas: tuple[list[_Replica], MemoryProviderBus],
) -> None:
    group, bus = replicas
    await _start_all(group)
    ids = await _commit_rows(group[1], 0, 300)
    await eventually(lambda: len(bus.events) >= len(ids), timeout=30, what="every row published")
    await eventually(lambda: _all_marked(group[0]), timeout=10, what="every row marked delivered")
    assert [msg_id for _, _, msg_id in bus.events] == ids, "each row once, in commit order"
    assert bus.duplicates_dropped == 0, "no row was published twice"
    assert sorted(r.relay.delivered for r in group) == [0, 0, len(ids)], "one replica did all the delivering"


async def test_another_replica_takes_over_when_the_leader_stops(
    replicas: tuple[list[_Replica], MemoryProviderBus],
) -> None:
    group, bus = replicas
    leader = await _start_all(group)
    first = await _commit_rows(leader, 0, 50)
    await eventually(lambda: len(bus.events) >= len(first), timeout=30, what="the first rows published")
    await leader.stop()
    second = await _commit_rows(group[0], 50, 50)
    await eventually(lambda: len(_leaders(group)()) == 1, timeout=10, what="a surviving replica leading")
    await eventually(lambda: len(bus.events) >= len(first) + len(second), timeout=30, what="the rest published")
    assert [msg_id for _, _, msg_id in bus.events] == first + second
    await eventually(lambda: _all_marked(group[0]), timeout=10, what="every row marked delivered")


async def test_a_leader_cut_off_from_the_database_stands_down_and_nothing_is_lost(
    replicas: tuple[list[_Replica], MemoryProviderBus],
) -> None:
    group, bus = replicas
    leader = await _start_all(group)
    pid = await leader.lock_backend_pid()
    assert pid is not None
    rows = await _commit_rows(group[0], 0, 200)
    others = [r for r in group if r is not leader]
    # the server ends the leader's lock session, as a crash or a cut network would, with rows to deliver
    async with make_sessionmaker(others[0].engine)() as session:
        assert await session.scalar(text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    await eventually(lambda: any(r.leadership.leader for r in others), timeout=10,
                     what="another replica leading once the lock's session ended")
    await eventually(lambda: {m for _, _, m in bus.events} >= set(rows), timeout=30, what="every row published")
    await eventually(lambda: _all_marked(group[0]), timeout=10, what="every row marked delivered")
    assert [msg_id for _, _, msg_id in bus.events] == rows, "still each row once, in order (first publications)"
    assert not leader.leadership.leader, "the cut-off replica stood down"


async def test_rows_committed_by_another_replica_wake_the_leader_without_waiting_for_its_poll(
    migrated_settings: Settings,
) -> None:
    """The outbox's NOTIFY reaches the leader's lock session: with a poll of a minute, rows another replica commits
    (waking only its own, non-leading relay) still go out within seconds, and so do the next ones."""
    bus = MemoryProviderBus()
    group = [_Replica(migrated_settings, bus, poll_interval=60) for _ in range(2)]
    try:
        leader = await _start_all(group)
        (other,) = [r for r in group if r is not leader]
        await asyncio.sleep(0)  # the leader's first pass found nothing and waits for a wake-up or its poll
        for first in (0, 10):
            ids = await _commit_rows(other, first, 10)
            await eventually(_published(bus, ids), timeout=5,
                             what="rows of another replica published long before the leader's next poll")
        assert [msg_id for _, _, msg_id in bus.events] == [f"evt-{n:05d}" for n in range(20)]
        assert other.relay.delivered == 0
    finally:
        for replica in group:
            await replica.stop()
            await replica.engine.dispose()
