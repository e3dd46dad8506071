"""Fast tier: at-least-once in, once per CloudEvent id out: duplicates, lost acks, restarts, per-handler progress."""

from __future__ import annotations

import sqlite3
import time
from datetime import timedelta
from pathlib import Path

import pytest

from harmonaize.events import CarbonIntensity, Failure
from tenant_controllers import Controller, Job, TemporaryError
from tenant_controllers.api_client import ProviderApi
from tenant_controllers.memory import Faults, MemoryBroker, MemoryEventSource
from tenant_controllers.sources import StreamPosition
from tenant_controllers.store import SCHEMA_VERSION, HandledStore, Status
from tests.controllers.support import T0, carbon, failure, running
from tests.support import eventually


async def test_the_same_cloudevent_published_under_two_message_ids_is_handled_once(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    handled: list[str] = []

    @ctl.on(Failure)
    async def on_failure(event: Failure, job: Job) -> None:
        handled.append(event.kind.value)

    event = failure()
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(event, msg_id="publish-1")
        bus.publish(event, msg_id="publish-2")  # the provider retried its publish with a new Nats-Msg-Id
        await eventually(lambda: runtime.stats.duplicates == 1, what="second copy recognised")
    assert bus.stored == 2 and handled == ["host_down"]
    assert bus.consumer_state(ctl.consumer) == (2, 0)


async def test_lost_acks_redeliver_but_never_rerun_a_handler(api: ProviderApi, store: HandledStore) -> None:
    bus = MemoryBroker(tenant="acme", ack_wait=0.1, faults=Faults(lose_ack=0.5, seed=3))
    ctl = Controller(job="llm-finetune")
    handled: list[str] = []

    @ctl.on(CarbonIntensity)
    async def on_carbon(event: CarbonIntensity) -> None:
        handled.append(str(event.g_per_kwh))

    events = [carbon(100 + n, at=T0 + timedelta(minutes=n)) for n in range(20)]
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        for event in events:
            bus.publish(event)
        await eventually(lambda: bus.consumer_state(ctl.consumer) == (20, 0), what="every event finally acked")
    assert sorted(handled) == sorted(str(float(100 + n)) for n in range(20))
    assert runtime.stats.duplicates > 0, "some acks were lost, so some events came back"


async def test_a_restarted_controller_skips_what_it_handled_but_could_not_ack(tmp_path: Path, api: ProviderApi) -> None:
    """Killed after the handler's outcome was committed, before the ack reached the broker."""
    bus = MemoryBroker(tenant="acme", ack_wait=0.1, faults=Faults(lose_ack=1.0))
    path = tmp_path / "handled.sqlite3"
    calls: list[int] = []

    def build() -> Controller:
        ctl = Controller(job="llm-finetune", name="guard")

        @ctl.on(Failure)
        async def on_failure(event: Failure) -> str:
            calls.append(1)
            return "replaced"

        return ctl

    with HandledStore(path) as store:
        async with running(build(), source=MemoryEventSource(bus), api=api, store=store) as first:
            bus.publish(failure())
            await eventually(lambda: first.stats.handled == 1, what="handled once")
    bus.faults = Faults()
    with HandledStore(path) as store:  # a new process: only the file survives
        async with running(build(), source=MemoryEventSource(bus), api=api, store=store) as second:
            await eventually(lambda: second.stats.duplicates >= 1, what="redelivery skipped")
        assert [r.outcome for r in store.records()] == ["replaced"]
    assert calls == [1]
    assert bus.consumer_state("ctl-llm-finetune-guard") == (1, 0)


async def test_progress_is_per_handler_a_restart_reruns_only_the_unfinished_one(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    calls: list[str] = []
    fail_second = True

    ctl = Controller(job="llm-finetune")

    @ctl.on(Failure, id="first")
    async def first(event: Failure) -> None:
        calls.append("first")

    @ctl.on(Failure, id="second", retries=20)
    async def second(event: Failure) -> None:
        calls.append("second")
        if fail_second:
            raise TemporaryError("provider busy", delay=30)

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store):
        bus.publish(failure())
        await eventually(lambda: calls == ["first", "second"], what="first done, second waiting")
    fail_second = False
    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as again:
        await eventually(lambda: again.stats.handled == 1, what="second finished in the next run")
    assert calls == ["first", "second", "second"]
    assert {r.handler: r.status for r in store.records()} == {"first": Status.DONE, "second": Status.DONE}


async def test_latest_only_handlers_skip_events_older_than_one_already_seen(
    bus: MemoryBroker, api: ProviderApi, store: HandledStore
) -> None:
    ctl = Controller(job="llm-finetune")
    levels: list[float] = []
    facts: list[float] = []

    @ctl.on(CarbonIntensity, latest_only=True)
    async def level(event: CarbonIntensity, job: Job) -> None:
        levels.append(event.g_per_kwh)
        assert job.latest(CarbonIntensity) == event

    @ctl.on(CarbonIntensity, id="every")
    async def every(event: CarbonIntensity) -> None:
        facts.append(event.g_per_kwh)

    async with running(ctl, source=MemoryEventSource(bus), api=api, store=store) as runtime:
        bus.publish(carbon(300, at=T0 + timedelta(minutes=10)))
        await eventually(lambda: levels == [300], what="newest handled")
        bus.publish(carbon(100, at=T0))  # older, arriving late
        bus.publish(carbon(250, at=T0 + timedelta(minutes=20)))
        await eventually(lambda: len(facts) == 3, what="all three seen by the plain handler")
    assert levels == [300, 250] and runtime.stats.stale == 1


async def test_latest_observations_survive_a_restart(bus: MemoryBroker, api: ProviderApi, tmp_path: Path) -> None:
    path = tmp_path / "handled.sqlite3"
    seen: list[float | None] = []

    def build() -> Controller:
        ctl = Controller(job="llm-finetune", name="c")

        @ctl.on(CarbonIntensity)
        async def on_carbon(event: CarbonIntensity) -> None: ...

        @ctl.on_resync
        async def resync(job: Job) -> None:
            latest = job.latest(CarbonIntensity)
            seen.append(latest.g_per_kwh if latest else None)

        return ctl

    with HandledStore(path) as store:
        async with running(build(), source=MemoryEventSource(bus), api=api, store=store, resync_interval=0.05) as rt:
            bus.publish(carbon(123, at=T0))
            await eventually(lambda: rt.stats.handled == 1 and bool(seen) and seen[-1] == 123, what="observed")
    seen.clear()
    with HandledStore(path) as store:
        async with running(build(), source=MemoryEventSource(bus), api=api, store=store, resync_interval=60) as rt:
            await eventually(lambda: rt.stats.resyncs == 1, what="first resync of the new run")
    assert seen == [123]


def _written_latest(path: Path) -> list[str]:
    """What another reader of the file (a restarted controller) would find as newest observations."""
    db = sqlite3.connect(path)
    try:
        return [row[0] for row in db.execute("SELECT event_id FROM latest ORDER BY event_id")]
    finally:
        db.close()


def test_an_observation_is_committed_with_its_handlers_record_and_kept_if_that_commit_fails(tmp_path: Path) -> None:
    """One commit per event: the newest observation waits for the record (the event is not acked before it), and a
    record that fails to commit takes nothing with it: the observation goes out with the next commit."""
    path = tmp_path / "handled.sqlite3"
    first, second = carbon(100, at=T0), carbon(200, at=T0 + timedelta(minutes=1))
    with HandledStore(path) as store:
        db = sqlite3.connect(path)  # a real failing commit: the file itself rejects the handler name 'refused'
        db.execute("CREATE TRIGGER refuse BEFORE INSERT ON handled WHEN NEW.handler = 'refused' "
                   "BEGIN SELECT RAISE(ABORT, 'refused by test'); END")
        db.commit()
        db.close()
        assert store.observe("c", "llm-finetune", first.type, time_=first.time, event_id=first.id, event="one")
        assert _written_latest(path) == [], "observed, not yet written"
        assert store.latest("c") == {("llm-finetune", first.type): "one"}, "but this process already knows it"
        store.record("c", first.id, "h", status=Status.DONE)
        assert _written_latest(path) == [first.id]

        assert store.observe("c", "llm-finetune", second.type, time_=second.time, event_id=second.id, event="two")
        with pytest.raises(sqlite3.IntegrityError, match="refused by test"):
            store.record("c", second.id, "refused", status=Status.DONE)
        assert _written_latest(path) == [first.id], "the failed commit wrote nothing"
        assert store.finished_handlers("c", second.id) == set()
        store.record("c", second.id, "h", status=Status.DONE)
        assert _written_latest(path) == [second.id], "the observation went out with the next commit"


async def test_an_event_no_handler_records_has_its_observation_written_before_the_ack(
    bus: MemoryBroker, api: ProviderApi, tmp_path: Path
) -> None:
    path = tmp_path / "handled.sqlite3"
    ctl = Controller(job="llm-finetune", name="c")

    @ctl.on(CarbonIntensity, when=lambda event: event.g_per_kwh > 500)
    async def on_dirty_power(event: CarbonIntensity) -> None: ...

    clean = carbon(123, at=T0)
    with HandledStore(path) as store:
        async with running(ctl, source=MemoryEventSource(bus), api=api, store=store):
            bus.publish(clean)
            await eventually(lambda: bus.consumer_state(ctl.consumer) == (1, 0), what="the event acked")
            assert _written_latest(path) == [clean.id], "written before the ack, not at close"
            assert store.records() == [], "no handler ran"


def test_store_retention_is_bounded_by_age_and_count(tmp_path: Path) -> None:
    with HandledStore(tmp_path / "s.sqlite3", retention=timedelta(hours=1), max_entries=5) as store:
        for n in range(8):
            store.record("c", f"e{n}", "h", status=Status.DONE, outcome=n)
        assert store.prune() == 3
        assert [r.event_id for r in store.records()] == ["e3", "e4", "e5", "e6", "e7"]
        assert store.prune(now=time.time() + 2 * 3600) == 5
        assert store.records() == []


_LAYOUT_0 = """
CREATE TABLE handled (controller TEXT NOT NULL, event_id TEXT NOT NULL, handler TEXT NOT NULL, status TEXT NOT NULL,
                      outcome TEXT, at REAL NOT NULL, PRIMARY KEY (controller, event_id, handler));
CREATE INDEX handled_at ON handled (at);
CREATE TABLE latest (controller TEXT NOT NULL, job TEXT NOT NULL, type TEXT NOT NULL, time TEXT NOT NULL,
                     event_id TEXT NOT NULL, event TEXT NOT NULL, PRIMARY KEY (controller, job, type));
"""


def test_a_state_file_of_the_first_layout_is_migrated_with_everything_it_remembered(tmp_path: Path) -> None:
    """A controller upgraded in place must still know which events it handled (or it would run them again)."""
    import sqlite3

    path = tmp_path / "old.sqlite3"
    newest = carbon(321, at=T0)
    db = sqlite3.connect(path)
    db.executescript(_LAYOUT_0)
    db.execute("INSERT INTO handled VALUES ('c', 'e1', 'h', 'done', '7', 1.0)")
    db.execute("INSERT INTO latest VALUES ('c', 'llm-finetune', ?, ?, ?, ?)",
               (newest.type, newest.time.isoformat(), newest.id, newest.to_json_bytes().decode()))
    db.commit()
    db.close()
    with HandledStore(path, retention=timedelta(days=365 * 100)) as store:
        assert store.finished_handlers("c", "e1") == {"h"}
        assert [(r.event_id, r.outcome) for r in store.records("c")] == [("e1", 7)]
        assert list(store.latest("c")) == [("llm-finetune", newest.type)]
        older = carbon(100, at=T0 - timedelta(minutes=1))
        assert not store.observe("c", "llm-finetune", older.type, time_=older.time, event_id=older.id, event="{}"), (
            "the newest observation came through the migration"
        )
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    assert db.execute("SELECT name FROM sqlite_master WHERE name LIKE '%_v0' OR name = 'handled_at'").fetchall() == []
    db.close()


def test_a_consumers_position_only_rises_within_its_stream_and_survives_a_reopen(tmp_path: Path) -> None:
    """Where a consumer the broker lost starts again: a late, lower reading (an older heartbeat's) must not move it
    back, but a position in a re-created stream (another `stream_created`) replaces the old one outright."""
    path = tmp_path / "positions.sqlite3"
    with HandledStore(path) as store:
        assert store.position("c", "ctl-job-c") is None
        store.save_position("c", "ctl-job-c", StreamPosition(40, "2026-12-01T00:00:00+00:00"))
        store.save_position("c", "ctl-job-c", StreamPosition(12, "2026-12-01T00:00:00+00:00"))
        store.save_position("c", "other", StreamPosition(7, "2026-12-01T00:00:00+00:00"))
        assert store.position("c", "ctl-job-c") == StreamPosition(40, "2026-12-01T00:00:00+00:00")
    with HandledStore(path) as store:
        assert store.position("c", "ctl-job-c") == StreamPosition(40, "2026-12-01T00:00:00+00:00")
        store.save_position("c", "ctl-job-c", StreamPosition(12, "2026-12-01T00:00:00+00:00"))
        assert store.position("c", "ctl-job-c") == StreamPosition(40, "2026-12-01T00:00:00+00:00"), (
            "the file, not only this process, keeps the highest"
        )
        store.save_position("c", "ctl-job-c", StreamPosition(3, "2026-12-05T00:00:00+00:00"))
        assert store.position("c", "ctl-job-c") == StreamPosition(3, "2026-12-05T00:00:00+00:00")
        assert store.position("c", "other") == StreamPosition(7, "2026-12-01T00:00:00+00:00")
        with pytest.raises(ValueError, match="0 or more"):
            store.save_position("c", "ctl-job-c", StreamPosition(-1, "2026-12-05T00:00:00+00:00"))
    # A file of layout 1 (no positions table) gets one when opened.
    old = tmp_path / "layout1.sqlite3"
    db = sqlite3.connect(old)
    db.executescript("""
        CREATE TABLE handled (controller TEXT NOT NULL, event_id TEXT NOT NULL, handler TEXT NOT NULL,
            status TEXT NOT NULL, outcome TEXT, at REAL NOT NULL, PRIMARY KEY (controller, event_id, handler))
            WITHOUT ROWID;
        CREATE TABLE latest (controller TEXT NOT NULL, job TEXT NOT NULL, type TEXT NOT NULL, time TEXT NOT NULL,
            event_id TEXT NOT NULL, event TEXT NOT NULL, PRIMARY KEY (controller, job, type)) WITHOUT ROWID;
        INSERT INTO handled VALUES ('c', 'e1', 'h', 'done', '7', 1.0);
        PRAGMA user_version = 1;
    """)
    db.close()
    with HandledStore(old, retention=timedelta(days=365 * 100)) as store:
        assert store.finished_handlers("c", "e1") == {"h"}
        store.save_position("c", "ctl", StreamPosition(5, "s"))
        assert store.position("c", "ctl") == StreamPosition(5, "s")
    db = sqlite3.connect(old)
    assert db.execute("PRAGMA user_version").fetchone() == (SCHEMA_VERSION,)
    db.close()


def test_a_state_file_from_a_newer_version_is_refused_not_rewritten(tmp_path: Path) -> None:
    import sqlite3

    import pytest

    from tenant_controllers.store import StoreVersionError

    path = tmp_path / "future.sqlite3"
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(StoreVersionError, match="newer version"):
        HandledStore(path)
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone() == (99,)
    db.close()


def test_housekeeping_runs_beside_the_writer_and_keeps_the_file_bounded(tmp_path: Path) -> None:
    """The writer does not checkpoint or prune itself (each would stall the event loop for milliseconds); the
    maintenance thread must then do both, or the WAL and the table grow (up to the writer's safety net)."""
    import sqlite3

    path = tmp_path / "busy.sqlite3"
    wal = path.parent / (path.name + "-wal")
    one_burst = 0
    with HandledStore(path, max_entries=1000, maintenance_interval=0.02, checkpoint_max_age=0.1) as store:
        from tenant_controllers.store import CHECKPOINT_EVERY_COMMITS, SAFETY_CHECKPOINT_PAGES

        # The writer's own checkpoint is only a safety net, far beyond what this test writes (~28 MB unchecked).
        assert store._db.execute("PRAGMA wal_autocheckpoint").fetchone() == (SAFETY_CHECKPOINT_PAGES,)
        assert 500 > CHECKPOINT_EVERY_COMMITS, "each burst must make a checkpoint due"
        for burst in range(12):
            seen = store.checkpoints
            for n in range(500):
                store.record("c", f"e{burst}-{n}", "h", status=Status.DONE, outcome=n)
            # A checkpoint beside a writer that never pauses cannot fold the whole WAL in (the writer keeps appending),
            # so the WAL restarts only after one that ran once the burst was over: wait for it (due by the age bound).
            deadline = time.monotonic() + 5
            while store.uncheckpointed_commits and time.monotonic() < deadline:
                time.sleep(0.005)
            assert store.uncheckpointed_commits == 0, "the maintenance thread stopped checkpointing"
            assert store.checkpoints >= seen + 1
            one_burst = one_burst or wal.stat().st_size  # the first burst wrote into an empty WAL
        # Unchecked, 12 bursts fill the WAL until the pruner's connection checkpoints it (~4 bursts here); folded in
        # after each burst, it restarts and only ever holds about one.
        assert wal.stat().st_size <= 2 * one_burst
    db = sqlite3.connect(path)
    (count,) = db.execute("SELECT COUNT(*) FROM handled").fetchone()
    db.close()
    assert count <= 1000 + 1000, "pruned in the background to max_entries (plus at most PRUNE_EVERY new ones)"


def test_checkpoints_follow_what_was_written_not_the_clock(tmp_path: Path) -> None:
    """Each checkpoint costs two fsyncs whatever it copies: a store that writes a little waits for enough commits or
    for the age bound, and one that writes nothing never checkpoints."""
    path = tmp_path / "slow.sqlite3"
    with HandledStore(path, maintenance_interval=0.01, checkpoint_every=50, checkpoint_max_age=3600) as store:
        for n in range(49):
            store.record("c", f"e{n}", "h", status=Status.DONE)
        deadline = time.monotonic() + 0.3  # thirty looks of the maintenance thread, none of which may checkpoint
        while time.monotonic() < deadline:
            assert store.checkpoints == 0, "checkpointed before checkpoint_every commits"
            time.sleep(0.01)
        store.record("c", "e49", "h", status=Status.DONE)  # the 50th commit makes it due
        deadline = time.monotonic() + 5
        while store.checkpoints == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.checkpoints == 1
        quiet_until = time.monotonic() + 0.3  # nothing written since: no more checkpoints
        while time.monotonic() < quiet_until:
            assert store.checkpoints == 1, "checkpointed a WAL with nothing new in it"
            time.sleep(0.01)

    with HandledStore(path, maintenance_interval=0.01, checkpoint_every=10_000, checkpoint_max_age=0.2) as store:
        store.record("c", "late", "h", status=Status.DONE)  # one commit: due once the age bound has passed
        deadline = time.monotonic() + 5
        while store.checkpoints == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert store.checkpoints == 1, "a commit was never checkpointed"


@pytest.mark.parametrize(("every", "max_age"), [(0, 30.0), (10, 0.0)])
def test_checkpoint_policy_out_of_range_is_refused(tmp_path: Path, every: int, max_age: float) -> None:
    with pytest.raises(ValueError, match="checkpoint_every"):
        HandledStore(tmp_path / "x.sqlite3", checkpoint_every=every, checkpoint_max_age=max_age)
