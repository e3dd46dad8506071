"""nats-server configuration for HarmonAIze: accounts per tenant, JetStream, rendered from the tenant registry."""
