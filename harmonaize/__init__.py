"""HarmonAIze's shared contract: ids, events, subjects and settings.

Everything here is imported by every other part (provider agents, the API, tenant controllers, workloads), so it
imports no FastAPI, SQLAlchemy, NATS or torch: a tenant's controller or a training script can depend on the contract
without pulling in the provider's stack. A test enforces that rule.
"""

__version__ = "0.1.0"
