"""The top of the stack: the `harmonaize` command and the local cloud it starts.

Everything below it is a part that stands on its own (the contract in `harmonaize`, `broker_config`, `api`,
`provider_agents`, `tenant_controllers`, `workloads`); this package is the one place that imports them together, to
offer them as commands (`main`, `daily`, `services`) and to assemble a whole cloud on one machine (`local_cloud`).
No part imports it.
"""
