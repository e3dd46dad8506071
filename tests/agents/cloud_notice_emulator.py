"""A local emulator of the three clouds' metadata services, for the notice channels' tests.

A real HTTP server (stdlib `ThreadingHTTPServer` on 127.0.0.1, port 0, one thread per request) that behaves like the
documented services where the channels depend on it:

- Azure (`/metadata/...`): requests without `Metadata: true` get 400.
- AWS IMDSv2: `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds` hands out a token; a GET under
  `/latest/meta-data/` without a token the emulator issued (and has not expired) gets 401.
- GCP (`/computeMetadata/...`): requests without `Metadata-Flavor: Google` get 403; answers carry
  `Metadata-Flavor: Google` and an `ETag`, and `?wait_for_change=true&last_etag=E&timeout_sec=N` is held until the
  value's ETag differs from E (or N seconds pass).

Tests script it: `serve` sets a path's standing document (None: 404), `fail_next` makes the next requests to a path
answer 503, hang past the client's timeout, or send the document cut in half, `answer_next` hands out one-shot
replies (an older incarnation, a document without the GCP header), `expire_tokens` forgets every AWS token. Every
request is recorded (`received`) with its method, path, query, headers and body.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
from collections import defaultdict, deque
from dataclasses import dataclass
from enum import StrEnum
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, Self
from urllib.parse import parse_qsl, urlsplit

__all__ = ["CloudNoticeEmulator", "Fault", "Received", "Reply"]

HANG_S = 5.0
"""How long a hanging answer is held (far past any test client's timeout); closing the emulator releases it."""
LONG_POLL_CAP_S = 30.0


class Fault(StrEnum):
    UNAVAILABLE = "unavailable"
    """503 Service Unavailable."""
    HANG = "hang"
    """No answer until the client has given up."""
    TRUNCATED = "truncated"
    """200 with the first half of the standing document."""


@dataclass(frozen=True)
class Reply:
    """A one-shot answer. `bare` leaves out the cloud's response headers (GCP's `Metadata-Flavor`)."""

    body: str
    status: int = 200
    bare: bool = False


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    """Header names lower-cased."""
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _text(document: object) -> str:
    return document if isinstance(document, str) else json.dumps(document)


class CloudNoticeEmulator:
    """Azure, AWS and GCP metadata endpoints on one local port; start with `with` (or `start()` / `close()`)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._documents: dict[str, str] = {}
        self._faults: defaultdict[str, deque[Fault]] = defaultdict(deque)
        self._one_shots: defaultdict[str, deque[Reply]] = defaultdict(deque)
        self._received: list[Received] = []
        self._tokens: set[str] = set()
        self._token_numbers = itertools.count(1)
        self._released = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -------------------------------------------------------------------------------------------------

    def start(self) -> Self:
        emulator = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body go out in two writes: no 40 ms delayed-ACK stall

            def do_GET(self) -> None:
                emulator._handle(self)

            def do_PUT(self) -> None:
                emulator._handle(self)

            def do_POST(self) -> None:
                emulator._handle(self)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._released.set()
        with self._lock:
            self._lock.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    @property
    def url(self) -> str:
        assert self._server is not None, "start the emulator first"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    # --- scripting -------------------------------------------------------------------------------------------------

    def serve(self, path: str, document: object | None) -> None:
        """The standing answer for GETs of `path`: JSON of `document`, a string as is, or 404 for None."""
        with self._lock:
            if document is None:
                self._documents.pop(path, None)
            else:
                self._documents[path] = _text(document)
            self._lock.notify_all()

    def fail_next(self, count: int, fault: Fault, *, path: str) -> None:
        with self._lock:
            self._faults[path].extend([fault] * count)

    def answer_next(self, path: str, *replies: Reply) -> None:
        with self._lock:
            self._one_shots[path].extend(replies)

    def pending(self, path: str) -> int:
        """Faults and one-shot replies for `path` not yet handed out."""
        with self._lock:
            return len(self._faults[path]) + len(self._one_shots[path])

    def expire_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    def etag(self, path: str) -> str:
        with self._lock:
            return self._etag(path)

    def received(self, path: str | None = None, *, method: str | None = None) -> list[Received]:
        with self._lock:
            return [
                r for r in self._received if (path is None or r.path == path) and (method is None or r.method == method)
            ]

    # --- serving ---------------------------------------------------------------------------------------------------

    def _etag(self, path: str) -> str:
        return hashlib.sha1(self._documents.get(path, "\0404").encode()).hexdigest()[:16]

    def _handle(self, handler: BaseHTTPRequestHandler) -> None:
        url = urlsplit(handler.path)
        path, query = url.path, dict(parse_qsl(url.query))
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        headers = {name.lower(): value for name, value in handler.headers.items()}
        with self._lock:
            self._received.append(Received(handler.command, path, query, headers, body))
        gcp = path.startswith("/computeMetadata/")
        refused = self._refusal(handler.command, path, headers)
        if refused is not None:
            self._send(handler, refused[0], refused[1], gcp=gcp, etag=None)
            return
        if path == "/latest/api/token":
            with self._lock:
                token = f"AQAEAtoken{next(self._token_numbers)}=="
                self._tokens.add(token)
            self._send(handler, 200, token, gcp=False, etag=None)
            return
        if gcp and query.get("wait_for_change") == "true":
            self._hold_until_changed(path, query)
        with self._lock:
            fault = self._faults[path].popleft() if self._faults[path] else None
            one_shot = self._one_shots[path].popleft() if fault is None and self._one_shots[path] else None
            standing = self._documents.get(path)
            etag = self._etag(path)
        if fault is Fault.HANG:
            self._released.wait(HANG_S)
            handler.close_connection = True
            return
        if fault is Fault.UNAVAILABLE:
            self._send(handler, 503, "Service Unavailable", gcp=gcp, etag=None)
        elif fault is Fault.TRUNCATED:
            text = standing or ""
            self._send(handler, 200, text[: len(text) // 2], gcp=gcp, etag=etag)
        elif handler.command == "POST":  # Azure's StartRequests: accepted
            self._send(handler, 200, "", gcp=gcp, etag=None)
        elif one_shot is not None:
            self._send(handler, one_shot.status, one_shot.body, gcp=gcp and not one_shot.bare, etag=etag)
        elif standing is None:
            self._send(handler, 404, "Not Found", gcp=gcp, etag=None)
        else:
            self._send(handler, 200, standing, gcp=gcp, etag=etag)

    def _refusal(self, method: str, path: str, headers: dict[str, str]) -> tuple[int, str] | None:
        """What the real service answers a request it will not serve, or None."""
        if path.startswith("/metadata/") and headers.get("metadata") != "true":
            return 400, '{"error": "Bad request. Required metadata header not specified"}'
        if path == "/latest/api/token":
            ttl = headers.get("x-aws-ec2-metadata-token-ttl-seconds", "")
            if method != "PUT":
                return 405, "Method Not Allowed"
            if not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return 400, "Bad Request"
        if path.startswith("/latest/meta-data/"):
            with self._lock:
                if headers.get("x-aws-ec2-metadata-token") not in self._tokens:
                    return 401, "Unauthorized"
        if path.startswith("/computeMetadata/") and headers.get("metadata-flavor") != "Google":
            return 403, "Missing required header: Metadata-Flavor"
        return None

    def _hold_until_changed(self, path: str, query: dict[str, str]) -> None:
        timeout = min(float(query.get("timeout_sec", LONG_POLL_CAP_S)), LONG_POLL_CAP_S)
        with self._lock:
            last = query.get("last_etag") or self._etag(path)
            self._lock.wait_for(lambda: self._released.is_set() or self._etag(path) != last, timeout=timeout)

    def _send(self, handler: BaseHTTPRequestHandler, status: int, body: str, *, gcp: bool, etag: str | None) -> None:
        data = body.encode()
        try:
            handler.send_response(status)
            handler.send_header("Content-Type", "application/json" if body[:1] in "[{" and body else "text/plain")
            handler.send_header("Content-Length", str(len(data)))
            if gcp:
                handler.send_header("Metadata-Flavor", "Google")
            if gcp and etag is not None:
                handler.send_header("ETag", etag)
            handler.end_headers()
            handler.wfile.write(data)
        except OSError:  # the client gave up (a timeout under test): nothing to tell it
            handler.close_connection = True
