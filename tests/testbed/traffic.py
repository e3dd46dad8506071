"""A bounded TCP transfer between two testbed namespaces, timed by the receiver: what the link really carries."""

from __future__ import annotations

import subprocess
import sys

SINK = r"""
import socket, sys, time
address, port, expected = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
server = socket.create_server((address, port))
server.settimeout(20)
print("listening", flush=True)
conn, _ = server.accept()
conn.settimeout(20)
received, first = 0, None
while received < expected:
    chunk = conn.recv(1 << 16)
    if not chunk:
        break
    if first is None:
        first = time.monotonic()
    received += len(chunk)
print(received, time.monotonic() - first, flush=True)
"""

SOURCE = r"""
import socket, sys
address, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
with socket.create_connection((address, port), timeout=20) as conn:
    block = b"x" * (1 << 16)
    sent = 0
    while sent < size:
        conn.sendall(block[: min(len(block), size - sent)])
        sent += min(len(block), size - sent)
"""


def in_namespace(namespace: str | None, code: str, *args: str) -> list[str]:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return [*prefix, sys.executable, "-c", code, *args]


def transfer_mbit(src_ns: str, dst_ns: str, dst_address: str, *, size: int, port: int = 5201) -> float:
    """Send `size` bytes from `src_ns` to `dst_address` in `dst_ns`; the receiver's rate in Mbit/s (20 s at most)."""
    sink = subprocess.Popen(in_namespace(dst_ns, SINK, dst_address, str(port), str(size)), stdout=subprocess.PIPE,
                            text=True)
    try:
        assert sink.stdout is not None
        assert sink.stdout.readline().strip() == "listening"
        subprocess.run(in_namespace(src_ns, SOURCE, dst_address, str(port), str(size)), check=True, timeout=30)
        received, seconds = sink.stdout.readline().split()
        assert int(received) == size
        return int(received) * 8 / float(seconds) / 1e6
    finally:
        try:
            sink.wait(timeout=5)
        except subprocess.TimeoutExpired:
            sink.kill()
            sink.wait()
