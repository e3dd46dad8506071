"""Fast tier: the runtime's group commit. Events finished together share one commit, none is acked before the commit
that holds its record, and a commit that fails hands every waiting event back, to be handled again."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path

from harmonaize.events import CarbonIntensity
from tenant_controllers import Controller
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import MemoryBroker, MemoryEventSource
from tenant_controllers.sources import Delivery, Subscription
from tenant_controllers.store import HandledStore
from tests.controllers.support import T0, carbon, running
from tests.support import eventually


class _AckChecked:
    """A delivery whose ack first looks, over a connection of its own, for the event's record in the store's file."""

    def __init__(self, inner: Delivery, path: Path, acks: list[tuple[str, bool]]) -> None:
        self._inner, self._path, self._acks = inner, path, acks

    @property
    def data(self) -> bytes:
        return self._inner.data

    @property
    def subject(self) -> str:
        return self._inner.subject

    @property
    def num_delivered(self) -> int:
        return self._inner.num_delivered

    async def ack(self) -> None:
        event_id = json.loads(self._inner.data)["id"]
        db = sqlite3.connect(self._path)
        try:
            (count,) = db.execute("SELECT COUNT(*) FROM handled WHERE event_id = ?", (event_id,)).fetchone()
        finally:
            db.close()
        self._acks.append((event_id, count > 0))
        await self._inner.ack()

    async def nak(self, delay: float | None = None) -> None:
        await self._inner.nak(delay)

    async def in_progress(self) -> None:
        await self._inner.in_progress()

    async def term(self) -> None:
        await self._inner.term()


class _AckCheckedSource:
    def __init__(self, bus: MemoryBroker, path: Path) -> None:
        self._inner = MemoryEventSource(bus)
        self._path = path
        self.acks: list[tuple[str, bool]] = []
        """(event id, whether its record was in the file) per ack, in order."""

    @property
    def ack_wait(self) -> float | None:
        return self._inner.ack_wait

    async def open(self, subscription: Subscription) -> None:
        await self._inner.open(subscription)

    async def fetch(self, *, batch: int, timeout: float) -> Sequence[Delivery]:
        deliveries = await self._inner.fetch(batch=batch, timeout=timeout)
        return [_AckChecked(delivery, self._path, self.acks) for delivery in deliveries]

    async def close(self) -> None:
        await self._inner.close()


async def test_events_finished_together_share_one_commit_and_each_ack_follows_its_record(
    api: ProviderApi, tmp_path: Path
) -> None:
    path = tmp_path / "handled.sqlite3"
    bus = MemoryBroker(tenant="acme", ack_wait=30.0)  # no redelivery however slow the machine: one ack per event
    ctl = Controller(job="llm-finetune", name="c")

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> float:
        return event.g_per_kwh

    events = [carbon(100 + n, at=T0 + timedelta(seconds=n)) for n in range(48)]
    for event in events:  # all stored before the controller starts: it fetches them 16 at a time
        bus.publish(event)
    source = _AckCheckedSource(bus, path)
    with HandledStore(path) as store:
        async with running(ctl, source=source, api=api, store=store, batch=16):
            await eventually(lambda: bus.consumer_state(ctl.consumer) == (48, 0), what="every event acked")
        assert source.acks == [(event.id, True) for event in events], "one ack per event, each after its record"
        assert [r.outcome for r in store.records("c")] == [100.0 + n for n in range(48)]
        assert store.commits <= 48 // 4, f"{store.commits} commits for 48 events fetched 16 at a time"


async def test_a_failed_group_commit_hands_every_waiting_event_back_to_be_handled_again(
    api: ProviderApi, tmp_path: Path
) -> None:
    path = tmp_path / "handled.sqlite3"
    bus = MemoryBroker(tenant="acme", ack_wait=30.0)  # only the hand-back's delay brings an event back this soon
    ctl = Controller(job="llm-finetune", name="c")
    runs: Counter[str] = Counter()

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        runs[str(event.g_per_kwh)] += 1

    with HandledStore(path) as store:
        db = sqlite3.connect(path)  # a real failing commit while the table 'refusing' has a row
        db.executescript("CREATE TABLE refusing (x); INSERT INTO refusing VALUES (1);"
                         "CREATE TRIGGER refuse BEFORE INSERT ON handled WHEN EXISTS (SELECT 1 FROM refusing) "
                         "BEGIN SELECT RAISE(ABORT, 'refused by test'); END;")
        try:
            async with running(ctl, source=MemoryEventSource(bus), api=api, store=store):
                published = [carbon(100 + n, at=T0 + timedelta(minutes=n)) for n in range(5)]
                for event in published:
                    bus.publish(event)
                await eventually(lambda: len(runs) == 5 and min(runs.values()) >= 2, timeout=15,
                                 what="every event handed back and handled again")
                assert bus.consumer_state(ctl.consumer)[0] == 0, "nothing acked while its record cannot be written"
                assert store.records() == []
                db.execute("DELETE FROM refusing")
                db.commit()
                await eventually(lambda: bus.consumer_state(ctl.consumer) == (5, 0), timeout=15,
                                 what="every event acked once its record is written")
            assert sorted(r.event_id for r in store.records()) == sorted(event.id for event in published)
        finally:
            db.close()
