"""Render nats-server configuration from the tenant registry.

Isolation comes from accounts, not from per-user permissions (docs/building-blocks.md: inside one account, a user
allowed to create JetStream consumers can read any subject). The layout:

* `PROVIDER` holds one events stream per tenant, `HZ_T_<tenant>` over `hz.t.<tenant>.>`, and all `hz.p.>` traffic.
  Agents and the control plane connect here; a PubAck from that stream means the event is stored where its tenant
  reads it (one copy, no replication hop that a crash could cut).
* `T_<tenant>`, one account per tenant, without JetStream of its own. The provider exports to that account alone
  (`accounts: [...]`) the tenant's live slice, the pull API of consumers on the tenant's stream (`MSG.NEXT`, `INFO`),
  the stream's `INFO`, and the ack subjects. The API appears in the tenant account under `$JS.hz.API` (see
  TENANT_JS_PREFIX). The tenant's user may use exactly those and subscribe to its slice; it
  cannot publish into any `hz.` subject.
* Consumers are created by the provider on the tenant's request (the control plane validates the filter lies inside
  the tenant's slice and makes them pull consumers). Tenants cannot reach the consumer-create API because a consumer
  on a provider stream may be a *push* consumer whose delivery subject lies in the provider's account: a tenant able
  to create one could deliver its messages into `hz.t.<other>.…` and forge another tenant's events.

Alternatives tried and dropped: each tenant account *sourcing* its slice into a JetStream stream of its own (two copies
of every event, a sourcing consumer to keep alive, and the same push-consumer problem on the create API it needs); a
plain stream import into a tenant stream (the provider's PubAck would come from its own copy only, so a crash could
lose the tenant's).

The main file is written once per server (listen address, JetStream store, cluster) and includes the accounts file;
tenant changes rewrite only the accounts file and reload the server (SIGHUP), which keeps connections up.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from broker_config.accounts import TenantAccount
from broker_config.keys import ProviderKeys
from harmonaize.broker_sync import SYNC_ALWAYS, check_sync_interval
from harmonaize.ids import validate_id
from harmonaize.subjects import tenant_slice

PROVIDER_ACCOUNT = "PROVIDER"
SYSTEM_ACCOUNT = "SYS"
ACCOUNTS_FILE = "accounts.conf"
TENANT_JS_PREFIX = "$JS.hz.API"
"""Where a tenant account sees the provider's JetStream API: `nc.jetstream(prefix=TENANT_JS_PREFIX)`.

A distinct prefix is needed because an account without JetStream of its own answers every `$JS.API.>` request itself
("JetStream not enabled for account"), racing the imported reply.
"""


def tenant_account_name(tenant: str) -> str:
    return f"T_{validate_id('tenant', tenant)}"


def tenant_stream_name(tenant: str) -> str:
    """The provider-side stream that holds one tenant's events (and only that tenant's)."""
    return f"HZ_T_{validate_id('tenant', tenant)}"


def _tenant_api(tenant: str) -> list[tuple[str, str, bool]]:
    """(provider subject, tenant subject, streamed response) of the JetStream API a tenant may use on its stream."""
    stream = tenant_stream_name(tenant)
    api = [
        (f"STREAM.INFO.{stream}", False),
        (f"CONSUMER.INFO.{stream}.*", False),
        # A pull request is answered by up to `batch` messages: the response must be allowed to stream.
        (f"CONSUMER.MSG.NEXT.{stream}.*", True),
    ]
    return [(f"$JS.API.{s}", f"{TENANT_JS_PREFIX}.{s}", streamed) for s, streamed in api] + [
        (f"$JS.ACK.{stream}.>", f"$JS.ACK.{stream}.>", False)
    ]


def _tenant_user_permissions(tenant: str) -> dict[str, Any]:
    return {
        "publish": {"allow": [local for _, local, _ in _tenant_api(tenant)]},
        "subscribe": {"allow": ["_INBOX.>", tenant_slice(tenant)]},
    }


def render_accounts(keys: ProviderKeys, tenants: Sequence[TenantAccount]) -> str:
    """The accounts file: SYS, PROVIDER and one account per tenant, with exports restricted to their tenant."""
    exports: list[dict[str, Any]] = []
    accounts: dict[str, Any] = {}
    for t in sorted(tenants, key=lambda t: t.tenant):
        name = tenant_account_name(t.tenant)
        exports.append({"stream": tenant_slice(t.tenant), "accounts": [name]})
        imports: list[dict[str, Any]] = [{"stream": {"account": PROVIDER_ACCOUNT, "subject": tenant_slice(t.tenant)}}]
        for subject, local, streamed in _tenant_api(t.tenant):
            export: dict[str, Any] = {"service": subject, "accounts": [name]}
            if streamed:
                export["response_type"] = "stream"
            exports.append(export)
            service: dict[str, Any] = {"service": {"account": PROVIDER_ACCOUNT, "subject": subject}}
            if local != subject:
                service["to"] = local
            imports.append(service)
        accounts[name] = {
            "users": [{"nkey": t.user_public_key, "permissions": _tenant_user_permissions(t.tenant)}],
            "imports": imports,
        }
    all_accounts: dict[str, Any] = {
        SYSTEM_ACCOUNT: {"users": [{"nkey": keys.system.public_key}]},
        PROVIDER_ACCOUNT: {"jetstream": "enabled", "users": [{"nkey": keys.provider.public_key}], "exports": exports},
        **accounts,
    }
    body = json.dumps(all_accounts, indent=2)
    return f"# Rendered by HarmonAIze from the tenant registry; do not edit.\naccounts: {body}\n"


def _sync_value(value: str) -> str:
    return value if value == SYNC_ALWAYS else json.dumps(value)


@dataclass(frozen=True)
class ClusterOptions:
    """A server's place in a cluster: its route listener and the routes to its peers."""

    name: str
    host: str
    port: int
    routes: Sequence[str] = field(default_factory=tuple)


@dataclass(frozen=True)
class ServerOptions:
    """What the main config file of one nats-server says."""

    host: str
    port: int
    store_dir: Path
    server_name: str = "hz-nats"
    pid_file: Path | None = None
    http_port: int | None = None
    cluster: ClusterOptions | None = None
    max_payload: str = "1MB"
    sync_interval: str = SYNC_ALWAYS
    """JetStream's fsync policy: `always` (fsync before every PubAck) or a period such as `10s` (see below)."""

    def __post_init__(self) -> None:
        check_sync_interval(self.sync_interval)


def render_server(opts: ServerOptions) -> str:
    """The main config file: listener, JetStream (file store, fsync policy) and the accounts include."""
    lines = [
        "# Rendered by HarmonAIze; the accounts file beside it is re-rendered when tenants change.",
        f"server_name: {json.dumps(opts.server_name)}",
        f"host: {json.dumps(opts.host)}",
        f"port: {opts.port}",
        f"max_payload: {opts.max_payload}",
        "jetstream {",
        f"  store_dir: {json.dumps(str(opts.store_dir))}",
        # Acknowledged writes survive an OS crash only when each write is fsynced (docs/building-blocks.md).
        # A period must be a quoted string: nats-server reads a bare `2m` as the number 2,000,000.
        f"  sync_interval: {_sync_value(opts.sync_interval)}",
        "}",
        f"system_account: {SYSTEM_ACCOUNT}",
    ]
    if opts.pid_file is not None:
        lines.append(f"pid_file: {json.dumps(str(opts.pid_file))}")
    if opts.http_port is not None:
        lines.append(f"http: {json.dumps(f'{opts.host}:{opts.http_port}')}")
    if opts.cluster is not None:
        c = opts.cluster
        lines += [
            "cluster {",
            f"  name: {json.dumps(c.name)}",
            f"  listen: {json.dumps(f'{c.host}:{c.port}')}",
            f"  routes: {json.dumps(list(c.routes))}",
            "}",
        ]
    lines.append(f'include "{ACCOUNTS_FILE}"')
    return "\n".join(lines) + "\n"


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` so that a server reloading concurrently never reads half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
