"""Liveness with a database round trip: an API that cannot reach its database is not healthy."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import text

from api.deps import SessionDep
from api.schemas import HealthPublic

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz(session: SessionDep) -> HealthPublic:
    await session.execute(text("SELECT 1"))
    return HealthPublic(status="ok")
