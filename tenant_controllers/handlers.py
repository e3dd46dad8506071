"""Handler registrations: which function runs for which event type, with what retry policy and which arguments.

A handler says what it needs through its signature, as in faststream: a parameter annotated with the event model gets
the typed payload, `Job` gets the job handle, `CloudEvent` (or `CloudEvent[Failure]`) the full envelope, and
`logging.Logger` a logger. Unannotated parameters are matched by name (`event`, `job`, `envelope`, `logger`). A
parameter the SDK cannot fill is an error when the decorator runs, not when the first event arrives.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from harmonaize.events import CloudEvent, EventData
from tenant_controllers.job import Job

__all__ = ["Binder", "EventHandler", "ResyncHandler", "RetryPolicy"]

DEFAULT_RETRIES = 5
DEFAULT_BACKOFF = 1.0
MAX_BACKOFF = 60.0

_BY_NAME = {
    "event": "payload",
    "payload": "payload",
    "data": "payload",
    "job": "job",
    "envelope": "envelope",
    "cloudevent": "envelope",
    "logger": "logger",
}


@dataclass(frozen=True)
class RetryPolicy:
    """`retries` retries after the first attempt; the n-th retry waits `backoff * 2**(n-1)` s (at most 60 s).

    A TemporaryError's own `delay` replaces the backoff for that retry; both kinds of retry count against `retries`.
    """

    retries: int = DEFAULT_RETRIES
    backoff: float = DEFAULT_BACKOFF

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError("retries must be >= 0")
        if self.backoff < 0:
            raise ValueError("backoff must be >= 0")

    def delay(self, retry: int) -> float:
        """Seconds to wait before retry number `retry` (1-based)."""
        return min(self.backoff * (2.0 ** (retry - 1)), MAX_BACKOFF)


class Binder:
    """Builds a handler's arguments from what is available for one call."""

    def __init__(
        self, fn: Callable[..., Any], *, allowed: frozenset[str], payload_types: tuple[type, ...] = ()
    ) -> None:
        self._plan: list[tuple[str, str, bool]] = []  # (parameter, what, keyword-only)
        self._var_keyword = False
        name = getattr(fn, "__qualname__", repr(fn))
        try:
            hints = typing.get_type_hints(fn)
        except Exception:  # unresolvable string annotations: fall back to parameter names
            hints = {}
        for parameter in inspect.signature(fn).parameters.values():
            if parameter.kind is inspect.Parameter.VAR_KEYWORD:
                self._var_keyword = True
                continue
            if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
                continue
            what = _what_for(hints.get(parameter.name), parameter.name, payload_types)
            if what is None or what not in allowed:
                if parameter.default is not inspect.Parameter.empty:
                    continue
                choices = ", ".join(sorted(allowed))
                raise TypeError(
                    f"handler {name}: cannot tell what to pass for parameter {parameter.name!r}; annotate it with "
                    f"one of the available things ({choices}) or name it after one"
                )
            keyword_only = parameter.kind is inspect.Parameter.KEYWORD_ONLY
            self._plan.append((parameter.name, what, keyword_only))
        self._allowed = allowed

    def takes(self, what: str) -> bool:
        """Whether a call passes `what` (the runtime reads the job only for handlers that can see it)."""
        return self._var_keyword or any(taken == what for _, taken, _ in self._plan)

    def arguments(self, available: dict[str, Any]) -> tuple[list[Any], dict[str, Any]]:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for name, what, keyword_only in self._plan:
            if keyword_only:
                kwargs[name] = available[what]
            else:
                args.append(available[what])
        if self._var_keyword:
            used = {what for _, what, _ in self._plan}
            kwargs.update({what: value for what, value in available.items() if what not in used})
        return args, kwargs


def _what_for(annotation: Any, name: str, payload_types: tuple[type, ...]) -> str | None:
    if isinstance(annotation, type):
        if issubclass(annotation, CloudEvent):
            return "envelope"
        if issubclass(annotation, Job):
            return "job"
        if issubclass(annotation, logging.Logger):
            return "logger"
        if issubclass(annotation, EventData):
            if payload_types and not all(issubclass(model, annotation) for model in payload_types):
                return None
            return "payload"
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        members = [a for a in typing.get_args(annotation) if a is not type(None)]
        if members and all(isinstance(a, type) and issubclass(a, EventData) for a in members):
            return "payload"
    return _BY_NAME.get(name.lower())


async def call_handler(fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """Await a coroutine function; run a plain function in a thread so it cannot block the event loop."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(functools.partial(fn, *args, **kwargs))
    if inspect.isawaitable(result):
        return await result
    return result


@dataclass(frozen=True)
class EventHandler:
    """`@ctl.on(Model, ...)`: run `fn` for events whose data is one of `models`."""

    id: str
    fn: Callable[..., Any]
    models: tuple[type[EventData], ...]
    policy: RetryPolicy
    binder: Binder
    when: Callable[[Any], bool] | None = None
    latest_only: bool = False

    def matches(self, payload: EventData) -> bool:
        return isinstance(payload, self.models) and (self.when is None or bool(self.when(payload)))


@dataclass(frozen=True)
class ResyncHandler:
    """`@ctl.on_resync`: run `fn` periodically with the job's current state."""

    id: str
    fn: Callable[..., Any]
    policy: RetryPolicy
    binder: Binder


EVENT_ARGUMENTS = frozenset({"payload", "job", "envelope", "logger"})
RESYNC_ARGUMENTS = frozenset({"job", "logger"})
