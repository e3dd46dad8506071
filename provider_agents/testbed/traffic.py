"""Cross-traffic on the testbed: another tenant's bulk TCP flow between two groups' neighbours, over the shaped uplinks.

A congestion episode in a scenario is only a number in a simulated host's telemetry; on the testbed it is made real,
so the agents measure the congestion from the link counters and a job's traffic is really slowed. The flow runs
between the *neighbours* (`layout.TestbedNeighbour`), never between hosts, because a congested link is one the fleet
shares with someone else. Each flow is two processes (a sink in the destination neighbour's namespace, a source in
the source's), both bounded in time and bytes by themselves, so a flow whose owner died still ends.

Markers: both processes carry `<cloud>._traffic.<src>.<dst>.<token>.<role>` in `ENV_NODE_MARKER` (`markers`,
`processes`), so `stop_all(cloud)` kills every flow of one cloud by prefix and nothing of another cloud's. `_traffic`
stands where a host id stands in a node marker and cannot be one (an id starts with a letter or a digit), so a signal
to a host's prefix (`<cloud>.<host>.`) never reaches a flow, and `stop_all`'s prefix never reaches a host's process.
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import select
import signal
import subprocess
import sys

from harmonaize.ids import is_valid_id
from harmonaize.job_runtime import ENV_NODE_MARKER
from provider_agents.processes import signal_marked
from provider_agents.testbed.commands import TestbedError
from provider_agents.testbed.layout import CLOUD_HEX, TestbedLayout
from provider_agents.testbed.links import all_counters

__all__ = ["TRAFFIC_HOST", "CrossTraffic", "stop_all", "traffic_prefix"]

log = logging.getLogger(__name__)

TRAFFIC_HOST = "_traffic"
"""Where a host id stands in a node marker; not a valid host id, so no host's marker prefix matches a flow's."""
START_TIMEOUT_S = 10.0
"""How long `start` waits for the sink to listen (an `ip netns exec` of Python takes well under a second)."""
SINK_GRACE_S = 3.0
"""The sink outlives the source's time bound by this much (the source starts after it and connects late)."""
STOP_WAIT_S = 5.0

assert not is_valid_id(TRAFFIC_HOST)

SINK = r"""
import socket, sys, time
address, peer, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
end = time.monotonic() + seconds
server = socket.create_server((address, 0))
print("listening", server.getsockname()[1], flush=True)
while True:  # the source's connection only: another machine of the data plane is turned away
    server.settimeout(max(0.01, end - time.monotonic()))
    try:
        conn, (host, _) = server.accept()
    except OSError:
        sys.exit(0)
    if host == peer:
        break
    conn.close()
server.close()
with conn:
    while (left := end - time.monotonic()) > 0:
        conn.settimeout(left)
        try:
            if not conn.recv(1 << 18):
                break
        except OSError:
            break
"""

SOURCE = r"""
import socket, sys, time
address, port, seconds, limit, mbit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]), \
    float(sys.argv[5])
start = time.monotonic()
end = start + seconds
rate = mbit * 1e6 / 8
block = bytes(min(1 << 16, max(1448, int(rate * 0.005))) if rate else 1 << 16)
sent = 0
try:
    with socket.create_connection((address, port), timeout=min(5.0, seconds)) as conn:
        while sent < limit and (now := time.monotonic()) < end:
            ahead = sent / rate - (now - start) if rate else 0.0
            if ahead > 0:
                time.sleep(min(ahead, end - now))
                continue
            size = min(len(block), limit - sent)
            conn.settimeout(max(0.01, end - now))
            conn.sendall(block[:size])
            sent += size
except OSError:
    pass
"""


def traffic_prefix(cloud: str) -> str:
    """`<cloud>._traffic.`: the start of the marker of every cross-traffic process of `cloud`, and of nothing else."""
    if len(cloud) != CLOUD_HEX or any(c not in "0123456789abcdef" for c in cloud):
        raise ValueError(f"a testbed cloud id is {CLOUD_HEX} hex characters, got {cloud!r}")
    return f"{cloud}.{TRAFFIC_HOST}."


def stop_all(cloud: str) -> list[int]:
    """Kill every cross-traffic process of `cloud` (whoever started it); the pids signalled."""
    killed = signal_marked(traffic_prefix(cloud), signal.SIGKILL, prefix=True)
    if killed:
        log.info("testbed %s: killed %d cross-traffic process(es)", cloud, len(killed))
    return killed


class CrossTraffic:
    """One bulk TCP flow from `src_group`'s neighbour to `dst_group`'s, through both groups' uplinks.

    `mbit`: paced to that rate (None: as fast as TCP goes, saturating the narrower uplink). It ends by itself after
    `max_seconds` or `max_bytes` (default: the rate asked, or the source uplink's current rate, times `max_seconds`),
    whichever comes first; `stop` ends it sooner. Each flow listens on its own port (the sink binds port 0).
    """

    def __init__(
        self,
        layout: TestbedLayout,
        src_group: str,
        dst_group: str,
        *,
        mbit: float | None = None,
        max_seconds: float,
        max_bytes: int | None = None,
    ) -> None:
        if src_group == dst_group:
            raise ValueError(f"cross-traffic needs two different groups, got {src_group!r} twice")
        self.source = layout.neighbour(src_group)
        self.sink = layout.neighbour(dst_group)
        if mbit is not None and not 0 < mbit <= 10_000:
            raise ValueError(f"a cross-traffic rate must be in (0, 10000] Mbit/s, got {mbit}")
        if not 0 < max_seconds <= 24 * 3600:
            raise ValueError(f"a cross-traffic flow lasts (0, 24h], got {max_seconds} s")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"a cross-traffic flow sends at least one byte, got max_bytes={max_bytes}")
        self.layout = layout
        self.src_group = src_group
        self.dst_group = dst_group
        self.mbit = mbit
        self.max_seconds = max_seconds
        self.max_bytes = max_bytes
        self.marker = f"{traffic_prefix(layout.cloud)}{src_group}.{dst_group}.{secrets.token_hex(4)}."
        """The prefix of both processes' markers (`<role>` follows: `sink`, `source`)."""
        self.port: int | None = None
        self._processes: list[subprocess.Popen[str]] = []

    def __repr__(self) -> str:
        rate = "saturating" if self.mbit is None else f"{self.mbit} Mbit/s"
        return f"CrossTraffic({self.src_group}->{self.dst_group}, {rate}, {self.max_seconds:.1f} s)"

    @property
    def running(self) -> bool:
        """Either process still lives (`False` before `start` and once the flow ended or was stopped)."""
        return any(process.poll() is None for process in self._processes)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes if process.poll() is None]

    def _limit_bytes(self) -> int:
        if self.max_bytes is not None:
            return self.max_bytes
        mbit = self.mbit
        if mbit is None:
            try:
                end = self.layout.uplink(self.src_group)[0]
                mbit = all_counters(self.layout.fabric)[end].rate_bps / 1e6 or None
            except (TestbedError, ValueError, KeyError):
                mbit = None
        return max(1, math.ceil((mbit or self.layout.uplink_mbit) * 1e6 / 8 * self.max_seconds))

    def _spawn(self, namespace: str, role: str, code: str, *args: str) -> subprocess.Popen[str]:
        env = {**os.environ, ENV_NODE_MARKER: self.marker + role}
        command = ["ip", "netns", "exec", namespace, sys.executable, "-c", code, *args]
        process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
        self._processes.append(process)
        return process

    def start(self) -> None:
        """Start the sink, wait (at most `START_TIMEOUT_S`) until it listens, then start the source. Blocking."""
        if self._processes:
            raise RuntimeError(f"{self!r} was started already; a flow runs once")
        limit = self._limit_bytes()
        sink = self._spawn(self.sink.namespace, "sink", SINK, self.sink.data_address,
                           self.source.data_address, str(self.max_seconds + SINK_GRACE_S))
        try:
            self.port = _read_port(sink, START_TIMEOUT_S)
            self._spawn(self.source.namespace, "source", SOURCE, self.sink.data_address, str(self.port),
                        str(self.max_seconds), str(limit), str(self.mbit or 0.0))
        except BaseException:
            self.stop()
            raise
        log.debug("testbed %s: cross-traffic %s started (port %d, at most %d bytes, markers %s*)",
                 self.layout.cloud, self, self.port, limit, self.marker)

    def stop(self) -> None:
        """Kill both processes (and any other carrying this flow's marker) and reap them. Idempotent."""
        for process in self._processes:
            if process.poll() is None:
                process.kill()
        signal_marked(self.marker, signal.SIGKILL, prefix=True)
        for process in self._processes:
            try:
                process.wait(timeout=STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                log.warning("testbed %s: cross-traffic process %d outlived SIGKILL", self.layout.cloud, process.pid)
            if process.stdout is not None:
                process.stdout.close()


def _read_port(sink: subprocess.Popen[str], timeout_s: float) -> int:
    """The port from the sink's `listening <port>` line, within `timeout_s`."""
    assert sink.stdout is not None
    ready, _, _ = select.select([sink.stdout], [], [], timeout_s)
    if not ready:
        raise TestbedError(f"the cross-traffic sink did not listen within {timeout_s:.0f} s")
    line = sink.stdout.readline().split()
    if len(line) != 2 or line[0] != "listening":
        raise TestbedError(f"the cross-traffic sink did not start (exit {sink.poll()}, said {line!r})")
    return int(line[1])

