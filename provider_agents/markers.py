"""Node markers scoped to one cloud: `<cloud>.<host>.<name>`, e.g. `3f0c9a51d2e7.h1.acme.train.e4`.

Every process of a node carries its marker in its environment (`ENV_NODE_MARKER`), and stopping a node or a whole
host signals every process whose marker matches (`processes`). Two clouds can run on one machine with the same host
names (two `harmonaize up`, or the tests beside a demo), so a marker begins with the id of its cloud: a signal for
host `h1` of one cloud (prefix `<cloud>.h1.`) matches neither its `h10` nor another cloud's `h1`, and a launcher adopts
only its own cloud's nodes.

The cloud id is derived, not configured, from what every process of one cloud already has: the provider secret and
the data dir. The data dir is what tells local clouds apart (`up` locks it, so no two running clouds share one, while
tests and benchmarks reuse fixed secrets); neither may change across an agent restart (the secret by contract, the
data dir because it holds the node state a restarted agent adopts from), so a restarted agent still knows its nodes.
"""

from __future__ import annotations

import hashlib
import hmac
from pathlib import Path

from harmonaize.ids import is_valid_id

__all__ = ["cloud_id", "host_prefix", "node_marker"]

_CLOUD_ID_HEX = 12


def cloud_id(secret: bytes, data_dir: Path) -> str:
    """The id of the cloud with this provider secret and data dir (the same in every one of its processes)."""
    if not secret:
        raise ValueError("a cloud id needs the provider secret (HZ_PROVIDER_SECRET is empty)")
    path = str(Path(data_dir).resolve()).encode()
    return hmac.new(secret, b"hz-cloud-id\0" + path, hashlib.sha256).hexdigest()[:_CLOUD_ID_HEX]


def host_prefix(cloud: str, host: str) -> str:
    """`<cloud>.<host>.`: the start of every marker of `host` in `cloud`, and of no other host's."""
    for kind, value in (("cloud", cloud), ("host", host)):
        if not is_valid_id(value):  # no '.', never empty: otherwise the prefix could reach past one host
            raise ValueError(f"invalid {kind} id {value!r} in a node marker")
    return f"{cloud}.{host}."


def node_marker(cloud: str, host: str, name: str) -> str:
    """The marker of one process group of `host` in `cloud`: a node (`<tenant>.<job>.e<epoch>`) or a warm agent."""
    if not name:
        raise ValueError("a node marker needs a name after the host")
    return host_prefix(cloud, host) + name
