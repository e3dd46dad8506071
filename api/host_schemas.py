"""Bodies and views of the provider's hosts (admin only)."""

from __future__ import annotations

from datetime import datetime
from typing import Self

from pydantic import BaseModel, Field

from api.models import Host
from api.schemas import MAX_GPUS, LocalityGroup, _Body
from harmonaize.ids import HostId


class HostCreate(_Body):
    id: HostId
    gpus: int = Field(ge=1, le=MAX_GPUS)
    locality_group: LocalityGroup


class HostPublic(BaseModel):
    id: str
    gpus: int
    locality_group: str
    allocated_gpus: int
    free_gpus: int
    down_at: datetime | None = None
    created_at: datetime

    @classmethod
    def from_model(cls, host: Host) -> Self:
        return cls(
            id=host.id,
            gpus=host.gpus,
            locality_group=host.locality_group,
            allocated_gpus=host.allocated_gpus,
            free_gpus=host.gpus - host.allocated_gpus,
            down_at=host.down_at,
            created_at=host.created_at,
        )
