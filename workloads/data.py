"""Deterministic per-step data: every micro-batch is drawn from a generator seeded by (seed, step, rank, micro).

A run resumed from the checkpoint of step N at the same world size draws exactly the batches an unbroken run would
have drawn from step N on; at another world size each rank still gets a reproducible, distinct stream. The runtime
keeps no data-loader position in its checkpoints because there is none to keep.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["MicroBatch", "seeded_generator"]


def seeded_generator(seed: int, step: int, rank: int, micro: int) -> torch.Generator:
    """A CPU generator whose stream depends only on the four numbers (mixed by numpy's SeedSequence)."""
    state = np.random.SeedSequence([seed, step, rank, micro]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


@dataclass(frozen=True)
class MicroBatch:
    """What a loss function needs to make its micro-batch: how many samples, from which generator, onto which device.

    `size` is the per-rank micro-batch size currently in effect (a directive may change it between steps).
    """

    step: int
    micro: int
    rank: int
    size: int
    generator: torch.Generator
    device: torch.device
