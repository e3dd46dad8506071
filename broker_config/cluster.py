"""A 3-node nats-server cluster on loopback: the same accounts, JetStream replicated across nodes.

Used to show (and test) that an R3 stream keeps accepting publishes when a node, even the stream's leader, dies. The
accounts file is static per node here: runtime tenant changes must be written to every node's accounts file and each
node reloaded (the local cloud runs a single node).
"""

from __future__ import annotations

from pathlib import Path

from broker_config.render import ClusterOptions
from broker_config.server import NatsServer, free_port


def local_cluster(directory: Path, *, accounts_text: str, size: int = 3, name: str = "hz") -> list[NatsServer]:
    """Build (not start) `size` servers that route to each other on loopback."""
    host = "127.0.0.1"
    route_ports = [free_port(host) for _ in range(size)]
    routes = [f"nats-route://{host}:{p}" for p in route_ports]
    return [
        NatsServer(
            Path(directory) / f"n{i}",
            accounts_text=accounts_text,
            host=host,
            server_name=f"{name}-n{i}",
            cluster=ClusterOptions(name=name, host=host, port=route_ports[i], routes=tuple(routes)),
        )
        for i in range(size)
    ]


def start_all(servers: list[NatsServer], *, timeout: float = 30.0) -> None:
    """Start every node; each accepts clients before the cluster has formed, so callers wait for JetStream.

    If a node cannot start, the ones already running are stopped before the error goes on: the caller never got the
    cluster, so nothing else would stop them.
    """
    started: list[NatsServer] = []
    try:
        for server in servers:
            server.start(timeout=timeout)
            started.append(server)
    except BaseException:
        for server in reversed(started):
            server.stop()
        raise
