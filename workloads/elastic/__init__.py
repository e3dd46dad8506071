"""Elastic in place: a job's workers change world size without restarting, driven by the provider's membership.

torchrun restarts every worker when a node joins or leaves, and the job reloads its checkpoint from disk. Here the
processes stay: `membership` follows the launcher's `membership.json` (the provider's word on which epoch the node is
in, and whether a peer failed); `group` forms each epoch's process group on the provider-hosted store and makes
every collective abortable, so a frozen peer (sockets open, no error ever comes) cannot hold the survivors;
`replica` averages gradients through that group and copies the model, optimizer and trainer state from a live peer
to whoever lacks it (a joiner, or a survivor one step behind after an interrupted step).
"""
