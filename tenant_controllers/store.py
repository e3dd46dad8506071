"""The controller's memory across restarts: which events each handler finished, and the newest observations.

JetStream delivers at least once: an event whose ack was lost (the controller was killed after handling it, or the
broker restarted) comes again, and a provider may publish the same CloudEvent twice under different `Nats-Msg-Id`s.
So the runtime records, per controller, CloudEvent id and handler, that the handler finished (its outcome, i.e. the
return value, or that it gave up), in the same transaction; the ack is sent only after that commit. A redelivered
event whose handlers are all recorded is acked and skipped. Recording per handler means a restart re-runs only the
handlers that had not finished.

What this cannot cover: a handler killed after its side effects but before the commit runs again after restart.
Side effects must therefore be idempotent; negotiation requests are (see `idempotency`).

SQLite in WAL mode with `synchronous=NORMAL`: a commit survives the process being killed (the case we handle); an OS
crash may lose the last commits, which only means some events are handled again. Retention is bounded by age (longer
than the broker keeps events, so nothing it can still redeliver is forgotten) and by row count.

Housekeeping stays off the event path. The runtime calls this store from its event loop, so anything slow here delays
every event queued behind it: SQLite's automatic WAL checkpoint (two fsyncs, run by whichever commit crosses its
threshold) and a prune that counts and deletes thousands of rows (bench/HISTORY.md, 'After the continuous pull,
background job reads and the store's second layout'). A maintenance thread with its own connection does both
instead: a PASSIVE checkpoint (it never blocks the writer), and pruning in small chunks, each its own short
transaction, so the loop's next write waits at most for one chunk. The thread looks every `maintenance_interval` but
checkpoints only once `checkpoint_every` commits have gone into the WAL since its last one (~2 MB), or when some have
and `checkpoint_max_age` has passed: each checkpoint costs two fsyncs whatever it copies, so one a second per
controller made 100 controllers at 10 events/s each fsync 200 times a second, on the disk the broker fsyncs every event
on (bench/HISTORY.md, 'Checkpoints by what was written').

The layout is chosen for the write per event, the store's main cost: both tables are `WITHOUT ROWID` (one B-tree each,
no separate primary-key index), `handled` has no index on `at` (only pruning reads it, in the background), and whether
an event is the newest of its type is decided from memory. A newest event is staged, and written with the next commit of
this store: the next `record` (its own handler's, usually; with several jobs' lanes running, possibly another event's)
or the `flush` the runtime calls before acking an event no handler recorded. So an event costs one primary-key read and
one commit, and none is acked before its observation is in the file. Deferring the write loses nothing: until the event
is acked the broker redelivers it, and observing it again decides the same. A commit that fails keeps what was staged
for the next one, so while the file cannot be written (a full disk), every event fails and is handed back rather than
any being acked unrecorded. Files written by the first layout (`user_version` 0) are migrated when opened; layout 2
added `positions` (a table created when a layout-1 file is opened).

Positions: per controller and consumer, the stream sequence at or below which the broker had every event acked (its
ack floor), which the runtime records every heartbeat. Every ack follows the commit of its event's records, so nothing
at or below it is unrecorded; a consumer the broker lost (kept in its memory, see `NatsEventSource`) is asked for again
from just after it. It only rises, within one incarnation of the stream (a re-created stream starts a new one).

Records can also be staged (`stage`) and written together (`commit`): the runtime commits once for every event
finished in one turn of its event loop and acks them after that commit (`tenant_controllers.group_commit`), instead of
one commit and one ack write per event. A commit that fails drops the staged records (their events are handed back and
handled again, as when `record` fails) but keeps the observations.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from pydantic_core import to_jsonable_python

from tenant_controllers.errors import ControllerError
from tenant_controllers.sources import StreamPosition

__all__ = ["HandledRecord", "HandledStore", "Status", "StoreVersionError"]

_log = logging.getLogger("tenant_controllers.store")

DEFAULT_RETENTION = timedelta(days=8)
"""The broker keeps a tenant's events 7 days (broker_config/streams.py); remember handled ids a day longer."""
DEFAULT_MAX_ENTRIES = 200_000
DEFAULT_MAINTENANCE_INTERVAL = 1.0
"""Seconds between the maintenance thread's looks at what was written (checkpoint and prune when due)."""
CHECKPOINT_EVERY_COMMITS = 200
"""Commits into the WAL that make a checkpoint due (a commit appends ~10 KB: the WAL stays near 2 MB)."""
CHECKPOINT_MAX_AGE = 30.0
"""Seconds after which any commit not yet checkpointed is, so a quiet store's WAL is folded in too."""
PRUNE_EVERY = 1000
"""Writes between prunes (in the maintenance thread, or inline without one)."""
PRUNE_CHUNK = 500
"""Rows deleted per transaction when pruning, so a concurrent write never waits long for the lock."""
SAFETY_CHECKPOINT_PAGES = 10_000
"""The writer's own automatic checkpoint, ~40 MB of WAL: never reached while the maintenance thread keeps up, and
a bound on the WAL if it ever stops."""

SCHEMA_VERSION = 2
_TABLES = """
CREATE TABLE IF NOT EXISTS handled (
    controller TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    handler    TEXT NOT NULL,
    status     TEXT NOT NULL,
    outcome    TEXT,
    at         REAL NOT NULL,
    PRIMARY KEY (controller, event_id, handler)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS latest (
    controller TEXT NOT NULL,
    job        TEXT NOT NULL,
    type       TEXT NOT NULL,
    time       TEXT NOT NULL,
    event_id   TEXT NOT NULL,
    event      TEXT NOT NULL,
    PRIMARY KEY (controller, job, type)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS positions (
    controller TEXT NOT NULL,
    consumer   TEXT NOT NULL,
    stream_seq INTEGER NOT NULL,
    stream_created TEXT NOT NULL,
    PRIMARY KEY (controller, consumer)
) WITHOUT ROWID;
"""
_FROM_VERSION_0 = """
BEGIN IMMEDIATE;
DROP INDEX IF EXISTS handled_at;
ALTER TABLE handled RENAME TO handled_v0;
ALTER TABLE latest RENAME TO latest_v0;
""" + _TABLES + f"""
INSERT INTO handled SELECT controller, event_id, handler, status, outcome, at FROM handled_v0;
INSERT INTO latest SELECT controller, job, type, time, event_id, event FROM latest_v0;
DROP TABLE handled_v0;
DROP TABLE latest_v0;
PRAGMA user_version = {SCHEMA_VERSION};
COMMIT;
"""


_RECORD = (
    "INSERT OR REPLACE INTO handled (controller, event_id, handler, status, outcome, at) VALUES (?, ?, ?, ?, ?, ?)"
)
_SAVE_POSITION = """
INSERT INTO positions (controller, consumer, stream_seq, stream_created) VALUES (?, ?, ?, ?)
ON CONFLICT (controller, consumer) DO UPDATE SET
    stream_seq = CASE WHEN stream_created = excluded.stream_created THEN max(stream_seq, excluded.stream_seq)
                      ELSE excluded.stream_seq END,
    stream_created = excluded.stream_created
"""
_OBSERVE = "INSERT OR REPLACE INTO latest (controller, job, type, time, event_id, event) VALUES (?, ?, ?, ?, ?, ?)"


class StoreVersionError(ControllerError):
    """The file was written by a newer HarmonAIze (a layout this version does not know)."""


class Status:
    DONE = "done"  # the handler returned; `outcome` is its return value
    GAVE_UP = "gave_up"  # PermanentError, or retries exhausted; `outcome` is the error
    STALE = "stale"  # latest_only handler, and a newer event of the type had been seen


@dataclass(frozen=True)
class HandledRecord:
    controller: str
    event_id: str
    handler: str
    status: str
    outcome: Any
    at: float


class HandledStore:
    """Handled event ids and newest observations, in one SQLite file (or `:memory:`)."""

    def __init__(
        self,
        path: Path | str,
        *,
        retention: timedelta = DEFAULT_RETENTION,
        max_entries: int = DEFAULT_MAX_ENTRIES,
        maintenance_interval: float | None = DEFAULT_MAINTENANCE_INTERVAL,
        checkpoint_every: int = CHECKPOINT_EVERY_COMMITS,
        checkpoint_max_age: float = CHECKPOINT_MAX_AGE,
    ) -> None:
        if checkpoint_every < 1 or checkpoint_max_age <= 0:
            raise ValueError("checkpoint_every must be at least 1 and checkpoint_max_age positive")
        in_memory = str(path) == ":memory:"
        if not in_memory:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._retention = retention.total_seconds()
        self._max_entries = max_entries
        self._db = sqlite3.connect(str(path), isolation_level=None, timeout=10.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._create_or_migrate()
        self._newest: dict[tuple[str, str, str], tuple[datetime, str]] = {}
        self._unwritten: dict[tuple[str, str, str], tuple[str, str, str]] = {}
        """Newest observations not yet in the file: key -> (time, event id, event); see `observe`."""
        self._staged: dict[tuple[str, str, str], tuple[str, str, float]] = {}
        """Records not yet in the file: (controller, event id, handler) -> (status, outcome JSON, at); see `stage`."""
        self._newest_loaded: set[str] = set()
        self._positions: dict[tuple[str, str], StreamPosition] = {}
        """What `save_position` last wrote, so an unchanged position costs no write."""
        self._writes = 0
        self._pruned_at_writes = 0
        self._wal_commits = 0
        """Every commit of this connection (records, observations or both): what the checkpoint policy counts."""
        self._checkpoint_every = checkpoint_every
        self._checkpoint_max_age = checkpoint_max_age
        self.checkpoints = 0
        """Background checkpoints done (a test or a metrics exporter reads it)."""
        self._checkpointed_commits = 0
        """`_wal_commits` as the last background checkpoint started: what it covered."""
        self.commits = 0
        """Commits that wrote handled records (a group commit counts once)."""
        self.prune()
        self._stop = threading.Event()
        self._maintenance: threading.Thread | None = None
        if maintenance_interval is not None and not in_memory:
            # The writer's own checkpoints move to the maintenance thread (a second connection on the same file).
            self._db.execute(f"PRAGMA wal_autocheckpoint={SAFETY_CHECKPOINT_PAGES}")
            self._maintenance = threading.Thread(
                target=self._maintain, args=(maintenance_interval,), name="hz-handled-store", daemon=True
            )
            self._maintenance.start()

    def close(self) -> None:
        """Write what is staged, stop the maintenance thread, close; the file is closed even if the write fails."""
        try:
            self.flush()
        finally:
            if self._maintenance is not None:
                self._stop.set()
                self._maintenance.join()
                self._maintenance = None
                self._checkpoint(self._db)
            self._db.close()

    def __enter__(self) -> HandledStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _create_or_migrate(self) -> None:
        (version,) = self._db.execute("PRAGMA user_version").fetchone()
        if version > SCHEMA_VERSION:
            self._db.close()
            raise StoreVersionError(
                f"{self.path}: written by a newer version of HarmonAIze (layout {version}, this one knows "
                f"{SCHEMA_VERSION}); upgrade, or point --state-dir elsewhere"
            )
        old_layout = self._db.execute("SELECT 1 FROM sqlite_master WHERE name = 'handled'").fetchone()
        try:
            if version == 0 and old_layout:
                self._db.executescript(_FROM_VERSION_0)
            else:
                self._db.executescript(_TABLES + f"PRAGMA user_version = {SCHEMA_VERSION};")
        except BaseException:  # a failed migration leaves the file as it was, and unlocked
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._db.close()
            raise

    # -- housekeeping ------------------------------------------------------------------------------------------------

    def _maintain(self, interval: float) -> None:
        db: sqlite3.Connection | None = None

        def connection() -> sqlite3.Connection:
            """Opened on first use, in this loop: a failure to open is retried like any other housekeeping failure."""
            nonlocal db
            if db is None:
                db = sqlite3.connect(str(self.path), isolation_level=None, timeout=10.0)
            return db

        self._checkpointed_commits, checkpointed_at = self._wal_commits, time.monotonic()
        try:
            while not self._stop.wait(interval):
                try:
                    unchecked = self.uncheckpointed_commits
                    age = time.monotonic() - checkpointed_at
                    if unchecked >= self._checkpoint_every or (unchecked and age >= self._checkpoint_max_age):
                        committed = self._wal_commits  # before: a commit during the checkpoint counts for the next one
                        self._checkpoint(connection())
                        self._checkpointed_commits, checkpointed_at = committed, time.monotonic()
                        self.checkpoints += 1
                    if self._writes - self._pruned_at_writes >= PRUNE_EVERY:
                        self._pruned_at_writes = self._writes
                        self._prune_with(connection(), now=time.time())
                except Exception as exc:  # busy, a full disk...: try again next interval; the writer is unaffected
                    _log.warning("handled-event store %s: housekeeping failed (%r); retrying", self.path, exc)
        finally:
            if db is not None:
                db.close()

    @property
    def uncheckpointed_commits(self) -> int:
        """Commits no background checkpoint has covered yet. At 0 the WAL is folded in and restarts from its start at
        the next write; a checkpoint that ran beside the writer leaves this above 0 and the WAL growing meanwhile."""
        return self._wal_commits - self._checkpointed_commits

    @staticmethod
    def _checkpoint(db: sqlite3.Connection) -> None:
        db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()

    def _maybe_prune_inline(self) -> None:
        if self._maintenance is None and self._writes - self._pruned_at_writes >= PRUNE_EVERY:
            self._pruned_at_writes = self._writes
            self.prune()

    # -- handled events ----------------------------------------------------------------------------------------------

    def finished_handlers(self, controller: str, event_id: str) -> set[str]:
        """Handlers that already finished (or gave up on) this event: written, or staged for the next commit."""
        rows = self._db.execute(
            "SELECT handler FROM handled WHERE controller = ? AND event_id = ?", (controller, event_id)
        )
        found = {row[0] for row in rows}
        if self._staged:
            found |= {handler for (owner, event, handler) in self._staged if owner == controller and event == event_id}
        return found

    def record(self, controller: str, event_id: str, handler: str, *, status: str, outcome: Any = None) -> None:
        """Commit that `handler` finished `event_id`, with anything staged and any newest observation not yet written
        (call before acking the event)."""
        self.stage(controller, event_id, handler, status=status, outcome=outcome)
        self.commit()

    def stage(self, controller: str, event_id: str, handler: str, *, status: str, outcome: Any = None) -> None:
        """Note that `handler` finished `event_id`, to be written by the next `commit` (ack the event only after it);
        `finished_handlers` and `records` see it at once."""
        encoded = json.dumps(to_jsonable_python(outcome, fallback=repr))
        self._staged[(controller, event_id, handler)] = (status, encoded, time.time())

    def commit(self) -> None:
        """Write every staged record and newest observation not yet written, in one transaction (nothing to write:
        no statement). If it fails the staged records are dropped and the observations kept for the next one."""
        if not self._staged and not self._unwritten:
            return
        records = [(*key, *value) for key, value in self._staged.items()]
        self._staged.clear()
        if len(records) == 1 and not self._unwritten:
            self._db.execute(_RECORD, records[0])  # one row: its own implicit transaction, no BEGIN/COMMIT to send
        else:
            self._commit_with_unwritten(records)
        self._writes += len(records)
        self._wal_commits += 1
        self.commits += bool(records)
        self._maybe_prune_inline()

    def flush(self) -> None:
        """Commit what is staged and the newest observations not yet written (call before acking an event)."""
        self.commit()

    def _commit_with_unwritten(self, records: list[tuple[Any, ...]]) -> None:
        """`records` and the unwritten observations as one commit; the observations stay unwritten if it fails."""
        pending = [(*key, *value) for key, value in self._unwritten.items()]
        with _transaction(self._db):
            self._db.executemany(_OBSERVE, pending)
            self._db.executemany(_RECORD, records)
        self._unwritten.clear()

    def records(self, controller: str | None = None) -> list[HandledRecord]:
        """Everything recorded (for one controller), written or staged, oldest first."""
        query = "SELECT controller, event_id, handler, status, outcome, at FROM handled"
        params: tuple[str, ...] = ()
        if controller is not None:
            query += " WHERE controller = ?"
            params = (controller,)
        rows = list(self._db.execute(query, params))
        rows += [(*key, *value) for key, value in self._staged.items() if controller in (None, key[0])]
        rows.sort(key=lambda row: (row[5], row[1], row[2]))
        return [HandledRecord(c, e, h, s, json.loads(o) if o is not None else None, a) for c, e, h, s, o, a in rows]

    def prune(self, *, now: float | None = None) -> int:
        """Forget records older than the retention, then the oldest beyond `max_entries`; returns rows removed."""
        return self._prune_with(self._db, now=now if now is not None else time.time())

    def _prune_with(self, db: sqlite3.Connection, *, now: float) -> int:
        """Find what to forget with reads (no lock against the writer: `at` has no index, so they scan), then delete
        it by primary key in short transactions."""
        cutoff = now - self._retention
        removed = 0
        while True:
            keys = db.execute(
                "SELECT controller, event_id, handler FROM handled WHERE at < ? LIMIT ?", (cutoff, PRUNE_CHUNK)
            ).fetchall()
            removed += self._delete_keys(db, keys)
            if len(keys) < PRUNE_CHUNK:
                break
        (count,) = db.execute("SELECT COUNT(*) FROM handled").fetchone()
        excess = count - self._max_entries
        while excess > 0:
            keys = db.execute(
                "SELECT controller, event_id, handler FROM handled ORDER BY at, event_id, handler LIMIT ?",
                (min(excess, PRUNE_CHUNK),),
            ).fetchall()
            deleted = self._delete_keys(db, keys)
            if deleted == 0:
                break
            removed += deleted
            excess -= deleted
        return removed

    @staticmethod
    def _delete_keys(db: sqlite3.Connection, keys: list[tuple[str, str, str]]) -> int:
        if not keys:
            return 0
        with _transaction(db):
            db.executemany("DELETE FROM handled WHERE controller = ? AND event_id = ? AND handler = ?", keys)
        return len(keys)

    # -- consumer positions ------------------------------------------------------------------------------------------

    def position(self, controller: str, consumer: str) -> StreamPosition | None:
        """Where this consumer was last recorded as acked up to (None: never)."""
        row = self._db.execute(
            "SELECT stream_seq, stream_created FROM positions WHERE controller = ? AND consumer = ?",
            (controller, consumer),
        ).fetchone()
        return StreamPosition(int(row[0]), row[1]) if row else None

    def save_position(self, controller: str, consumer: str, position: StreamPosition) -> None:
        """Record that every event up to `position` is acked; a lower sequence of the same stream changes nothing."""
        if position.sequence < 0:
            raise ValueError(f"a stream sequence is 0 or more, not {position.sequence}")
        key = (controller, consumer)
        if not position.supersedes(self._positions.get(key)):
            return
        self._db.execute(_SAVE_POSITION, (controller, consumer, position.sequence, position.stream_created))
        self._positions[key] = position
        self._wal_commits += 1

    # -- newest observations -----------------------------------------------------------------------------------------

    def observe(
        self, controller: str, job: str, event_type: str, *, time_: datetime, event_id: str, event: str
    ) -> bool:
        """Keep `event` if it is the newest of its type for the job; True when it is (ties: the first one seen).

        The comparison uses what this store has kept (in memory, loaded from the file once per controller): this
        process is the file's only writer. The event is written with the next `record` or `flush`.
        """
        self._load_newest(controller)
        key = (controller, job, event_type)
        seen = self._newest.get(key)
        if seen is not None:
            newest, newest_id = seen
            if time_ < newest or (time_ == newest and newest_id != event_id):
                return False
            if newest_id == event_id:
                return True
        self._unwritten[key] = (time_.isoformat(), event_id, event)
        self._newest[key] = (time_, event_id)
        return True

    def _load_newest(self, controller: str) -> None:
        if controller in self._newest_loaded:
            return
        rows = self._db.execute("SELECT job, type, time, event_id FROM latest WHERE controller = ?", (controller,))
        for job, event_type, stamp, event_id in rows:
            self._newest[(controller, job, event_type)] = (datetime.fromisoformat(stamp), event_id)
        self._newest_loaded.add(controller)

    def latest(self, controller: str) -> dict[tuple[str, str], str]:
        """(job, type) -> the newest event's JSON, for one controller (what is written, and what is not yet)."""
        rows = self._db.execute("SELECT job, type, event FROM latest WHERE controller = ?", (controller,))
        found = {(job, event_type): event for job, event_type, event in rows}
        for (owner, job, event_type), (_time, _id, event) in self._unwritten.items():
            if owner == controller:
                found[(job, event_type)] = event
        return found


@contextlib.contextmanager
def _transaction(db: sqlite3.Connection) -> Iterator[None]:
    """BEGIN ... COMMIT, rolled back on any error (unless SQLite already did: an I/O error, a full disk), whose own
    error is then the one raised."""
    db.execute("BEGIN")
    try:
        yield
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
