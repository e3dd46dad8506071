"""The simulation's inputs as shipped data: the Pollux workloads (what each job asked for, and when) and the hourly
carbon-intensity trace. Read through importlib.resources, so an installed package finds them as well as a checkout.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable

__all__ = ["CarbonTrace", "JobSpec", "carbon_trace", "load_workload", "pollux_data", "workload_ids"]

WORKLOAD_IDS = tuple(range(1, 9))


def pollux_data() -> Traversable:
    """The folder of the Pollux data files (README.md there: source, licence, columns)."""
    return files("harmonaize_cli") / "evaluation" / "data" / "pollux"


def workload_ids() -> tuple[int, ...]:
    return WORKLOAD_IDS


@dataclass(frozen=True)
class JobSpec:
    """One row of a workload: what the user submitted. `requested` GPUs and the global `batch_size` are the job's
    request; the simulation gives its length (`apps.work_samples`), since the workload does not."""

    name: str
    submit_s: float
    app: str
    requested: int
    batch_size: int


def load_workload(number: int) -> list[JobSpec]:
    """`workloads/workload-<number>.csv`, in submission order (ties by name, so the order is fixed)."""
    if number not in WORKLOAD_IDS:
        raise ValueError(f"no Pollux workload {number}: there are {WORKLOAD_IDS[0]}..{WORKLOAD_IDS[-1]}")
    text = (pollux_data() / "workloads" / f"workload-{number}.csv").read_text()
    jobs = [JobSpec(name=row["name"], submit_s=float(row["time"]), app=row["application"],
                    requested=int(row["num_replicas"]), batch_size=int(row["batch_size"]))
            for row in csv.DictReader(text.splitlines())]
    return sorted(jobs, key=lambda j: (j.submit_s, j.name))


@dataclass(frozen=True)
class CarbonTrace:
    """Hourly grid carbon intensity (gCO2eq/kWh). Simulated time 0 is the trace's first hour (2020-01-01 00:00 UTC);
    each hour's value holds for the whole hour (no interpolation); past the end the trace repeats from its start."""

    zone: str
    g_per_kwh: tuple[float, ...]

    def at(self, t_s: float) -> float:
        return self.g_per_kwh[int(t_s // 3600.0) % len(self.g_per_kwh)]


def carbon_trace() -> CarbonTrace:
    """harmonaize/data/carbon/us-cal-ciso-2020-01-01.csv (59 h of CAISO, Electricity Maps via CarbonScaler)."""
    text = (files("harmonaize") / "data" / "carbon" / "us-cal-ciso-2020-01-01.csv").read_text()
    rows = list(csv.DictReader(text.splitlines()))
    return CarbonTrace(zone=rows[0]["zone"], g_per_kwh=tuple(float(r["carbon_intensity_g_per_kwh"]) for r in rows))
