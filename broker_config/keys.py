"""NATS user keys (nkeys) for the provider, tenant admins and tenants.

Users authenticate with nkeys, so the broker configuration holds only public keys: a leaked config file grants
nothing. The provider's own identities (its account user and the system user) are derived
from the provider secret with HMAC, so nothing besides that one secret has to be stored or rotated separately, and
every process that holds the secret (API, agents, launcher) derives the same keys. Tenant users get random keys; the
seed is handed to the tenant once and only its public half is kept.
"""

from __future__ import annotations

import hashlib
import hmac
import os

import nkeys

from broker_config.accounts import UserKeys


def _keys_from_raw(raw: bytes) -> UserKeys:
    seed: bytes = nkeys.encode_seed(raw, nkeys.PREFIX_BYTE_USER)
    public: bytes = nkeys.from_seed(bytearray(seed)).public_key
    return UserKeys(public_key=public.decode(), seed=seed.decode())


def new_user_keys() -> UserKeys:
    """A random user key pair (for a tenant)."""
    return _keys_from_raw(os.urandom(32))


def derive_user_keys(secret: bytes, purpose: str) -> UserKeys:
    """A user key pair derived from the provider secret; the same secret and purpose always give the same keys."""
    if not secret:
        raise ValueError("the provider secret is empty: set HZ_PROVIDER_SECRET")
    raw = hmac.new(secret, f"hz-nats-user:{purpose}".encode(), hashlib.sha256).digest()
    return _keys_from_raw(raw)


def public_key_of(seed: str) -> str:
    """The public key of a user seed; raises nkeys errors for a malformed seed."""
    public: bytes = nkeys.from_seed(bytearray(seed.encode())).public_key
    return public.decode()


class ProviderKeys:
    """The provider's derived identities, from one secret."""

    def __init__(self, secret: bytes) -> None:
        self._secret = secret
        self.provider = derive_user_keys(secret, "provider")
        self.system = derive_user_keys(secret, "system")
