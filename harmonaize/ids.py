"""Tenant, job and host identifiers.

Ids become NATS subject tokens (`hz.t.<tenant>.events.<kind>.<job>`), account names and URL path segments, so they
are validated once, here, before they reach any of those. The alphabet is deliberately ASCII-only and excludes the
subject metacharacters (`.`, `*`, `>`), whitespace and unicode look-alikes: an id that passes can never widen a
subscription or escape its tenant's slice.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeGuard

from pydantic import StringConstraints

ID_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,62}$"
_ID_RE = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}", re.ASCII)

TenantId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
JobId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
HostId = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
ConsumerName = Annotated[str, StringConstraints(pattern=ID_PATTERN)]


class InvalidIdError(ValueError):
    """An id that must not reach a subject, an account name or a URL."""

    def __init__(self, kind: str, value: object) -> None:
        super().__init__(
            f"invalid {kind} id {value!r}: must match {ID_PATTERN} "
            "(lowercase ASCII letters, digits, '_' and '-', starting with a letter or digit, at most 63 characters)"
        )
        self.kind = kind
        self.value = value


def is_valid_id(value: object) -> TypeGuard[str]:
    """True when `value` is a string usable as a tenant, job or host id."""
    return isinstance(value, str) and _ID_RE.fullmatch(value) is not None


def validate_id(kind: str, value: object) -> str:
    """Return `value` unchanged, or raise InvalidIdError naming `kind`."""
    if not is_valid_id(value):
        raise InvalidIdError(kind, value)
    return value
