"""Tokens verified moments ago, so a busy tenant's requests do not each read its token's row.

Every tenant request authenticates: one indexed read and a hash compare. Under load the same few tokens arrive
hundreds of times a second, and that read was one of a negotiation's handful of round trips. A token that verified
as an active tenant's is remembered for `ttl_s` seconds, keyed by the token's SHA-256 (the plaintext is not kept).

What a cache must not do is outlive a revocation. In the process that revokes, `forget_tenant` drops the tenant's
entries at once, and bumps a generation, so a lookup that read the row before the revocation committed cannot put
its stale answer back (`put(generation=...)` with the generation seen before the read). Another replica learns of
it only from the database: there a revoked token keeps working for at most `ttl_s` seconds (1 s by default;
`HZ_API_TOKEN_CACHE_S=0` turns the cache off). Unknown and revoked tokens are never cached, so guessing fills
nothing, and the size is bounded (`max_entries`, oldest first out).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from api.services.tenants import TokenHolder
from api.services.tokens import hash_token

__all__ = ["TokenCache"]


class TokenCache:
    """Active tenants by token digest, each for `ttl_s` seconds after it was verified."""

    def __init__(self, ttl_s: float, *, max_entries: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._ttl_s = ttl_s
        self._max_entries = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[TokenHolder, float]] = OrderedDict()
        self._generation = 0

    @property
    def generation(self) -> int:
        """Read before looking a token up in the database; hand it to `put` afterwards."""
        return self._generation

    def get(self, token: str) -> TokenHolder | None:
        """The active tenant `token` verified as less than `ttl_s` ago, or None (look it up)."""
        if self._ttl_s <= 0:
            return None
        key = hash_token(token)
        entry = self._entries.get(key)
        if entry is None:
            return None
        holder, expires_at = entry
        if self._clock() >= expires_at:
            del self._entries[key]
            return None
        return holder

    def put(self, token: str, holder: TokenHolder, *, generation: int) -> None:
        """Remember that `token` verified as `holder`, unless a tenant was forgotten since `generation` was read."""
        if self._ttl_s <= 0 or holder.revoked_at is not None or generation != self._generation:
            return
        key = hash_token(token)
        self._entries[key] = (holder, self._clock() + self._ttl_s)
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)

    def forget_tenant(self, tenant_id: str) -> None:
        """Drop every entry of `tenant_id` (it was just revoked), and refuse answers read before this call."""
        self._generation += 1
        for key in [key for key, (holder, _) in self._entries.items() if holder.id == tenant_id]:
            del self._entries[key]

    def __len__(self) -> int:
        return len(self._entries)
