"""Energy and carbon of a simulated run, the same model for every arm.

Power: the evaluation's linear GPU model (`harmonaize_cli.evaluation.energy.GpuPowerModel`) with the T4's 70 W TDP,
the GPU the Pollux throughput traces were measured on (AWS g4dn.12xlarge nodes, 4 x T4). A GPU placed with a job that
is stepping counts as busy (utilisation 1); a GPU placed with a job that stands still (launch, rescale, recovery) and
every unplaced GPU of the 64 count as idle, from time 0 to the run's makespan (the cluster is on for the whole
workload). GPU board power only: host, network and cooling (PUE) are left out, alike for every arm.

Carbon: energy times the grid intensity of the hour it is drawn in; simulated time 0 is the first hour of the CAISO
trace (`trace.carbon_trace`). No arm defers work for carbon: energy and carbon are reported, not optimised.
"""

from __future__ import annotations

from dataclasses import dataclass

from harmonaize_cli.evaluation.cluster.trace import CarbonTrace
from harmonaize_cli.evaluation.energy import GpuPowerModel

__all__ = ["T4", "EnergyMeter"]

T4 = GpuPowerModel(name="NVIDIA T4 (the GPU of the Pollux measurements)", tdp_w=70.0)


@dataclass
class EnergyMeter:
    """Accumulates joules and grams of CO2 over intervals in which the carbon intensity is constant."""

    power: GpuPowerModel
    carbon: CarbonTrace
    joules: float = 0.0
    grams: float = 0.0

    def add(self, t0: float, busy_gpu_s: float, idle_gpu_s: float) -> None:
        """GPU-seconds busy and idle in an interval starting at t0 that stays within one hour of the trace."""
        j = self.power.joules(1.0, 1.0, busy_gpu_s) + self.power.joules(1.0, 0.0, idle_gpu_s)
        self.joules += j
        self.grams += self.power.grams_co2(j, self.carbon.at(t0))

    @property
    def kwh(self) -> float:
        return self.joules / 3.6e6

    @property
    def kg_co2(self) -> float:
        return self.grams / 1000.0
