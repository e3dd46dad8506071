"""The warm joiners' table, beside `api.models` (which imports this module, so its metadata always has the table).

A module of its own only to keep `api.models` small; the conventions are that module's.
"""

from __future__ import annotations

from sqlalchemy import CheckConstraint, ForeignKey, Integer, PrimaryKeyConstraint, String
from sqlalchemy.orm import Mapped, mapped_column

from api.models import ID_LENGTH, Base

__all__ = ["StandbyNode"]


class StandbyNode(Base):
    """A warm joiner: while `negotiation` offers to grow its job, `host` (where the accept would place the new
    workers) already runs the job's node, model built, waiting for the accept (`api.services.standby`).

    It holds no capacity: a guess from the ledger at offer time, not a reservation. It counts only while its
    negotiation is offered and unexpired; rows go with the negotiation's next answer.
    """

    __tablename__ = "standby_nodes"
    __table_args__ = (
        PrimaryKeyConstraint("negotiation_id", "host_id"),
        CheckConstraint("workers >= 1", name="workers_positive"),
    )

    negotiation_id: Mapped[str] = mapped_column(String(36), ForeignKey("negotiations.id", ondelete="CASCADE"))
    host_id: Mapped[str] = mapped_column(String(ID_LENGTH), ForeignKey("hosts.id", ondelete="CASCADE"), index=True)
    workers: Mapped[int] = mapped_column(Integer)
