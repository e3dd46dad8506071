"""`Controller`: the object a controller script creates and decorates; it holds handlers and nothing else.

A script declares *what* to do (`@ctl.on(Failure)`, `@ctl.on_resync`); the runtime (`tenant_controllers.runtime`)
decides *when*, and the runner (`harmonaize controller run script.py`) builds the connections. Keeping the three
apart is what lets the same script run over a real broker, an in-memory bus in a unit test, or two at once.

Each controller owns its handlers (there is no global registry), so tests and scripts can build as many as they like.
Its durable consumer is named after it (`ctl-<job>-<name>`): restarting the script resumes where it stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, overload

from harmonaize.events import EventData, EventKind
from harmonaize.ids import validate_id
from tenant_controllers.handlers import (
    DEFAULT_BACKOFF,
    DEFAULT_RETRIES,
    EVENT_ARGUMENTS,
    RESYNC_ARGUMENTS,
    Binder,
    EventHandler,
    ResyncHandler,
    RetryPolicy,
)

__all__ = ["Controller", "consumer_name"]

F = TypeVar("F", bound=Callable[..., Any])
MAX_ID = 63


def consumer_name(name: str, jobs: Sequence[str]) -> str:
    """The durable consumer id for a controller: `ctl-<job>-<name>`, or `ctl-<name>-<hash>` for several jobs.

    Always a valid id (at most 63 characters): long names are shortened and made unique by a hash suffix.
    """
    if len(jobs) == 1:
        base = f"ctl-{jobs[0]}-{name}"
    else:
        digest = hashlib.sha256(",".join(sorted(jobs)).encode()).hexdigest()[:8]
        base = f"ctl-{name}-{digest}"
    if len(base) > MAX_ID:
        digest = hashlib.sha256(base.encode()).hexdigest()[:8]
        base = f"{base[: MAX_ID - 9].rstrip('-_')}-{digest}"
    return validate_id("consumer", base)


class Controller:
    """Handlers for one tenant's job(s); see the package docstring for a complete example."""

    def __init__(
        self,
        *,
        tenant: str | None = None,
        job: str | None = None,
        jobs: Iterable[str] = (),
        name: str | None = None,
    ) -> None:
        chosen = ([job] if job is not None else []) + list(jobs)
        if not chosen:
            raise ValueError("a Controller needs job= (or jobs=[...]): the job(s) it acts for")
        self.tenant = validate_id("tenant", tenant) if tenant is not None else None
        self.jobs: tuple[str, ...] = tuple(dict.fromkeys(validate_id("job", j) for j in chosen))
        self._name = validate_id("controller name", name) if name is not None else None
        self._handlers: list[EventHandler] = []
        self._resync: list[ResyncHandler] = []

    def __repr__(self) -> str:
        return f"Controller(tenant={self.tenant!r}, jobs={list(self.jobs)!r}, name={self._name!r})"

    # -- identity ----------------------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        """The controller's name (defaults to the script's name when the runner loads it)."""
        if self._name is None:
            raise RuntimeError("this Controller has no name yet: pass name=... or run it with the runner")
        return self._name

    @property
    def has_name(self) -> bool:
        return self._name is not None

    def set_default_name(self, name: str) -> None:
        """Name the controller unless its script already did (the runner uses the script's file name)."""
        if self._name is None:
            self._name = validate_id("controller name", name)

    @property
    def consumer(self) -> str:
        """Its durable consumer's name."""
        return consumer_name(self.name, self.jobs)

    # -- registration ------------------------------------------------------------------------------------------------

    def on(
        self,
        *models: type[EventData],
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        when: Callable[[Any], bool] | None = None,
        latest_only: bool = False,
        id: str | None = None,  # noqa: A002 - kopf's name for it
    ) -> Callable[[F], F]:
        """Run the decorated function for each event of the given type(s) about this controller's job(s).

        `when` filters on the payload. `latest_only=True` skips events older (by event time) than the newest one of
        the same type already seen for the job: right for levels (carbon, congestion), wrong for facts (failures).
        """
        if not models:
            raise TypeError("ctl.on() needs at least one event model, e.g. @ctl.on(Failure)")
        for model in models:
            if not (isinstance(model, type) and issubclass(model, EventData)):
                raise TypeError(f"ctl.on() takes event models such as Failure, got {model!r}")
        policy = RetryPolicy(retries=retries, backoff=backoff)

        def register(fn: F) -> F:
            handler_id = self._unique_id(id or _default_id(fn))
            binder = Binder(fn, allowed=EVENT_ARGUMENTS, payload_types=tuple(models))
            self._handlers.append(
                EventHandler(
                    id=handler_id, fn=fn, models=tuple(models), policy=policy, binder=binder, when=when,
                    latest_only=latest_only,
                )
            )
            return fn

        return register

    @overload
    def on_resync(self, fn: F, /) -> F: ...

    @overload
    def on_resync(
        self, /, *, retries: int = DEFAULT_RETRIES, backoff: float = DEFAULT_BACKOFF, id: str | None = None
    ) -> Callable[[F], F]: ...

    def on_resync(
        self,
        fn: F | None = None,
        /,
        *,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
        id: str | None = None,  # noqa: A002
    ) -> F | Callable[[F], F]:
        """Run the decorated function at start and then periodically, per job, with the job's current state.

        Resync is what makes a controller level-based: whatever events were lost, it compares the job as the provider
        has it with what it wants and acts on the difference.
        """
        policy = RetryPolicy(retries=retries, backoff=backoff)

        def register(f: F) -> F:
            handler_id = self._unique_id(id or _default_id(f))
            self._resync.append(
                ResyncHandler(id=handler_id, fn=f, policy=policy, binder=Binder(f, allowed=RESYNC_ARGUMENTS))
            )
            return f

        return register(fn) if fn is not None else register

    # -- what the runtime reads --------------------------------------------------------------------------------------

    @property
    def handlers(self) -> tuple[EventHandler, ...]:
        return tuple(self._handlers)

    @property
    def resync_handlers(self) -> tuple[ResyncHandler, ...]:
        return tuple(self._resync)

    @property
    def kinds(self) -> tuple[EventKind, ...]:
        """The event kinds this controller has handlers for (what its consumer subscribes to)."""
        return tuple(sorted({model.KIND for handler in self._handlers for model in handler.models}))

    def handlers_for(self, payload: EventData) -> list[EventHandler]:
        return [handler for handler in self._handlers if isinstance(payload, handler.models)]

    def _unique_id(self, handler_id: str) -> str:
        taken = {h.id for h in self._handlers} | {h.id for h in self._resync}
        if handler_id in taken:
            raise ValueError(f"two handlers with id {handler_id!r}: give one of them id=...")
        return handler_id


def _default_id(fn: Callable[..., Any]) -> str:
    """A handler's id when none is given: its qualified name (any callable works, so fall back to its repr)."""
    name: str = getattr(fn, "__qualname__", repr(fn))
    return name
