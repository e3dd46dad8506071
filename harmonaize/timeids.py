"""Time-ordered event ids: UUIDv7 (RFC 9562), because Python 3.11's `uuid` module has no `uuid7`.

Why UUIDv7 and not uuid4: event ids double as JetStream de-duplication keys (`Nats-Msg-Id`) and end up as primary
keys in the history tables. A time-ordered id sorts in publication order as a plain string, keeps B-tree inserts
local, and tells an operator roughly when an event was minted without parsing its payload.

Layout (RFC 9562, section 5.7), most significant bit first:

    unix_ts_ms (48) | ver = 0b0111 (4) | rand_a (12) | var = 0b10 (2) | rand_b (62)

Monotonicity uses RFC 9562 section 6.2 "Method 1" (fixed-length dedicated counter): `rand_a` is a 12-bit counter.
At each new millisecond it is re-seeded with a random value below 2**11, which leaves at least 2048 increments of
headroom while keeping the ids unguessable; within the same millisecond it increments. When it would overflow, or
when the wall clock steps backwards (NTP), the generator borrows the next millisecond instead of going back: ids stay
strictly increasing within a process at the cost of a timestamp that may run a few milliseconds ahead under
extreme bursts. `rand_b` stays fully random, so two processes (or a parent and its forked child) that happen to
share a millisecond and counter still differ in 62 random bits.
"""

from __future__ import annotations

import re
import secrets
import threading
import time
import uuid
from collections.abc import Callable

__all__ = ["UUID7Generator", "is_uuid7", "uuid7", "uuid7_unix_ms"]

_COUNTER_BITS = 12
_COUNTER_MAX = (1 << _COUNTER_BITS) - 1
_COUNTER_SEED_BITS = _COUNTER_BITS - 1
_RAND_B_BITS = 62
_TIMESTAMP_MAX = (1 << 48) - 1

_UUID7_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", re.ASCII)


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class UUID7Generator:
    """A thread-safe, per-process monotonic UUIDv7 source.

    The clock and the random source are injectable so tests can script a clock that stands still or runs backwards
    and check the overflow and regression paths deterministically, without sleeping.
    """

    def __init__(
        self,
        *,
        clock_ms: Callable[[], int] = _wall_clock_ms,
        random_bits: Callable[[int], int] = secrets.randbits,
    ) -> None:
        self._clock_ms = clock_ms
        self._random_bits = random_bits
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def __call__(self) -> str:
        """Return the next id as a canonical lowercase string, strictly greater than the previous one."""
        return str(self.next_uuid())

    def next_uuid(self) -> uuid.UUID:
        """Return the next id as a `uuid.UUID` (for callers that store native UUID columns)."""
        with self._lock:
            now_ms = self._clock_ms()
            if now_ms > self._last_ms:
                self._last_ms = now_ms
                self._counter = self._random_bits(_COUNTER_SEED_BITS)
            elif self._counter < _COUNTER_MAX:
                self._counter += 1
            else:
                self._last_ms += 1
                self._counter = self._random_bits(_COUNTER_SEED_BITS)
            if not 0 <= self._last_ms <= _TIMESTAMP_MAX:
                raise OverflowError(f"unix time {self._last_ms} ms does not fit UUIDv7's 48-bit timestamp")
            timestamp_ms, counter = self._last_ms, self._counter
        rand_b = self._random_bits(_RAND_B_BITS)
        value = (timestamp_ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand_b
        return uuid.UUID(int=value)


_default_generator = UUID7Generator()


def uuid7() -> str:
    """A new time-ordered event id from the process-wide generator."""
    return _default_generator()


def is_uuid7(value: object) -> bool:
    """True when `value` is a canonical lowercase UUIDv7 string with the RFC 9562 variant."""
    return isinstance(value, str) and _UUID7_RE.fullmatch(value) is not None


def uuid7_unix_ms(value: str) -> int:
    """The unix-millisecond timestamp embedded in a UUIDv7 string (e.g. to page history by id)."""
    if not is_uuid7(value):
        raise ValueError(f"not a canonical UUIDv7: {value!r}")
    return uuid.UUID(value).int >> 80
