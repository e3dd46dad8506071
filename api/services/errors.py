"""The errors services raise; `api.errors` maps each to an HTTP status.

Messages are written for the caller who triggered them. For tenant-facing lookups they say only that the object was
not found, whether it exists for another tenant or not at all, so an error can never confirm another tenant's data.
"""

from __future__ import annotations


class ServiceError(Exception):
    """Base class: a request the domain refuses, with a reason fit to show the caller."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class NotFoundError(ServiceError):
    """The object does not exist, or is not visible to this caller (the two are indistinguishable on purpose)."""


class ConflictError(ServiceError):
    """The request contradicts current state: a duplicate id, an already released allocation."""


class InsufficientCapacityError(ConflictError):
    """No host (in the requested scope) has the GPUs asked for; nothing was allocated."""


class JobLimitError(ConflictError):
    """The change would take a job outside its own range (above `max_workers`); nothing was allocated."""


class InvalidRequestError(ServiceError):
    """Well-formed, but meaningless for the object it names (e.g. an option index the offer does not have)."""


class BrokerUnavailableError(ServiceError):
    """The broker did not accept the tenant registry; the database change was rolled back."""
