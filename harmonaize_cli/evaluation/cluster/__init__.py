"""The cluster simulation of `harmonaize eval`: O3 (job completion time) and O5 (reliability at scale) on a simulated
64-GPU cluster replaying the Pollux workloads, and a Monte-Carlo of one 16,384-GPU job at the Llama 3 failure rates.

One module per job: `trace` (workloads, carbon), `apps` (each application's work), `throughput` (samples/s at n
GPUs), `costs` (action costs from bench_elastic.py's JSON), `failures` (event rates and streams), `energy`,
`policies` (who gets how many GPUs), `arms` (policy + costs per arm), `simulator` (the discrete-event simulation),
`large_job` (the Monte-Carlo), `scenarios` (the ScenarioResults), `plots`.
"""

from harmonaize_cli.evaluation.cluster.plots import plot_cluster
from harmonaize_cli.evaluation.cluster.scenarios import run_cluster_scenarios

__all__ = ["plot_cluster", "run_cluster_scenarios"]
