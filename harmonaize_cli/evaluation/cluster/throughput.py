"""Samples per second of a job at n GPUs, from the Pollux measurements (`throughput/<app>/*.csv`).

A job at n GPUs runs on the most compact placement of n GPUs on 4-GPU nodes (full nodes, then the rest on one node:
6 GPUs = 4 + 2). Up to 16 GPUs that placement is measured in `placements.csv` (keyed by its smallest rotation,
`24` for 4 + 2). Beyond, `scalability.csv` has full-node placements at 24, 32, 48 and 64 GPUs; sizes between two of
them are interpolated linearly in n at the same per-GPU batch. Within a placement the step time is interpolated
linearly in the per-GPU batch and clamped to the measured range; duplicate measurements are averaged.

Simplification: no fragmentation. The simulation counts GPUs, not nodes, and assumes the compact placement is always
available, in every arm alike.
"""

from __future__ import annotations

import csv
from bisect import bisect_right
from collections import defaultdict
from dataclasses import dataclass
from functools import cache

from harmonaize_cli.evaluation.cluster.trace import pollux_data

__all__ = ["GPUS_PER_NODE", "AppThroughput", "Curve", "compact_placement", "load_throughput", "placement_key"]

GPUS_PER_NODE = 4
MAX_PLACEMENT_GPUS = 16
"""Largest placement in placements.csv (4 nodes x 4 GPUs)."""


def compact_placement(n: int, per_node: int = GPUS_PER_NODE) -> tuple[int, ...]:
    """GPUs per node for n GPUs packed on as few nodes as possible."""
    if n < 1:
        raise ValueError(f"a placement needs at least one GPU, not {n}")
    full, rest = divmod(n, per_node)
    return (per_node,) * full + ((rest,) if rest else ())


def placement_key(placement: tuple[int, ...]) -> str:
    """placements.csv's key: the digits of the placement's lexicographically smallest rotation."""
    rotations = [placement[i:] + placement[:i] for i in range(len(placement))]
    return "".join(map(str, min(rotations)))


@dataclass(frozen=True)
class Curve:
    """Step time (s) against per-GPU batch for one placement, sorted by batch."""

    bsz: tuple[float, ...]
    step_s: tuple[float, ...]

    @property
    def lo(self) -> float:
        return self.bsz[0]

    @property
    def hi(self) -> float:
        return self.bsz[-1]

    def step_time(self, local_bsz: float) -> float:
        b = min(max(local_bsz, self.lo), self.hi)
        i = bisect_right(self.bsz, b)
        if i >= len(self.bsz):
            return self.step_s[-1]
        if i == 0:
            return self.step_s[0]
        x0, x1, y0, y1 = self.bsz[i - 1], self.bsz[i], self.step_s[i - 1], self.step_s[i]
        return y0 + (y1 - y0) * (b - x0) / (x1 - x0)


def _curve(points: list[tuple[float, float]]) -> Curve:
    by_bsz: dict[float, list[float]] = defaultdict(list)
    for b, s in points:
        by_bsz[b].append(s)
    xs = sorted(by_bsz)
    return Curve(bsz=tuple(xs), step_s=tuple(sum(by_bsz[x]) / len(by_bsz[x]) for x in xs))


@dataclass(frozen=True)
class AppThroughput:
    """One application's measured step times, by GPU count (compact placements only)."""

    app: str
    curves: dict[int, Curve]

    @property
    def max_gpus(self) -> int:
        return max(self.curves)

    @property
    def min_local_bsz(self) -> float:
        return min(c.lo for c in self.curves.values())

    def _bracket(self, n: int) -> tuple[int, int]:
        if n in self.curves:
            return n, n
        sizes = sorted(self.curves)
        i = bisect_right(sizes, n)
        if i == 0 or i >= len(sizes):
            raise ValueError(f"{self.app}: no throughput for {n} GPUs (measured {sizes[0]}..{sizes[-1]})")
        return sizes[i - 1], sizes[i]

    def local_batch(self, n: int, global_batch: float) -> float:
        """The per-GPU batch at n GPUs: the job's global batch split evenly, clamped to what was measured there."""
        lo_n, hi_n = self._bracket(n)
        lo = max(self.curves[lo_n].lo, self.curves[hi_n].lo)
        hi = min(self.curves[lo_n].hi, self.curves[hi_n].hi)
        return min(max(global_batch / n, lo), hi)

    def step_time(self, n: int, local_bsz: float) -> float:
        lo_n, hi_n = self._bracket(n)
        if lo_n == hi_n:
            return self.curves[n].step_time(local_bsz)
        w = (n - lo_n) / (hi_n - lo_n)
        return (1 - w) * self.curves[lo_n].step_time(local_bsz) + w * self.curves[hi_n].step_time(local_bsz)

    def samples_per_s(self, n: int, global_batch: float) -> float:
        """Throughput at n GPUs for a job that asked for `global_batch`: n x per-GPU batch / step time."""
        local = self.local_batch(n, global_batch)
        return n * local / self.step_time(n, local)


def _rows(app: str, name: str) -> list[dict[str, str]]:
    text = (pollux_data() / "throughput" / app / name).read_text()
    return list(csv.DictReader(text.splitlines()))


@cache
def load_throughput(app: str) -> AppThroughput:
    """`placements.csv` for the compact placements of 1..16 GPUs, `scalability.csv` for full nodes beyond."""
    by_key: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for row in _rows(app, "placements.csv"):
        by_key[row["placement"]].append((float(row["local_bsz"]), float(row["step_time"])))
    curves: dict[int, Curve] = {}
    for n in range(1, MAX_PLACEMENT_GPUS + 1):
        key = placement_key(compact_placement(n))
        if key not in by_key:
            raise ValueError(f"{app}: placements.csv has no row for placement {key} ({n} GPUs)")
        curves[n] = _curve(by_key[key])
    by_size: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for row in _rows(app, "scalability.csv"):
        nodes, replicas = int(row["num_nodes"]), int(row["num_replicas"])
        if replicas == nodes * GPUS_PER_NODE and replicas > MAX_PLACEMENT_GPUS:
            by_size[replicas].append((float(row["local_bsz"]), float(row["step_time"])))
    curves.update({n: _curve(points) for n, points in by_size.items()})
    return AppThroughput(app=app, curves=curves)
