"""Per-tenant pseudonyms for provider-internal names (hosts, locality groups).

A tenant needs to tell its hosts and locality groups apart (to group HSDP shards, to correlate a failure event with an
allocation), but must learn nothing else from the name: not the provider's naming scheme, not how many hosts exist,
and not whether another tenant is on the same host. So every name a tenant sees is a keyed hash:

    h-<16 hex> = HMAC-SHA256(provider secret, "host" | tenant | host)

- keyed by the provider's secret, so a tenant cannot invert it by hashing candidate host names;
- the tenant id is part of the message, so two tenants see unrelated pseudonyms for the same host and cannot compare
  notes to learn that they share hardware;
- the kind ("host", "locality") is part of the message, so a host and a group with the same internal name do not map
  to the same pseudonym;
- parts are length-prefixed, so ("ab", "c") and ("a", "bc") can never produce the same message.

64 bits of output keep ids short while a collision among a provider's hosts stays negligible (~n^2 / 2^65).
Deterministic and stateless: the API, the host agents and the event projection compute the same pseudonym
independently, as long as they share the secret. Pure standard library, so any part of the system may import it.
"""

from __future__ import annotations

import hashlib
import hmac

HOST_PREFIX = "h-"
LOCALITY_PREFIX = "g-"
_DIGEST_HEX_CHARS = 16


def _pseudonym(secret: bytes, *, kind: str, tenant: str, name: str) -> str:
    if not secret:
        raise ValueError("a pseudonym needs a non-empty provider secret")
    message = b"".join(
        len(part).to_bytes(4, "big") + part for part in (kind.encode(), tenant.encode(), name.encode())
    )
    return hmac.new(secret, message, hashlib.sha256).hexdigest()[:_DIGEST_HEX_CHARS]


def host_pseudonym(secret: bytes, tenant: str, host: str) -> str:
    """The name `tenant` sees for `host`: stable for that tenant, unlinkable across tenants."""
    return HOST_PREFIX + _pseudonym(secret, kind="host", tenant=tenant, name=host)


def locality_pseudonym(secret: bytes, tenant: str, group: str) -> str:
    """The name `tenant` sees for locality group `group`: stable for that tenant, unlinkable across tenants."""
    return LOCALITY_PREFIX + _pseudonym(secret, kind="locality", tenant=tenant, name=group)
