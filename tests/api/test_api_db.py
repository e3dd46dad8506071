"""Engine configuration: SQLite pragmas on every connection, one pooled writer, foreign keys on both backends."""

from __future__ import annotations

import pytest
from sqlalchemy import text
from sqlalchemy.exc import IntegrityError

from api.db import SQLITE_BUSY_TIMEOUT_MS, make_engine, make_sessionmaker
from api.models import Job, utcnow
from harmonaize.settings import Settings


async def test_sqlite_connections_are_configured(sqlite_settings: Settings) -> None:
    engine = make_engine(sqlite_settings.resolved_database_url)
    try:
        assert engine.pool.size() == 1  # type: ignore[attr-defined]  # Pool's base class does not declare size()
        for _ in range(2):
            async with engine.connect() as connection:
                pragmas = {
                    name: (await connection.exec_driver_sql(f"PRAGMA {name}")).scalar_one()
                    for name in ("journal_mode", "busy_timeout", "foreign_keys")
                }
            assert pragmas == {"journal_mode": "wal", "busy_timeout": SQLITE_BUSY_TIMEOUT_MS, "foreign_keys": 1}
            await engine.dispose()
    finally:
        await engine.dispose()
    assert (sqlite_settings.data_dir / "harmonaize.db").exists()


async def test_sqlite_creates_its_data_directory(sqlite_settings: Settings) -> None:
    nested = sqlite_settings.model_copy(update={"data_dir": sqlite_settings.data_dir / "a" / "b"})
    engine = make_engine(nested.resolved_database_url, single_use=True)
    try:
        async with engine.connect() as connection:
            await connection.execute(text("SELECT 1"))
    finally:
        await engine.dispose()
    assert (nested.data_dir / "harmonaize.db").exists()


async def test_foreign_keys_are_enforced(migrated_settings: Settings) -> None:
    engine = make_engine(migrated_settings.resolved_database_url)
    try:
        async with make_sessionmaker(engine)() as session:
            session.add(
                Job(
                    tenant_id="nobody", id="orphan", name="orphan", min_workers=1, max_workers=1, gpus_per_worker=1,
                    parallel_plan="ddp", checkpoint_interval_steps_min=1, checkpoint_interval_steps_max=1,
                    compression_allowed=["none"], batch_size_min=1, batch_size_max=1,
                    grad_accumulation_min=1, grad_accumulation_max=1, created_at=utcnow(),
                )
            )
            with pytest.raises(IntegrityError):
                await session.commit()
    finally:
        await engine.dispose()


_VALID_JOB = {
    "tenant_id": "'acme'", "id": "'j'", "name": "'J'", "min_workers": "1", "max_workers": "2", "gpus_per_worker": "1",
    "parallel_plan": "'ddp'", "checkpoint_interval_steps_min": "10", "checkpoint_interval_steps_max": "20",
    "compression_allowed": "'[\"none\"]'", "powersgd_max_rank": "NULL", "batch_size_min": "8",
    "batch_size_max": "64", "grad_accumulation_min": "1", "grad_accumulation_max": "1",
    "created_at": "CURRENT_TIMESTAMP",
}
_VIOLATIONS = [
    {"min_workers": "0"},
    {"min_workers": "3"},
    {"gpus_per_worker": "0"},
    {"parallel_plan": "'pipeline'"},
    {"checkpoint_interval_steps_min": "30"},
    {"batch_size_min": "NULL"},
    {"batch_size_min": "128"},
    {"grad_accumulation_min": "0"},
    {"powersgd_max_rank": "0"},
]


def _insert_job(**overrides: str) -> str:
    values = _VALID_JOB | overrides
    return f"INSERT INTO jobs ({', '.join(values)}) VALUES ({', '.join(values.values())})"


async def test_job_invariants_are_check_constraints(migrated_settings: Settings) -> None:
    """Every range rule of a job holds in the database itself, on both backends and after 0002 rebuilt the table."""
    engine = make_engine(migrated_settings.resolved_database_url)
    try:
        async with engine.begin() as connection:
            await connection.execute(
                text(
                    "INSERT INTO tenants (id, display_name, token_id, token_hash, nats_user_public_key, created_at) "
                    "VALUES ('acme', 'Acme', 'tid', 'hash', 'UKEY', CURRENT_TIMESTAMP)"
                )
            )
        for violation in _VIOLATIONS:
            async with engine.connect() as connection:
                with pytest.raises(IntegrityError):
                    await connection.execute(text(_insert_job(**violation)))
                    pytest.fail(f"accepted {violation}")
        async with engine.begin() as connection:
            await connection.execute(text(_insert_job(batch_size_min="NULL", batch_size_max="NULL")))
    finally:
        await engine.dispose()
