"""The provider's control plane: a FastAPI app over SQLAlchemy 2 async, with the schema owned by Alembic.

Layout, one job per module:
- `app` builds the app (`create_app(settings, broker=...)`); `deps` holds the named dependencies (session, caller);
  `errors` gives every error one JSON shape; `routes/` maps HTTP to services.
- `services/` is the domain logic, importing no FastAPI: tenants (and the broker reconciliation), jobs, hosts, the
  capacity ledger, and the tenant-facing projections (pseudonyms, coarse capacity).
- `models` describes the tables, `schemas` the request and response bodies, `db` the engines, `migrate` runs Alembic.
The API never imports `provider_agents` or `tenant_controllers`; it reaches the broker only through the
`broker_config.accounts.TenantBroker` port it is given.
"""

# `harmonaize.negotiation` and `harmonaize.events` import each other; imported first, `harmonaize.negotiation` fails
# (the events registry needs its enums while it is still half-initialised). Loading the events package first, once,
# here, makes every `api` module safe to import on its own, in any order.
import harmonaize.events  # noqa: E402,F401
