"""The schema comes only from migrations: they round-trip, match the models, and the app refuses a stale database."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect, text
from sqlalchemy.exc import IntegrityError

from api import migrate
from api.app import create_app
from api.db import make_engine
from api.migrate import SchemaNotCurrentError
from api.models import Base
from harmonaize.settings import Settings
from tests.api.api_memory_broker import InMemoryBroker

OUR_TABLES = {
    "tenants", "jobs", "hosts", "allocations", "negotiations", "negotiation_rounds", "idempotency_keys", "outbox",
}


async def _tables(settings: Settings) -> set[str]:
    engine = make_engine(settings.resolved_database_url, single_use=True)
    try:
        async with engine.connect() as connection:
            return set(await connection.run_sync(lambda sync: inspect(sync).get_table_names()))
    finally:
        await engine.dispose()


async def test_upgrade_downgrade_upgrade_round_trip(empty_settings: Settings) -> None:
    assert await migrate.current_async(empty_settings) is None

    await migrate.upgrade_async(empty_settings)
    assert await migrate.current_async(empty_settings) == migrate.head_revision()
    assert OUR_TABLES <= await _tables(empty_settings)

    await migrate.downgrade_async(empty_settings, "base")
    assert await migrate.current_async(empty_settings) is None
    assert not OUR_TABLES & await _tables(empty_settings)

    await migrate.upgrade_async(empty_settings)
    assert await migrate.current_async(empty_settings) == migrate.head_revision()
    assert OUR_TABLES <= await _tables(empty_settings)


async def test_models_match_migrations(migrated_settings: Settings) -> None:
    engine = make_engine(migrated_settings.resolved_database_url, single_use=True)
    try:
        async with engine.connect() as connection:
            differences = await connection.run_sync(
                lambda sync: compare_metadata(
                    MigrationContext.configure(sync, opts={"compare_type": True}), Base.metadata
                )
            )
    finally:
        await engine.dispose()
    assert differences == []


_TENANT_ROW = (
    "INSERT INTO tenants (id, display_name, token_id, token_hash, nats_user_public_key, created_at) "
    "VALUES ('acme', 'Acme', 'tid', 'hash', 'UKEY', CURRENT_TIMESTAMP)"
)


def _job_row(job_id: str, batch: str) -> str:
    return (
        "INSERT INTO jobs (tenant_id, id, name, min_workers, max_workers, gpus_per_worker, parallel_plan, "
        "checkpoint_interval_steps_min, checkpoint_interval_steps_max, compression_allowed, batch_size_min, "
        "batch_size_max, grad_accumulation_min, grad_accumulation_max, created_at) "
        f"VALUES ('acme', '{job_id}', 'J', 1, 2, 1, 'ddp', 10, 20, '[\"none\"]', {batch}, 1, 1, CURRENT_TIMESTAMP)"
    )


async def _execute(settings: Settings, *statements: str) -> list[tuple[object, ...]]:
    engine = make_engine(settings.resolved_database_url, single_use=True)
    try:
        async with engine.begin() as connection:
            result = None
            for statement in statements:
                result = await connection.execute(text(statement))
            return [tuple(row) for row in result] if result is not None and result.returns_rows else []
    finally:
        await engine.dispose()


async def test_migrations_keep_data_and_refuse_to_invent_it(empty_settings: Settings) -> None:
    """0002 rewrites `jobs` (a table recreation on SQLite): rows survive both ways, and the downgrade refuses to
    make up a batch size for a job that has none."""
    await migrate.upgrade_async(empty_settings, "0001")
    await _execute(empty_settings, _TENANT_ROW, _job_row("old", "8, 64"))
    await migrate.upgrade_async(empty_settings)
    await _execute(empty_settings, _job_row("new", "NULL, NULL"))
    rows = await _execute(empty_settings, "SELECT id, batch_size_min, batch_size_max FROM jobs ORDER BY id")
    assert rows == [("new", None, None), ("old", 8, 64)]

    with pytest.raises(RuntimeError, match="acme/new"):
        await migrate.downgrade_async(empty_settings, "0001")
    assert await migrate.current_async(empty_settings) == migrate.head_revision()

    await _execute(empty_settings, "DELETE FROM jobs WHERE id = 'new'")
    await migrate.downgrade_async(empty_settings, "0001")
    assert await migrate.current_async(empty_settings) == "0001"
    assert await _execute(empty_settings, "SELECT id, batch_size_min FROM jobs") == [("old", 8)]


def _allocation_row(allocation_id: str, job_id: str, gpus: int, released: bool = False) -> str:
    released_at = "CURRENT_TIMESTAMP" if released else "NULL"
    return (
        "INSERT INTO allocations (id, tenant_id, job_id, host_id, gpus, created_at, released_at) "
        f"VALUES ('{allocation_id}', 'acme', '{job_id}', 'h1', {gpus}, CURRENT_TIMESTAMP, {released_at})"
    )


async def test_0003_sizes_existing_jobs_from_their_allocations_and_refuses_partial_workers(
    empty_settings: Settings,
) -> None:
    """Jobs placed before 0003 get desired_workers from their live allocations; a job whose allocations are not
    whole workers within max_workers (possible before 0003) stops the upgrade, named, with nothing changed."""
    await migrate.upgrade_async(empty_settings, "0002")
    await _execute(
        empty_settings,
        _TENANT_ROW,
        _job_row("placed", "8, 64"),
        _job_row("empty", "8, 64"),
        "INSERT INTO hosts (id, gpus, locality_group, allocated_gpus, created_at) "
        "VALUES ('h1', 8, 'rack-a', 5, CURRENT_TIMESTAMP)",
        _allocation_row("a1", "placed", 1),
        _allocation_row("a2", "placed", 1),
        _allocation_row("a3", "placed", 3, released=True),
        "UPDATE jobs SET gpus_per_worker = 2 WHERE id = 'empty'",
        _allocation_row("a4", "empty", 3),
    )
    with pytest.raises(RuntimeError, match="acme/empty"):
        await migrate.upgrade_async(empty_settings)
    assert await migrate.current_async(empty_settings) == "0002"

    await _execute(empty_settings, "UPDATE allocations SET gpus = 2 WHERE id = 'a4'")
    await migrate.upgrade_async(empty_settings)
    rows = await _execute(empty_settings, "SELECT id, desired_workers, allocated_gpus FROM jobs ORDER BY id")
    assert rows == [("empty", 1, 2), ("placed", 2, 2)]
    with pytest.raises(IntegrityError):
        await _execute(empty_settings, "UPDATE jobs SET desired_workers = 3 WHERE id = 'placed'")
    await migrate.downgrade_async(empty_settings, "0002")
    assert await _execute(empty_settings, "SELECT count(*) FROM allocations") == [(4,)]


def _accepted_scale(negotiation_id: str, option: int, updated_at: str, *, kind: str = "scale",
                    state: str = "accepted") -> str:
    offer = '{"options": [{"workers": 2, "replaced_hosts": ["h-left"]}, {"workers": 1}]}'
    return (
        "INSERT INTO negotiations (id, tenant_id, job_id, kind, state, round, terms, offer, accepted_option, version, "
        f"created_at, updated_at) VALUES ('{negotiation_id}', 'acme', 'train', '{kind}', '{state}', 1, '{{}}', "
        f"'{offer}', {option}, 2, {updated_at}, {updated_at})"
    )


async def test_0014_keeps_the_last_hours_replacements_as_quarantines(empty_settings: Settings) -> None:
    """Upgrading must not end a quarantine early: a replacement accepted within the hour becomes a row; older ones,
    other options, other states and other kinds do not."""
    await migrate.upgrade_async(empty_settings, "0002")
    await _execute(empty_settings, _TENANT_ROW, _job_row("train", "8, 64"))
    await migrate.upgrade_async(empty_settings, "0003")
    await _execute(
        empty_settings,
        _accepted_scale("recent", 0, "CURRENT_TIMESTAMP"),
        _accepted_scale("old", 0, "'2020-01-01 00:00:00'"),
        _accepted_scale("other-option", 1, "CURRENT_TIMESTAMP"),
        _accepted_scale("rejected", 0, "CURRENT_TIMESTAMP", state="rejected"),
        _accepted_scale("repartition", 0, "CURRENT_TIMESTAMP", kind="repartition"),
    )
    await migrate.upgrade_async(empty_settings)
    rows = await _execute(empty_settings, "SELECT tenant_id, job_id, host_name FROM job_host_quarantines")
    assert rows == [("acme", "train", "h-left")]

    await migrate.downgrade_async(empty_settings, "0013")
    assert "job_host_quarantines" not in await _tables(empty_settings)
    assert await _execute(empty_settings, "SELECT count(*) FROM negotiations") == [(5,)]


def test_sync_helpers_work_inside_a_running_loop_and_out(sqlite_settings: Settings) -> None:
    """The CLI calls the sync helpers; they must also work when a loop is already running in the thread."""
    migrate.upgrade(sqlite_settings)
    assert migrate.current(sqlite_settings) == migrate.head_revision()
    migrate.downgrade(sqlite_settings, "base")
    assert migrate.current(sqlite_settings) is None


async def test_sync_helpers_from_a_coroutine(sqlite_settings: Settings) -> None:
    migrate.upgrade(sqlite_settings)
    assert migrate.current(sqlite_settings) == migrate.head_revision()


async def test_app_refuses_an_unmigrated_database(empty_settings: Settings) -> None:
    broker = InMemoryBroker()
    app = create_app(empty_settings, broker=broker)
    with pytest.raises(SchemaNotCurrentError, match="harmonaize db upgrade") as raised:
        async with app.router.lifespan_context(app):
            pytest.fail("the app started on an unmigrated database")
    assert "never migrated" in str(raised.value)
    assert broker.applied == [], "the broker must not be touched before the schema check passes"


async def test_app_refuses_a_database_at_another_revision(empty_settings: Settings) -> None:
    """E.g. migrated by a newer release: starting on it could misread rows, so refuse it too."""
    await migrate.upgrade_async(empty_settings)
    engine = make_engine(empty_settings.resolved_database_url, single_use=True)
    try:
        async with engine.begin() as connection:
            await connection.execute(text("UPDATE alembic_version SET version_num = 'ffffffffffff'"))
    finally:
        await engine.dispose()
    app = create_app(empty_settings, broker=InMemoryBroker())
    with pytest.raises(SchemaNotCurrentError, match="harmonaize db upgrade") as raised:
        async with app.router.lifespan_context(app):
            pytest.fail("the app started on a database at an unknown revision")
    assert "ffffffffffff" in str(raised.value)
