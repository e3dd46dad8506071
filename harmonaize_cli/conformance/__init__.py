"""`harmonaize conformance`: check a provider's tenant event feed against the published interface, as a tenant.

Another provider implementing the HarmonAIze tenant interface (AsyncAPI 3.0 document plus one JSON Schema per event
type, `docs/asyncapi/`) needs a way to show its feed conforms without our code on its side of the wire. This kit
connects with nothing but a tenant's credentials, reads the live feed for a while and checks every message it sees
(the NATS binding, the CloudEvents envelope, the subject against the channel addresses, the payload against the
published schema, ids seen twice), then probes that those credentials reach nothing outside the tenant's slice.

Modules, one job each: `findings` (what a check reports), `interface` (the published documents), `binding` (the NATS
protocol binding), `envelope` (CloudEvents 1.0 attribute rules), `checks` (one received message, end to end),
`probes` (isolation), `feed` (reading the live feed), `report` (text and JSON), `command` (the typer command).
"""
