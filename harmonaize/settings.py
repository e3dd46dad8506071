"""One settings class for every HarmonAIze process.

Built at start-up by whoever owns the process (the CLI, the app factory, a test) and passed down explicitly; nothing
reads the environment at import time, so tests can build as many differently-configured instances as they like.
Every field is read from an `HZ_`-prefixed environment variable (or a `.env` file), e.g. `HZ_DATABASE_URL`.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from harmonaize.broker_sync import check_sync_interval
from harmonaize.event_loop import EventLoopChoice, resolve_event_loop
from harmonaize.ids import validate_id


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
