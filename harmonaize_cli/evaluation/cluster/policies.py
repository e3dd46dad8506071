"""Who gets how many GPUs, per arm. The three policies share one interface and one tenant rule, so they differ only
in the cooperation: what the provider may see and ask for.

* `FifoStatic` (status quo): first come, first served, each job at the size it asked for, once that many GPUs are
  free. Head-of-line blocking: a job that does not fit stops every job behind it (no backfilling).
* `TenantGreedy` (tenant-side elasticity, no provider): the provider admits as `FifoStatic`; then each running job's
  tenant, oldest first, takes idle GPUs up to its cap. The tenant cannot see the queue, so it gives nothing back
  until the job ends.
* `Negotiated` (cooperative): the provider sees the queue and every job's range [1, cap]. In submission order, jobs
  below their requested size (queued ones included) get GPUs from the free pool, then from jobs above their requested
  size, each shrunk toward it. A queued job that gets nothing there is admitted with one GPU taken from the running
  job that loses least by it, even below its request but never below 1 (`floor_one`; without it, the sensitivity arm
  `cooperative_keep_request`, a queued job waits). GPUs left over are offered by marginal throughput: each goes to
  the job whose throughput rises most per GPU, relative to its throughput at the size it asked for (water filling;
  our own simple policy, in the spirit of goodput-based schedulers, without their statistical-efficiency model).

The tenant rule (both elastic arms): a running job takes more GPUs only if the time it saves on its remaining work
exceeds the pause the rescale costs it on its runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["FifoStatic", "JobView", "Negotiated", "Policy", "TenantGreedy", "worthwhile"]


@dataclass(frozen=True)
class JobView:
    """What a policy knows of a job. `thr[n]`: samples/s at n GPUs (thr[0] = 0), defined up to `cap`."""

    key: int
    submit_s: float
    requested: int
    cap: int
    gpus: int
    remaining: float
    thr: tuple[float, ...]


def worthwhile(job: JobView, gpus: int, pause_s: float) -> bool:
    """The tenant's rule: growing from job.gpus to `gpus` saves more time on the remaining work than it pauses."""
    before, after = job.thr[job.gpus], job.thr[gpus]
    if after <= before:
        return False
    return job.remaining / before - job.remaining / after > pause_s


class Policy(Protocol):
    @property
    def name(self) -> str: ...

    def allocate(self, free: int, running: list[JobView], queued: list[JobView]) -> dict[int, int]:
        """New GPU counts by job key (only for jobs whose count changes). `running` and `queued` in submission
        order; `free` GPUs are unplaced."""
        ...


def _fifo_admit(free: int, queued: list[JobView], alloc: dict[int, int]) -> int:
    for job in queued:
        if job.requested > free:
            break
        alloc[job.key] = job.requested
        free -= job.requested
    return free


def _changes(alloc: dict[int, int], jobs: list[JobView]) -> dict[int, int]:
    return {j.key: alloc[j.key] for j in jobs if j.key in alloc and alloc[j.key] != j.gpus}


@dataclass(frozen=True)
class FifoStatic:
    name: str = "fifo-static"

    def allocate(self, free: int, running: list[JobView], queued: list[JobView]) -> dict[int, int]:
        alloc: dict[int, int] = {}
        _fifo_admit(free, queued, alloc)
        return alloc


@dataclass(frozen=True)
class TenantGreedy:
    grow_pause_s: float
    """What a rescale costs the tenant's job (checkpoint + torchrun restart)."""
    name: str = "tenant-greedy"

    def allocate(self, free: int, running: list[JobView], queued: list[JobView]) -> dict[int, int]:
        alloc: dict[int, int] = {}
        free = _fifo_admit(free, queued, alloc)
        for job in running:
            if free <= 0:
                break
            top = min(job.cap, job.gpus + free)
            best = max(range(job.gpus, top + 1), key=lambda n: (job.thr[n], -n))
            if best > job.gpus and worthwhile(job, best, self.grow_pause_s):
                alloc[job.key] = best
                free -= best - job.gpus
        return alloc


@dataclass(frozen=True)
class Negotiated:
    grow_pause_s: float
    """What an accepted offer costs the tenant's job (our in-place rescale)."""
    floor_one: bool = True
    """A queued job may be admitted with one GPU taken from a running job below its request (never below 1)."""
    name: str = "negotiated"

    def allocate(self, free: int, running: list[JobView], queued: list[JobView]) -> dict[int, int]:
        jobs = {j.key: j for j in running + queued}
        alloc = {j.key: j.gpus for j in running}
        free = self._restore_requests(free, running, queued, jobs, alloc)
        self._water_fill(free, [j for j in jobs.values() if alloc.get(j.key, 0) > 0], alloc)
        return _changes(alloc, list(jobs.values()))

    def _restore_requests(self, free: int, running: list[JobView], queued: list[JobView], jobs: dict[int, JobView],
                          alloc: dict[int, int]) -> int:
        """Submission order: each job below its request gets what the free pool and others' surplus give; a queued
        job that gets nothing there may take one GPU from a running job above one GPU (below its request), when
        `floor_one`."""
        waiting = sorted([j for j in running if j.gpus < j.requested] + queued, key=lambda j: (j.submit_s, j.key))
        for job in waiting:
            need = job.requested - alloc.get(job.key, 0)
            take = min(need, free)
            free -= take
            while take < need:
                donor = self._cheapest(jobs, alloc, floor=lambda j: j.requested)
                if donor is None:
                    break
                alloc[donor] -= 1
                take += 1
            if take == 0 and job.gpus == 0 and self.floor_one:
                donor = self._cheapest(jobs, alloc, floor=lambda j: 1)
                if donor is not None:
                    alloc[donor] -= 1
                    take = 1
            if take == 0:
                if job.gpus == 0:
                    break  # FIFO: no job behind one left waiting jumps it
                continue
            alloc[job.key] = alloc.get(job.key, 0) + take
        return free

    @staticmethod
    def _cheapest(jobs: dict[int, JobView], alloc: dict[int, int], floor: Callable[[JobView], int]) -> int | None:
        """The job above its floor that loses least throughput (relative to its requested size) by giving one GPU
        back."""
        best: tuple[float, int] | None = None
        for key, n in alloc.items():
            job = jobs[key]
            if n > floor(job):
                loss = (job.thr[n] - job.thr[n - 1]) / job.thr[job.requested]
                if best is None or (loss, key) < best:
                    best = (loss, key)
        return None if best is None else best[1]

    def _water_fill(self, free: int, candidates: list[JobView], alloc: dict[int, int]) -> None:
        """Offer the free GPUs by marginal relative throughput; a tenant declining (not worthwhile) is left out and
        the offers are made again without it."""
        base = dict(alloc)
        excluded: set[int] = set()
        while True:
            trial, left = dict(base), free
            while left > 0:
                best: tuple[float, int, int] | None = None
                for job in candidates:
                    if job.key in excluded:
                        continue
                    n = trial[job.key]
                    for m in range(n + 1, min(job.cap, n + left) + 1):
                        gain = (job.thr[m] - job.thr[n]) / job.thr[job.requested] / (m - n)
                        if gain > 0 and (best is None or gain > best[0]):
                            best = (gain, job.key, m)
                if best is None:
                    break
                _, key, m = best
                left -= m - trial[key]
                trial[key] = m
            declined = [j.key for j in candidates if j.gpus > 0 and trial[j.key] > base[j.key]
                        and not worthwhile(j, trial[j.key], self.grow_pause_s)]
            if not declined:
                alloc.update(trial)
                return
            excluded.update(declined)
