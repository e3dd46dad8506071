"""The provider's control plane: a FastAPI app over SQLAlchemy 2 async, with the schema owned by Alembic.

Layout, one job per module:
- `app` builds the app (`create_app(settings, broker=...)`); `deps` holds the named dependencies (session, caller);
  `errors` gives every error one JSON shape; `routes/` maps HTTP to services.
- `services/` is the domain logic, importing no FastAPI: tenants (and the broker reconciliation), jobs, hosts, the
  capacity ledger and the desired state it implies per host, negotiations (lifecycle table, store, history, the pure
  provider policy and its carbon forecast, idempotency keys), the transactional outbox and its relay, the sweeper,
  and the tenant-facing projections (pseudonyms, coarse capacity).
- `models` describes the tables, `schemas` the request and response bodies, `db` the engines, `migrate` runs Alembic,
  `options` the negotiation knobs (clock, offer lifetime, carbon forecast).
- `limits` bounds request bodies (413) and the pace of negotiation writes per tenant (429); `observability` adds the
  access log, request ids, trace context and Prometheus metrics (`GET /v1/metrics`); `log_context` holds the ids that
  every JSON log line carries.
The API never imports `provider_agents` or `tenant_controllers`; it reaches the broker only through the ports it is
given: `broker_config.accounts.TenantBroker` (tenant accounts) and `broker_config.provider_bus.ProviderBus` (events
and desired state, published by the outbox relay).
"""
