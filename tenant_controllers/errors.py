"""What can go wrong in a controller, and what the runtime does about it.

Two errors decide retry behaviour, as in kopf: a handler raises `TemporaryError(delay=...)` to be called again later,
and `PermanentError` to give up on this event (logged, acked, never retried). Any other exception is retried with the
handler's backoff until its `retries` are used up, then treated as permanent. The negotiation client maps HTTP
outcomes onto the same two roots, so a handler that lets an error escape gets the sensible behaviour for free:

* the provider is down or overloaded (5xx, connection errors, timeouts) -> `ApiUnavailableError`, a TemporaryError;
* the request can never succeed as sent (401/403, 404, 422) -> a PermanentError subclass carrying the server's
  `reason` (and, for 422, the per-field `errors`);
* the negotiation moved on under us (409: the offer expired, was already accepted, ...) -> `ConflictError`, neither
  temporary nor permanent: retried with backoff, because a retry re-reads the state and asks again;
* the provider can offer nothing inside the tenant's range -> `Declined`, a PermanentError: asking again at once gets
  the same answer; the next event or resync tries again with fresh state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harmonaize.rest import NegotiationPublic

__all__ = [
    "ApiError",
    "ApiUnavailableError",
    "AuthenticationError",
    "ConfigurationError",
    "ConflictError",
    "ControllerError",
    "Declined",
    "InvalidRequestError",
    "NotFoundError",
    "PermanentError",
    "TemporaryError",
]


class ControllerError(Exception):
    """Base of every error the SDK raises."""


class TemporaryError(ControllerError):
    """Retry this handler later: after `delay` seconds, or the handler's backoff when `delay` is None."""

    def __init__(self, message: str = "", *, delay: float | None = None) -> None:
        super().__init__(message)
        if delay is not None and delay < 0:
            raise ValueError("delay must be >= 0")
        self.delay = delay


class PermanentError(ControllerError):
    """Give up on this event: logged, acked, never retried."""


class ConfigurationError(ControllerError):
    """The controller cannot start as configured (missing credentials, bad script); the message is one line."""


class ApiError(ControllerError):
    """The provider's API answered with an error; `reason` is the server's own explanation."""

    def __init__(
        self,
        reason: str,
        *,
        status: int | None,
        method: str = "",
        url: str = "",
        errors: Sequence[dict[str, Any]] = (),
    ) -> None:
        where = f" ({method} {url})" if method else ""
        code = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"{code}{reason}{where}")
        self.reason = reason
        self.status = status
        self.method = method
        self.url = url
        self.errors = list(errors)


class ApiUnavailableError(ApiError, TemporaryError):
    """5xx, a timeout or no connection: the request may succeed if sent again (with the same idempotency key)."""

    def __init__(self, reason: str, *, status: int | None, method: str = "", url: str = "",
                 errors: Sequence[dict[str, Any]] = (), delay: float | None = None) -> None:
        ApiError.__init__(self, reason, status=status, method=method, url=url, errors=errors)
        self.delay = delay


class AuthenticationError(ApiError, PermanentError):
    """401/403: the tenant token is wrong, revoked, or not allowed to do this."""


class NotFoundError(ApiError, PermanentError):
    """404: no such job or negotiation for this tenant."""


class InvalidRequestError(ApiError, PermanentError):
    """422: the server refused the request's content; `errors` names the fields."""


class ConflictError(ApiError):
    """409: the negotiation is not in a state that allows this (the reason names the current state)."""


class Declined(PermanentError):
    """The provider can offer nothing inside the requested range; `negotiation` is the declined negotiation."""

    def __init__(self, negotiation: NegotiationPublic) -> None:
        last = negotiation.rounds[-1].note if negotiation.rounds and negotiation.rounds[-1].note else ""
        detail = f": {last}" if last else ""
        super().__init__(f"negotiation {negotiation.id} for job {negotiation.job} was declined{detail}")
        self.negotiation = negotiation
