"""The evaluation's scenarios on the real runtime: real jobs (small models, gloo on CPU) in one local cloud."""
