"""UUIDv7 event ids: format per RFC 9562, strictly increasing within a process, robust to clock quirks."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from itertools import pairwise

import pytest

from harmonaize.timeids import UUID7Generator, is_uuid7, uuid7, uuid7_unix_ms


def _scripted_clock(readings: list[int]) -> Callable[[], int]:
    """A clock that returns the scripted readings, then keeps repeating the last one."""
    remaining: Iterator[int] = iter(readings)
    last = [readings[0]]

    def clock() -> int:
        last[0] = next(remaining, last[0])
        return last[0]

    return clock


def _assert_valid_uuid7(value: str) -> None:
    parsed = uuid.UUID(value)
    assert parsed.version == 7
    assert parsed.variant == uuid.RFC_4122
    assert str(parsed) == value
    assert is_uuid7(value)


def test_ten_thousand_ids_in_a_tight_loop_are_strictly_increasing_valid_uuid7() -> None:
    ids = [uuid7() for _ in range(10_000)]
    for value in ids:
        _assert_valid_uuid7(value)
    assert all(earlier < later for earlier, later in pairwise(ids))
    assert len(set(ids)) == len(ids)


def test_timestamp_is_the_clock_in_milliseconds() -> None:
    generator = UUID7Generator(clock_ms=lambda: 1_700_000_000_123)
    value = generator()
    _assert_valid_uuid7(value)
    assert uuid7_unix_ms(value) == 1_700_000_000_123


def test_counter_overflow_within_one_millisecond_borrows_the_next_millisecond() -> None:
    generator = UUID7Generator(clock_ms=lambda: 5_000, random_bits=lambda bits: (1 << bits) - 1)
    ids = [generator() for _ in range(5_000)]
    assert all(earlier < later for earlier, later in pairwise(ids))
    assert uuid7_unix_ms(ids[0]) == 5_000
    assert uuid7_unix_ms(ids[-1]) > 5_000
    for value in ids:
        _assert_valid_uuid7(value)


def test_clock_running_backwards_never_produces_a_smaller_id() -> None:
    generator = UUID7Generator(clock_ms=_scripted_clock([10_000, 10_001, 9_000, 9_500, 10_001, 10_002]))
    ids = [generator() for _ in range(6)]
    assert all(earlier < later for earlier, later in pairwise(ids))
    assert [uuid7_unix_ms(value) for value in ids] == [10_000, 10_001, 10_001, 10_001, 10_001, 10_002]


def test_concurrent_threads_never_share_an_id_and_each_sees_increasing_ids() -> None:
    generator = UUID7Generator(clock_ms=lambda: 42)
    results: dict[int, list[str]] = {}

    def work(index: int) -> None:
        results[index] = [generator() for _ in range(500)]

    threads = [threading.Thread(target=work, args=(index,)) for index in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    every = [value for values in results.values() for value in values]
    assert len(set(every)) == len(every) == 4_000
    for values in results.values():
        assert values == sorted(values)


@pytest.mark.parametrize(
    "value",
    [
        "not-a-uuid",
        str(uuid.UUID(int=0x0123456789AB4DEF8123456789ABCDEF)),  # version 4
        "0189a1b2-c3d4-7e5f-c123-456789abcdef",  # wrong variant (0b110)
        "0189A1B2-C3D4-7E5F-8123-456789ABCDEF",  # uppercase is not canonical
        42,
    ],
)
def test_is_uuid7_refuses_other_values(value: object) -> None:
    assert not is_uuid7(value)


def test_timestamp_beyond_48_bits_is_refused() -> None:
    generator = UUID7Generator(clock_ms=lambda: 1 << 48)
    with pytest.raises(OverflowError):
        generator()
