"""A real local HTTP server standing in for NVSentinel's event relay, WattTime and Electricity Maps, per test.

`InputEmulator` is a stdlib `ThreadingHTTPServer` on 127.0.0.1, port 0, in a thread: the clients under test speak
real HTTP to it (timeouts, truncated bodies and refused tokens happen on the wire, not in a mock). A test sets the
documents each path serves, queues faults for the next N requests (`fail_next`: 503, a hang past the client's
timeout, truncated JSON) and reads back what was asked (`requests`: method, path, query, headers).

The fakes below add each provider's protocol on top (WattTime's login and bearer tokens, Electricity Maps'
`auth-token` header), and the document builders write the shapes the providers document: WattTime's API v3 reference
(docs.watttime.org), Electricity Maps' v3 API reference, and NVSentinel's `data-models/protobufs/health_event.proto`
plus its event-exporter's CloudEvent (`event-exporter/pkg/transformer/cloudevents.go`).
"""

from __future__ import annotations

import base64
import functools
import json
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

__all__ = [
    "FakeElectricityMaps",
    "FakeNvSentinel",
    "FakeWattTime",
    "Fault",
    "InputEmulator",
    "RecordedRequest",
    "Reply",
    "em_forecast",
    "em_latest",
    "exporter_cloud_event",
    "health_event",
    "rfc3339",
    "running_emulator",
    "watttime_forecast",
]


@dataclass(frozen=True)
class RecordedRequest:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Header names lower-cased."""


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""
    headers: tuple[tuple[str, str], ...] = ()

    @classmethod
    def json(cls, document: Any, *, status: int = 200, headers: tuple[tuple[str, str], ...] = ()) -> Reply:
        return cls(status, json.dumps(document).encode(), (("Content-Type", "application/json"), *headers))


Responder = Callable[[RecordedRequest], Reply]


class Fault(StrEnum):
    UNAVAILABLE = "503"
    HANG = "hang"
    """Answer nothing for `hang_s` (longer than any client timeout in the tests), then a 503 nobody reads."""
    TRUNCATED = "truncated"
    """The normal answer, status 200, with the body cut in half (a consistent Content-Length)."""


@dataclass
class InputEmulator:
    hang_s: float = 5.0
    _routes: dict[str, Responder] = field(default_factory=dict)
    _faults: dict[str | None, deque[Fault]] = field(default_factory=dict)
    _requests: list[RecordedRequest] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopping: threading.Event = field(default_factory=threading.Event)
    _server: ThreadingHTTPServer | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> None:
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall between

            def do_GET(self) -> None:
                emulator._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        serve = functools.partial(self._server.serve_forever, poll_interval=0.01)  # a quick shutdown
        self._thread = threading.Thread(target=serve, name="input-emulator", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def serve(self, path: str, responder: Responder) -> None:
        with self._lock:
            self._routes[path] = responder

    def set_json(self, path: str, document: Any, *, status: int = 200) -> None:
        reply = Reply.json(document, status=status)
        self.serve(path, lambda _request: reply)

    def fail_next(self, count: int, fault: Fault, *, path: str | None = None) -> None:
        """The next `count` requests (to `path`, or to any path) meet `fault` instead of their normal answer."""
        with self._lock:
            self._faults.setdefault(path, deque()).extend([fault] * count)

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def requests(self, path: str | None = None) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self._requests if path is None or r.path == path]

    def _next_fault(self, path: str) -> Fault | None:
        with self._lock:
            for key in (path, None):
                queue = self._faults.get(key)
                if queue:
                    return queue.popleft()
        return None

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        request = RecordedRequest(
            method=handler.command,
            path=parts.path,
            query=dict(parse_qsl(parts.query)),
            headers={name.lower(): value for name, value in handler.headers.items()},
        )
        with self._lock:
            self._requests.append(request)
            responder = self._routes.get(parts.path)
        fault = self._next_fault(parts.path)
        if fault is Fault.HANG:
            self._stopping.wait(self.hang_s)
            reply = Reply.json({"error": "late"}, status=503)
        elif fault is Fault.UNAVAILABLE:
            reply = Reply.json({"error": "service unavailable"}, status=503)
        else:
            reply = responder(request) if responder is not None else Reply.json({"error": "not found"}, status=404)
            if fault is Fault.TRUNCATED:
                reply = Reply(200, reply.body[: len(reply.body) // 2], reply.headers)
        try:
            handler.send_response(reply.status)
            for name, value in reply.headers:
                handler.send_header(name, value)
            handler.send_header("Content-Length", str(len(reply.body)))
            handler.end_headers()
            handler.wfile.write(reply.body)
        except OSError:
            pass  # the client gave up (a hang past its timeout)


@contextmanager
def running_emulator(*, hang_s: float = 5.0) -> Iterator[InputEmulator]:
    emulator = InputEmulator(hang_s=hang_s)
    emulator.start()
    try:
        yield emulator
    finally:
        emulator.stop()


def rfc3339(at: datetime) -> str:
    return at.astimezone(UTC).isoformat().replace("+00:00", "Z")


# --- WattTime v3 ---------------------------------------------------------------------------------------------------


def watttime_forecast(
    start: datetime,
    values: Sequence[float],
    *,
    region: str = "CAISO_NORTH",
    units: str = "lbs_co2_per_mwh",
    period_s: int = 300,
) -> dict[str, Any]:
    """A `/v3/forecast` answer: `data` points every `period_s` from `start`, `meta` as WattTime documents it."""
    return {
        "data": [
            {"point_time": (start + timedelta(seconds=i * period_s)).isoformat(), "value": value}
            for i, value in enumerate(values)
        ],
        "meta": {
            "data_point_period_seconds": period_s,
            "region": region,
            "warnings": [],
            "signal_type": "co2_moer",
            "model": {"date": "2023-03-01", "type": "binned_regression"},
            "units": units,
            "generated_at_period_seconds": 300,
            "generated_at": start.isoformat(),
        },
    }


@dataclass
class FakeWattTime:
    """`/login` (basic auth, issues tokens) and `/v3/forecast` (bearer token, else 401)."""

    emulator: InputEmulator
    username: str = "wt-user"
    password: str = "wt-secret"
    forecast: dict[str, Any] = field(default_factory=dict)
    pending: deque[Any] = field(default_factory=deque)
    """Answers served once each, in order, before `forecast` (bad documents, one per poll)."""
    issued: list[str] = field(default_factory=list)
    _valid: set[str] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.emulator.serve("/login", self._login)
        self.emulator.serve("/v3/forecast", self._forecast)

    def revoke_tokens(self) -> None:
        """Every issued token expires now (the next forecast request gets a 401)."""
        self._valid.clear()

    def _login(self, request: RecordedRequest) -> Reply:
        expected = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        if request.headers.get("authorization") != f"Basic {expected}":
            return Reply.json({"error": "invalid credentials"}, status=403)
        token = f"token-{len(self.issued) + 1}"
        self.issued.append(token)
        self._valid.add(token)
        return Reply.json({"token": token})

    def _forecast(self, request: RecordedRequest) -> Reply:
        token = request.headers.get("authorization", "").removeprefix("Bearer ")
        if token not in self._valid:
            return Reply.json({"error": "unauthorized"}, status=401)
        return Reply.json(self.pending.popleft() if self.pending else self.forecast)


# --- Electricity Maps v3 -------------------------------------------------------------------------------------------


def em_latest(zone: str, g_per_kwh: float | None, at: datetime, *, estimated: bool = False) -> dict[str, Any]:
    """A `/v3/carbon-intensity/latest` answer as the v3 reference shows it."""
    return {
        "zone": zone,
        "carbonIntensity": g_per_kwh,
        "datetime": at.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
        "updatedAt": (at + timedelta(minutes=41)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "createdAt": (at - timedelta(days=3)).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "emissionFactorType": "lifecycle",
        "isEstimated": estimated,
        "estimationMethod": "TIME_SLICER_AVERAGE" if estimated else None,
    }


def em_forecast(zone: str, points: Sequence[tuple[datetime, float | None]], *, updated: datetime) -> dict[str, Any]:
    """A `/v3/carbon-intensity/forecast` answer."""
    return {
        "zone": zone,
        "forecast": [
            {"carbonIntensity": value, "datetime": at.strftime("%Y-%m-%dT%H:%M:%S.000Z")} for at, value in points
        ],
        "updatedAt": updated.strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
    }


@dataclass
class FakeElectricityMaps:
    """The two carbon-intensity routes, answering 401 without the right `auth-token` header."""

    emulator: InputEmulator
    api_key: str = "em-key-123"
    latest: dict[str, Any] = field(default_factory=dict)
    forecast: dict[str, Any] = field(default_factory=dict)
    pending_latest: deque[Any] = field(default_factory=deque)
    """Answers served once each, in order, before `latest`."""
    pending_forecast: deque[Any] = field(default_factory=deque)
    """Answers served once each, in order, before `forecast`."""

    def __post_init__(self) -> None:
        self.emulator.serve("/v3/carbon-intensity/latest", lambda r: self._answer(r, self.pending_latest, "latest"))
        self.emulator.serve(
            "/v3/carbon-intensity/forecast", lambda r: self._answer(r, self.pending_forecast, "forecast")
        )

    def _answer(self, request: RecordedRequest, pending: deque[Any], name: str) -> Reply:
        if request.headers.get("auth-token") != self.api_key:
            return Reply.json({"message": "unauthorized"}, status=401)
        return Reply.json(pending.popleft() if pending else getattr(self, name))


# --- NVSentinel ------------------------------------------------------------------------------------------------------


def health_event(
    *,
    node: str = "gpu-node-7",
    check: str = "SysLogsXIDError",
    component: str = "GPU",
    fatal: bool = True,
    healthy: bool = False,
    codes: Sequence[str] = ("79",),
    gpu: int | None = 0,
    action: str | int = "RESTART_VM",
    at: datetime,
    message: str = "",
) -> dict[str, Any]:
    """A HealthEvent in JSON (health_event.proto field names), as syslog-health-monitor would send it."""
    entities: list[dict[str, str]] = []
    if gpu is not None:
        entities = [
            {"entityType": "GPU", "entityValue": str(gpu)},
            {"entityType": "PCI", "entityValue": f"0000:{0x18 + gpu:02x}:00.0"},
            {"entityType": "GPU_UUID", "entityValue": f"GPU-0000000{gpu}-aaaa-bbbb-cccc-0123456789ab"},
        ]
    return {
        "version": 1,
        "agent": "syslog-health-monitor",
        "componentClass": component,
        "checkName": check,
        "isFatal": fatal,
        "isHealthy": healthy,
        "message": message or f"XID {','.join(codes)} on GPU {gpu}",
        "recommendedAction": action,
        "errorCode": list(codes),
        "entitiesImpacted": entities,
        "metadata": {"chassis_serial": "1654321098765"},
        "generatedTimestamp": rfc3339(at),
        "nodeName": node,
        "processingStrategy": "EXECUTE_REMEDIATION",
    }


_ACTION_NUMBERS = {"NONE": 0, "COMPONENT_RESET": 2, "CONTACT_SUPPORT": 5, "RESTART_VM": 15, "REPLACE_VM": 25}


def exporter_cloud_event(event: dict[str, Any]) -> dict[str, Any]:
    """The CloudEvent NVSentinel's event-exporter POSTs for `event` (its recommendedAction as a number)."""
    inner = dict(event)
    action = inner["recommendedAction"]
    inner["recommendedAction"] = _ACTION_NUMBERS[action] if isinstance(action, str) else action
    inner.pop("processingStrategy", None)
    return {
        "specversion": "1.0",
        "type": "com.nvidia.nvsentinel.health.v1",
        "source": "nvsentinel://cluster-a/healthevents",
        "id": "0b5e3f3c-6f1e-4a55-9a51-5d1c7e0e2a10",
        "time": inner["generatedTimestamp"],
        "data": {"metadata": {"cluster": "cluster-a"}, "healthEvent": inner},
    }


@dataclass
class FakeNvSentinel:
    """A relay serving NVSentinel's recent events at `/events`, as a list or as a `HealthEvents` batch."""

    emulator: InputEmulator
    path: str = "/events"
    events: list[Any] = field(default_factory=list)
    batch: bool = False

    def __post_init__(self) -> None:
        self.emulator.serve(self.path, self._answer)

    @property
    def url(self) -> str:
        return self.emulator.url + self.path

    def _answer(self, _request: RecordedRequest) -> Reply:
        events = list(self.events)
        return Reply.json({"version": 1, "events": events} if self.batch else events)
