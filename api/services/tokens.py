"""Tenant API tokens: `hzt_<token id>_<secret>`, stored only as a SHA-256 hash.

The token id (64 random bits, hex) is a lookup key, so authentication is one indexed read instead of hashing against
every tenant; the secret (256 random bits) is what proves possession. A fast hash is the right choice for a 256-bit
random secret: there is nothing to brute-force, and slow password hashes would only add latency to every request.
Digests are compared with `hmac.compare_digest`, in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass, field

TOKEN_PREFIX = "hzt"
_TOKEN_RE = re.compile(r"hzt_([0-9a-f]{16})_([A-Za-z0-9_-]{43})", re.ASCII)


@dataclass(frozen=True)
class IssuedToken:
    """A fresh token: `plaintext` is returned to the tenant once; only `token_id` and `token_hash` are stored."""

    token_id: str
    token_hash: str
    plaintext: str = field(repr=False)


def hash_token(plaintext: str) -> str:
    """Hex SHA-256 of the whole token string."""
    return hashlib.sha256(plaintext.encode()).hexdigest()


def issue_token() -> IssuedToken:
    """A new random token for a tenant."""
    token_id = secrets.token_hex(8)
    plaintext = f"{TOKEN_PREFIX}_{token_id}_{secrets.token_urlsafe(32)}"
    return IssuedToken(token_id=token_id, token_hash=hash_token(plaintext), plaintext=plaintext)


def token_id_of(plaintext: str) -> str | None:
    """The lookup id inside a well-formed token, or None for anything that cannot be one of ours."""
    match = _TOKEN_RE.fullmatch(plaintext)
    return match.group(1) if match else None


def token_matches(plaintext: str, stored_hash: str) -> bool:
    """Constant-time comparison of a presented token against the stored hash."""
    return hmac.compare_digest(hash_token(plaintext).encode(), stored_hash.encode())
