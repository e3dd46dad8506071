"""The energy model of the evaluation, applied the same way to every arm: power per GPU as a linear function of its
utilisation between idle and TDP, the common first-order model of GPU power (and the one the simulated hosts report
their power with). The local cloud's GPUs are simulated, so a worker's utilisation is not read off a device: a GPU
of a job counts as busy (utilisation 1) while the job steps and idle while it is placed but not stepping (launch,
rescale, recovery). Carbon is energy times the grid's intensity at the time the energy is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GpuPowerModel", "H100_SXM"]


@dataclass(frozen=True)
class GpuPowerModel:
    name: str
    tdp_w: float
    idle_fraction: float = 0.1
    """Idle power as a fraction of TDP (the simulated hosts' figure)."""

    def watts(self, utilisation: float) -> float:
        """One GPU's draw at `utilisation` in [0, 1]."""
        u = min(max(utilisation, 0.0), 1.0)
        idle = self.idle_fraction * self.tdp_w
        return idle + u * (self.tdp_w - idle)

    def joules(self, gpus: float, utilisation: float, seconds: float) -> float:
        return gpus * self.watts(utilisation) * seconds

    @staticmethod
    def grams_co2(joules: float, g_per_kwh: float) -> float:
        return joules / 3.6e6 * g_per_kwh

    def describe(self) -> str:
        return (f"{self.name}: {self.tdp_w:g} W at full utilisation, {self.idle_fraction * self.tdp_w:g} W idle, "
                "linear in between; GPUs only (host CPUs, memory, network and cooling (PUE) are left out, the same "
                "for every arm)")


H100_SXM = GpuPowerModel(name="H100 SXM (the simulated hosts' GPU)", tdp_w=700.0)
