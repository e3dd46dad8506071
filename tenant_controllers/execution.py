"""Run one handler with its retry policy: the kopf-style outcome rules in one function.

* return value      -> done; the value is the outcome, recorded with the event id;
* PermanentError    -> give up now (logged, the event is acked, never retried);
* TemporaryError    -> retry after its `delay` (or the backoff), counting against `retries`;
* other exceptions  -> retry with backoff; once `retries` are used up, give up as if permanent.

Waiting between attempts is interruptible: when the controller is asked to stop, the wait ends at once with
`Interrupted`, and the runtime hands the event back to the broker for the next run instead of sitting out the delay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from harmonaize.waits import wait_set
from tenant_controllers.errors import PermanentError, TemporaryError
from tenant_controllers.handlers import RetryPolicy

__all__ = ["Done", "GaveUp", "Interrupted", "run_with_retries"]

T = TypeVar("T")


class Interrupted(Exception):
    """The controller is stopping: abandon this handler between attempts."""


@dataclass(frozen=True)
class Done(Generic[T]):
    value: T
    attempts: int


@dataclass(frozen=True)
class GaveUp:
    error: BaseException
    attempts: int

    def describe(self) -> str:
        return f"{type(self.error).__name__}: {self.error}"


async def run_with_retries(
    attempt: Callable[[int], Awaitable[T]],
    *,
    policy: RetryPolicy,
    stop: asyncio.Event,
    what: str,
    logger: logging.Logger,
) -> Done[T] | GaveUp:
    """Call `attempt(1)`, `attempt(2)`, ... until it returns, fails permanently, or the retries are used up."""
    number = 1
    while True:
        try:
            return Done(await attempt(number), number)
        except PermanentError as exc:
            logger.error("%s failed permanently, giving up: %s", what, exc)
            return GaveUp(exc, number)
        except TemporaryError as exc:
            delay = exc.delay if exc.delay is not None else policy.delay(number)
            error: BaseException = exc
            kind = "temporary error"
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            delay = policy.delay(number)
            error = exc
            kind = "error"
        if number > policy.retries:
            logger.error(
                "%s: %s after %d attempt(s), giving up: %s: %s",
                what, kind, number, type(error).__name__, error, exc_info=kind == "error",
            )
            return GaveUp(error, number)
        logger.warning(
            "%s: %s (attempt %d of %d), retrying in %.2f s: %s: %s",
            what, kind, number, policy.retries + 1, delay, type(error).__name__, error,
        )
        await _sleep_unless_stopped(delay, stop)
        number += 1


async def _sleep_unless_stopped(delay: float, stop: asyncio.Event) -> None:
    if stop.is_set():
        raise Interrupted()
    if await wait_set(stop, delay):
        raise Interrupted()

