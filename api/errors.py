"""One error shape for every failure: `{"reason": "...", "errors": [{"field": "body.min_workers", "message": ...}]}`.

Validation errors name the field as `<where>.<path>` (`path.job_id`, `body.batch_size.min`), so a client can point at
what to fix; a cross-field check raised at model level names its field in the error's ctx (`ranges.check_ordered`).
Domain errors from the services map to statuses here, keeping HTTP out of the services. Integrity errors
the services did not anticipate (a race on a unique key) are conflicts, not crashes; a pool timeout is a 503, and so
is a database that cannot be reached (refused, reset or timed-out connections while it restarts or is away): the API
keeps serving, says why, and recovers by itself when the database is back (tests/faults/test_database_outage.py).
"""

from __future__ import annotations

import errno
import logging
import traceback
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError, StatementError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import ErrorDetail, ErrorPublic
from api.services.errors import (
    BrokerUnavailableError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    ServiceError,
)
from harmonaize.ids import ID_PATTERN

_log = logging.getLogger(__name__)

_SERVICE_STATUS: list[tuple[type[ServiceError], int]] = [
    (NotFoundError, 404),
    (ConflictError, 409),
    (InvalidRequestError, 422),
    (BrokerUnavailableError, 503),
]

_ID_MESSAGE = (
    "must be an id: lowercase ASCII letters, digits, '_' and '-', starting with a letter or digit, "
    "at most 63 characters"
)


def error_response(status: int, reason: str, *, errors: list[ErrorDetail] | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorPublic(reason=reason, errors=errors or [])
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _field(error: dict[str, Any]) -> str:
    loc = list(error.get("loc", ()))
    ctx = error.get("ctx") or {}
    if error.get("type") == "json_invalid":
        loc = loc[:1]
    elif isinstance(ctx.get("field"), str):
        loc.append(ctx["field"])
    return ".".join(str(part) for part in loc)


def _message(error: dict[str, Any]) -> str:
    if error.get("type") == "json_invalid":
        return f"invalid JSON: {(error.get('ctx') or {}).get('error', 'cannot be parsed')}"
    if error.get("type") == "string_pattern_mismatch" and (error.get("ctx") or {}).get("pattern") == ID_PATTERN:
        return _ID_MESSAGE
    message = str(error.get("msg", "invalid value"))
    return message.removeprefix("Value error, ")


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [ErrorDetail(field=_field(error), message=_message(error)) for error in exc.errors()]
    fields = ", ".join(dict.fromkeys(detail.field for detail in details))
    return error_response(422, f"invalid request: {fields}", errors=details)


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 400 and isinstance(exc.__cause__, UnicodeDecodeError):
        # FastAPI's "error parsing the body" for bytes that are not UTF-8: malformed JSON like any other (RFC 8259)
        detail = ErrorDetail(field="body", message="invalid JSON: the body is not UTF-8")
        return error_response(422, "invalid request: body", errors=[detail])
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))


async def _on_service_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    status = next((code for kind, code in _SERVICE_STATUS if isinstance(exc, kind)), 400)
    return error_response(status, exc.reason)


async def _on_integrity_error(_request: Request, exc: Exception) -> JSONResponse:
    _log.info("integrity error answered as a conflict: %s", exc)
    return error_response(409, "the request conflicts with existing data")


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc` and everything it wraps, each once: SQLAlchemy's `orig` (the driver's error) and `__cause__` links."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        link = pending.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        yield link
        orig = getattr(link, "orig", None)
        pending.extend([orig if isinstance(orig, BaseException) else None, link.__cause__])


def _sqlstate(link: BaseException) -> str | None:
    code = getattr(link, "sqlstate", None) or getattr(link, "pgcode", None)
    return code if isinstance(code, str) else None


def _unstorable(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says a value could not be held: Python's OverflowError, or an SQL data
    exception (SQLSTATE class 22: numeric value out of range, datetime overflow, ...)."""
    return any(
        isinstance(link, (OverflowError, DataError)) or (_sqlstate(link) or "").startswith("22")
        for link in _chain(exc)
    )


async def _on_unstorable_value(request: Request, exc: Exception) -> JSONResponse:
    """A value past what the database or Python can hold (an integer beyond the column, a time past year 9999) that
    no schema bound caught: the caller's input, so a 422 rather than a 500 (the schema should bound it; see the log)."""
    if not _unstorable(exc):
        return await _on_unexpected(request, exc)
    _log.warning("out-of-range value answered as 422 (bound it in the schema): %s", exc)
    return error_response(422, "invalid request: a value is out of range (too large, or a time past year 9999)")


async def _on_pool_timeout(_request: Request, exc: Exception) -> JSONResponse:
    _log.warning("database connection pool exhausted: %s", exc)
    return error_response(503, "the database is busy; retry shortly", headers={"Retry-After": "1"})


_NETWORK_ERRNOS = {errno.ECONNREFUSED, errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EHOSTUNREACH,
                   errno.ENETUNREACH, errno.EPIPE}
_UNREACHABLE_SQLSTATES = ("08", "57P01", "57P02", "57P03")
"""SQLSTATE class 08 (connection exception); admin/crash shutdown and "cannot connect now" (the server restarting)."""
_DATABASE_MODULES = ("sqlalchemy.", "asyncpg.", "aiosqlite.")


def _raised_in_database_code(exc: BaseException) -> bool:
    return any(
        str(frame.f_globals.get("__name__", "")).startswith(_DATABASE_MODULES)
        for frame, _ in traceback.walk_tb(exc.__traceback__)
    )


def _database_unreachable(exc: BaseException) -> bool:
    """Whether `exc` (or what it wraps) says the database cannot be reached right now: a connection SQLAlchemy found
    dead, the server saying it is shutting down or starting up, or a connection refused, reset or timed out inside
    the database driver (drivers raise these as plain OS errors while connecting)."""
    for link in _chain(exc):
        if isinstance(link, DBAPIError) and link.connection_invalidated:
            return True
        if (_sqlstate(link) or "").startswith(_UNREACHABLE_SQLSTATES):
            return True
        network = isinstance(link, (ConnectionError, TimeoutError)) or (
            isinstance(link, OSError) and link.errno in _NETWORK_ERRNOS
        )
        if network and _raised_in_database_code(link):
            return True
    return False


async def _on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
    if _database_unreachable(exc):
        _log.warning("database unreachable, answered 503: %r", exc)
        return error_response(503, "the database is unavailable; retry shortly", headers={"Retry-After": "1"})
    _log.error("unhandled error", exc_info=exc)
    return error_response(500, "internal error")


def install_error_handlers(app: FastAPI) -> None:
    """Route every error through `ErrorPublic`."""
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(ServiceError, _on_service_error)
    app.add_exception_handler(IntegrityError, _on_integrity_error)
    app.add_exception_handler(PoolTimeoutError, _on_pool_timeout)
    for unstorable in (DataError, StatementError, OverflowError):
        app.add_exception_handler(unstorable, _on_unstorable_value)
    app.add_exception_handler(OSError, _on_unexpected)  # a refused database connection arrives as a bare OSError
    app.add_exception_handler(Exception, _on_unexpected)
