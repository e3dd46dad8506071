"""`harmonaize eval`: what cooperation buys, measured with our own runs.

- `runtime/`: scenarios on the real runtime (real jobs, gloo on CPU) in one local cloud, on the testbed where this
  machine can build it: O6 carbon, O2/O4 congestion, O5 reliability.
- `cluster/`: a simulation at cluster scale (O3, O5) replaying the Pollux workloads, its per-action costs read from
  our own `bench/bench_elastic.py` JSON.
- `results` (the one shape every scenario reports in), `report` and `plots` (report.md and the PNGs), `run` (the
  whole evaluation), `command` (the CLI's options).
"""
