"""One worker's grant or release: a host's counter and an allocation row, moved together.

A grant is the conditional `UPDATE hosts` (only if the host still has room) plus the allocation's row; a release
marks the row released (only if it was not) and gives the GPUs back to the host (only if it holds them). On
PostgreSQL each pair is one statement, data-modifying CTEs whose second part runs on the first's result, so a
worker placed or released costs one round trip, not two, inside the transaction that holds the ledger's lock
(`ledger_lock`: the fewer round trips under it, the more changes per second). SQLite has no data-modifying CTEs: two
statements, each a call into its driver on the caller's thread, with the same outcome.

The allocation's row is written at once rather than left to the session's flush, so the transaction's later reads
(the job's new placement) count it; the `Allocation` object stays out of the session, which only ever holds the
allocations it loaded.
"""

from __future__ import annotations

from datetime import datetime
from typing import cast

from sqlalchemy import Table, bindparam, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm.attributes import set_committed_value

from api.db import execute_core, rows_matched
from api.models import Allocation, Host
from api.services.errors import ConflictError

_HOSTS, _ALLOCATIONS = cast("Table", Host.__table__), cast("Table", Allocation.__table__)
_H, _A = _HOSTS.c, _ALLOCATIONS.c

_RESERVE = (
    update(_HOSTS)
    .where(_H.id == bindparam("host"), _H.down_at.is_(None), _H.allocated_gpus + bindparam("take") <= _H.gpus)
    .values(allocated_gpus=_H.allocated_gpus + bindparam("take"))
)
_RETURN = (
    update(_HOSTS)
    .where(_H.id == bindparam("host"), _H.allocated_gpus >= bindparam("give"))
    .values(allocated_gpus=_H.allocated_gpus - bindparam("give"))
)
_MARK = (
    update(_ALLOCATIONS)
    .where(_A.id == bindparam("allocation"), _A.released_at.is_(None))
    .values(released_at=bindparam("now", type_=_A.released_at.type))
)
_COLUMNS = ("id", "tenant_id", "job_id", "host_id", "gpus", "created_at", "starts_at")
_INSERT = insert(_ALLOCATIONS).values({name: bindparam(name, type_=_A[name].type) for name in _COLUMNS})
"""The conditional updates and the insert, built once on the tables (`api.db.execute_core`); SQLite runs them."""

_RESERVED = _RESERVE.returning(_H.id).cte("reserved")
_GRANT = insert(_ALLOCATIONS).from_select(
    list(_COLUMNS),
    select(*(_RESERVED.c.id if name == "host_id" else bindparam(f"new_{name}", type_=_A[name].type)
             for name in _COLUMNS))
    .select_from(_RESERVED),
    include_defaults=False,  # released_at's default is NULL, as the table's
)
"""PostgreSQL: `_RESERVE`, and the row inserted from what it returned (nothing if the host had no room)."""

_MARKED = _MARK.returning(_A.host_id).cte("marked")
_RETURNED = (
    update(_HOSTS)
    .where(_H.id == _MARKED.c.host_id, _H.allocated_gpus >= bindparam("give"))
    .values(allocated_gpus=_H.allocated_gpus - bindparam("give"))
    .returning(_H.id)
    .cte("returned")
)
_RELEASE = select(
    select(func.count()).select_from(_MARKED).scalar_subquery(),
    select(func.count()).select_from(_RETURNED).scalar_subquery(),
)
"""PostgreSQL: `_MARK`, then `_RETURN` on the host it returned; how many rows each matched."""


def _one_statement(session: AsyncSession) -> bool:
    return session.get_bind().dialect.name == "postgresql"


async def grant(session: AsyncSession, allocation: Allocation) -> bool:
    """Reserve `allocation`'s GPUs on its host and insert its row, both or neither; whether the host had room (and
    was up)."""
    row = {name: getattr(allocation, name) for name in _COLUMNS}
    if _one_statement(session):
        params = {f"new_{name}": value for name, value in row.items()}
        granted = await execute_core(session, _GRANT, {**params, "host": allocation.host_id, "take": allocation.gpus})
        return rows_matched(granted) == 1
    if rows_matched(await execute_core(session, _RESERVE, {"host": allocation.host_id, "take": allocation.gpus})) != 1:
        return False
    await execute_core(session, _INSERT, row)
    return True


async def release(session: AsyncSession, allocation: Allocation, *, give: int, now: datetime) -> None:
    """Mark `allocation` released and give `give` of its GPUs back to its host.

    ConflictError if it was released already (by a concurrent release); RuntimeError if the host holds fewer GPUs
    (the ledger is inconsistent). Either way the caller rolls back, undoing the half that did happen.
    """
    params = {"allocation": allocation.id, "now": now, "host": allocation.host_id, "give": give}
    if _one_statement(session):
        marked, returned = (await execute_core(session, _RELEASE, params)).one()
    else:
        marked = rows_matched(await execute_core(session, _MARK, params))
        returned = rows_matched(await execute_core(session, _RETURN, params)) if marked == 1 else 0
    if marked != 1:
        raise ConflictError(f"allocation {allocation.id!r} is already released")
    if returned != 1:
        raise RuntimeError(f"ledger inconsistent: host {allocation.host_id!r} has fewer than {give} GPUs allocated")
    set_committed_value(allocation, "released_at", now)
