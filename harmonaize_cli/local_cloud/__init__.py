"""A whole cloud on one machine: broker, API, simulated hosts with their agents, the provider's loops (`launcher`,
`fleet`), and the demo story told inside it (`demo`)."""
