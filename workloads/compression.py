"""Gradient compression for DDP through communication hooks: none, fp16, or PowerSGD of a given rank.

A DDP module accepts `register_comm_hook` only once, so switching compression re-wraps the same underlying module
in a fresh DDP (which re-broadcasts rank 0's parameters, identical anyway, and starts a fresh PowerSGD state: its
error feedback is not carried across a switch or a restart). FSDP and HSDP reduce gradients themselves and have no
such hook, which is why the directive logic refuses compression under them.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from harmonaize.jobs import Compression

__all__ = ["POWERSGD_START_ITER", "CompressionSetting", "wrap_ddp"]

POWERSGD_START_ITER = 2
"""Vanilla all-reduce for the first step after a switch: the least DDP allows with error feedback and warm start."""


@dataclass(frozen=True)
class CompressionSetting:
    """What DDP should do to gradients before the all-reduce."""

    compression: Compression = Compression.NONE
    powersgd_rank: int | None = None


def wrap_ddp(
    module: nn.Module, setting: CompressionSetting, *, device_ids: list[int] | None
) -> DistributedDataParallel:
    """A new DDP around `module` with the communication hook for `setting` registered (collective)."""
    ddp = DistributedDataParallel(module, device_ids=device_ids)
    if setting.compression is Compression.FP16:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(state=None, hook=default_hooks.fp16_compress_hook)
    elif setting.compression is Compression.POWERSGD:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=setting.powersgd_rank or 1,
            start_powerSGD_iter=POWERSGD_START_ITER,
        )
        ddp.register_comm_hook(state=state, hook=powerSGD_hook.powerSGD_hook)
    return ddp
