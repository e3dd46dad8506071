"""One settings class for every HarmonAIze process.

Built at start-up by whoever owns the process (the CLI, the app factory, a test) and passed down explicitly; nothing
reads the environment at import time, so tests can build as many differently-configured instances as they like.
Every field is read from an `HZ_`-prefixed environment variable (or a `.env` file), e.g. `HZ_DATABASE_URL`.
A setting that switches an agent's input on (`HZ_CLOUD_NOTICES`, `HZ_CARBON_API`) makes what that input needs
required, checked on the missing field itself, so the error names the variable to set.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from harmonaize.broker_sync import check_sync_interval
from harmonaize.event_loop import EventLoopChoice, resolve_event_loop
from harmonaize.ids import validate_id

CloudNotices = Literal["none", "azure", "aws", "gcp"]
CarbonApi = Literal["none", "watttime", "electricitymaps"]

_VM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", re.ASCII)
"""Azure VM and scale-set instance names (`myVm_0`), AWS instance ids, GCP instance names."""
_WATTTIME_REGION = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,63}", re.ASCII)
_ZONE = re.compile(r"[A-Z]{2,3}(-[A-Z0-9]{1,10}){0,3}", re.ASCII)
"""A public grid zone key, as `harmonaize.events.carbon.RegionCode` (not imported: every command builds Settings)."""


class Settings(BaseSettings):
    """Configuration shared by the API, the broker helpers, agents and controllers."""

    model_config = SettingsConfigDict(env_prefix="HZ_", env_file=".env", extra="ignore")

    data_dir: Path = Field(
        default=Path(".hz"),
        description="Where the local cloud keeps its state: SQLite database, JetStream store, rendered broker config.",
    )
    database_url: str = Field(
        default="",
        description="SQLAlchemy async URL. Empty means SQLite at <data_dir>/harmonaize.db. "
        "PostgreSQL: postgresql+asyncpg://user@host:5432/db",
    )
    database_ping_after_idle_s: float = Field(
        default=0.5,
        ge=0,
        le=3600,
        description="PostgreSQL: a pooled connection idle at least this long is pinged (SELECT 1) before a request "
        "gets it, so one a database restart killed is replaced first; 0 pings before every request.",
    )
    admin_token: SecretStr | None = Field(
        default=None, description="Bearer token for the provider's admin routes (creating tenants, hosts)."
    )
    provider_secret: SecretStr | None = Field(
        default=None,
        description="The provider's root secret. Its NATS keys and per-tenant pseudonyms are derived from it; "
        "keep it stable across restarts.",
    )
    nats_url: str = Field(default="nats://127.0.0.1:4222", description="Where the broker listens.")
    broker_config_file: Path | None = Field(
        default=None,
        description="nats-server config the control plane re-renders when tenants change. Empty: "
        "<data_dir>/broker/nats.conf.",
    )
    broker_pid_file: Path | None = Field(
        default=None,
        description="pid file of the nats-server to signal for a config reload. Empty: <data_dir>/broker/nats.pid.",
    )
    broker_sync_interval: str = Field(
        default="always",
        description="JetStream fsync policy of the broker HarmonAIze starts or renders: 'always' (an acknowledged "
        "event survives an OS crash; one fsync per event) or a period like 10s (events of the last period can be "
        "lost if the broker's host crashes; lower latency where fsync is slow).",
    )
    tenant_stream_max_bytes: int = Field(
        default=128 << 20,
        ge=1 << 20,
        le=1 << 40,
        description="Each tenant's event stream quota in bytes (the oldest events go first when it is full). The "
        "broker reserves it per tenant when the stream is made, so tenants x quota must fit its JetStream storage.",
    )
    broker_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="Replicas of every JetStream stream and bucket the provider creates (tenant event streams, the "
        "desired-state and rendezvous buckets): 3 on a 3-node broker, so losing a node loses none of them. A bucket "
        "found with fewer replicas is scaled up; none is ever scaled down.",
    )
    event_loop: EventLoopChoice = Field(
        default="auto",
        description="The event loop HarmonAIze's long-running processes (API, agents, controllers, the local cloud) "
        "run on: 'auto' (uvloop where it is installed, as it is by default outside Windows; asyncio's own otherwise), "
        "'uvloop' (an error where it cannot be imported) or 'asyncio'.",
    )
    api_host: str = Field(default="127.0.0.1", description="Address the API binds to.")
    api_port: int = Field(default=8080, ge=0, le=65535, description="Port the API binds to (0: any free port).")
    api_url: str = Field(default="", description="Where tenants reach the API. Empty: http://<api_host>:<api_port>.")
    api_max_body_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        le=64 * 1024 * 1024,
        description="Largest request body the API reads; larger ones get 413. The largest real body is ~40 KB.",
    )
    api_token_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="Seconds a tenant token, once verified, is trusted without reading the database again. A "
        "revocation ends it at once on the replica that revoked; other replicas honour it within this time. 0: "
        "read on every request.",
    )
    negotiation_rate_per_s: float = Field(
        default=20.0,
        ge=0,
        le=1_000_000,
        description="Negotiation writes (open, accept, counter, reject, cancel) a tenant may make per second, "
        "sustained; over it: 429 with Retry-After. 0 turns the limit off (benchmarks).",
    )
    negotiation_burst: int = Field(
        default=200,
        ge=1,
        le=1_000_000,
        description="Negotiation writes a tenant may make at once before the rate applies.",
    )
    metrics_token: SecretStr | None = Field(
        default=None,
        description="A scrape-only bearer token for GET /v1/metrics, so Prometheus need not hold the admin token "
        "(which also works).",
    )
    tenant: str | None = Field(default=None, description="A tenant controller's tenant id.")
    tenant_token: SecretStr | None = Field(default=None, description="A tenant controller's API token.")
    tenant_nats_seed: SecretStr | None = Field(
        default=None, description="A tenant controller's NATS user nkey seed (shown once at tenant creation)."
    )
    cloud_notices: CloudNotices = Field(
        default="none",
        description="Where a host agent reads its cloud's maintenance and preemption notices: 'none', 'azure' "
        "(Scheduled Events), 'aws' (IMDSv2: Spot interruptions, rebalance recommendations, scheduled events) or "
        "'gcp' (metadata server: maintenance-event, preempted, upcoming-maintenance).",
    )
    cloud_metadata_url: str | None = Field(
        default=None,
        description="Base URL of the cloud's metadata service. Empty: the cloud's documented address (Azure and AWS "
        "http://169.254.169.254, GCP http://metadata.google.internal).",
    )
    cloud_vm_name: str | None = Field(
        default=None,
        validate_default=True,
        description="This VM as the cloud's notices name it: the Azure VM or scale-set instance name, the AWS "
        "instance id, the GCP instance name. Required when HZ_CLOUD_NOTICES is not 'none'.",
    )
    nvsentinel_url: str | None = Field(
        default=None,
        description="URL serving NVIDIA NVSentinel's recent health events for this node (a JSON list, or "
        '{"events": [...]}); a host agent adds them to its GPU failures. Empty: not read.',
    )
    nvsentinel_node: str | None = Field(
        default=None,
        description="The node name NVSentinel's events carry for this host (its Kubernetes node name). Empty: the "
        "agent's --host-id.",
    )
    carbon_api: CarbonApi = Field(
        default="none",
        description="Live grid carbon intensity for a host agent: 'none' (the scenario's curve, by default a replayed "
        "trace), 'watttime' (marginal emissions, co2_moer) or 'electricitymaps' (average intensity). While the API "
        "has no fresh reading, the curve stands in.",
    )
    carbon_api_url: str | None = Field(
        default=None,
        description="Base URL of the carbon API. Empty: the service's documented address (WattTime "
        "https://api.watttime.org, Electricity Maps https://api.electricitymap.org).",
    )
    watttime_username: str | None = Field(
        default=None, validate_default=True, description="WattTime account name. Required with HZ_CARBON_API=watttime."
    )
    watttime_password: SecretStr | None = Field(
        default=None,
        validate_default=True,
        description="WattTime account password. Required with HZ_CARBON_API=watttime.",
    )
    watttime_region: str | None = Field(
        default=None,
        validate_default=True,
        description="The WattTime region the host draws from, e.g. CAISO_NORTH; its readings are reported as the "
        "host's grid zone (--region). Required with HZ_CARBON_API=watttime.",
    )
    electricitymaps_token: SecretStr | None = Field(
        default=None,
        validate_default=True,
        description="Electricity Maps API key (sent as auth-token). Required with HZ_CARBON_API=electricitymaps.",
    )
    electricitymaps_zone: str | None = Field(
        default=None,
        description="The Electricity Maps zone key the host draws from, e.g. DE. Empty: the host's grid zone "
        "(--region).",
    )

    @field_validator("broker_sync_interval")
    @classmethod
    def _sync_interval_is_known(cls, value: str) -> str:
        return check_sync_interval(value)

    @field_validator("event_loop")
    @classmethod
    def _event_loop_can_run(cls, value: str) -> str:
        if value == "uvloop":
            resolve_event_loop(value)  # where it cannot be imported: refused here, with the install hint
        return value

    @field_validator("tenant")
    @classmethod
    def _tenant_is_an_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_id("tenant", value)

    @field_validator("cloud_metadata_url", "nvsentinel_url", "carbon_api_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        value = _given(value)
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise PydanticCustomError("http_url", "expected an http:// or https:// URL with a host")
        return value

    @field_validator("cloud_vm_name")
    @classmethod
    def _vm_name_when_notices_are_on(cls, value: str | None, info: ValidationInfo) -> str | None:
        value = _required(_given(value), info, switch="cloud_notices")
        if value is not None and not _VM_NAME.fullmatch(value):
            raise PydanticCustomError("vm_name", "expected a VM name or instance id (letters, digits, . _ -)")
        return value

    @field_validator("nvsentinel_node")
    @classmethod
    def _node_name(cls, value: str | None) -> str | None:
        value = _given(value)
        if value is not None and len(value) > 200:
            raise PydanticCustomError("node_name", "longer than 200 characters")
        return value

    @field_validator("watttime_username", "watttime_region")
    @classmethod
    def _watttime_value(cls, value: str | None, info: ValidationInfo) -> str | None:
        value = _required(_given(value), info, switch="carbon_api", when="watttime")
        if info.field_name == "watttime_region" and value is not None and not _WATTTIME_REGION.fullmatch(value):
            raise PydanticCustomError("watttime_region", "expected a WattTime region such as CAISO_NORTH")
        return value

    @field_validator("watttime_password")
    @classmethod
    def _watttime_secret(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        return _required_secret(value, info, switch="carbon_api", when="watttime")

    @field_validator("electricitymaps_token")
    @classmethod
    def _electricitymaps_secret(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        return _required_secret(value, info, switch="carbon_api", when="electricitymaps")

    @field_validator("electricitymaps_zone")
    @classmethod
    def _zone_key(cls, value: str | None) -> str | None:
        value = _given(value)
        if value is not None and not _ZONE.fullmatch(value):
            raise PydanticCustomError("zone", "expected a public grid zone key such as DE or US-CAL-CISO")
        return value

    @property
    def resolved_database_url(self) -> str:
        """The database URL, defaulting to SQLite inside the data dir."""
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'harmonaize.db').as_posix()}"

    @property
    def resolved_broker_config_file(self) -> Path:
        return self.broker_config_file or self.data_dir / "broker" / "nats.conf"

    @property
    def resolved_broker_pid_file(self) -> Path:
        return self.broker_pid_file or self.data_dir / "broker" / "nats.pid"

    @property
    def resolved_api_url(self) -> str:
        return self.api_url or f"http://{self.api_host}:{self.api_port}"


def _given(value: str | None) -> str | None:
    """A value as set, without surrounding blanks; an empty variable counts as not set."""
    value = value.strip() if value is not None else None
    return value or None


def _required(value: str | None, info: ValidationInfo, *, switch: str, when: str | None = None) -> str | None:
    """`value`, or an error naming the setting that asks for it: `switch` set to `when` (or to anything but 'none').

    A field validator rather than a model validator, so the error's location is the missing variable itself.
    """
    chosen = info.data.get(switch)  # absent when the switch itself was invalid: that is the error to report
    needed = chosen is not None and chosen != "none" and (when is None or chosen == when)
    if value is None and needed:
        raise PydanticCustomError(
            "required_by", "required when HZ_{switch}={chosen}", {"switch": switch.upper(), "chosen": chosen}
        )
    return value


def _required_secret(value: SecretStr | None, info: ValidationInfo, *, switch: str, when: str) -> SecretStr | None:
    given = value if value is not None and value.get_secret_value().strip() else None
    _required(None if given is None else "(secret)", info, switch=switch, when=when)
    return given
