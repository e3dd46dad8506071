"""The negotiation pace's token buckets, shared by every API replica (PostgreSQL); beside `api.models`, which imports
this module so its metadata always has the table. The conventions are that module's.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, String
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base, UtcDateTime

__all__ = ["RateBucket"]


class RateBucket(Base):
    """A tenant's bucket: `tokens` left at `at` (the database's clock), refilled on read (`api.limits`)."""

    __tablename__ = "rate_buckets"

    tenant_id: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    tokens: Mapped[float] = mapped_column(Float)
    at: Mapped[datetime] = mapped_column(UtcDateTime())
