"""Data parallelism over an `ElasticGroup`: gradient averaging and state transfer from a live peer.

Why not DDP: DDP waits for its gradient all-reduce inside autograd (C++, uninterruptible) and runs collectives of
its own outside any hook (the bucket rebuild at the second forward), so a frozen peer would hold the survivors
there whatever the provider says. Averaging after `backward()` costs the overlap of communication with the
backward pass, which gloo on CPU barely has; in exchange every byte goes through an abortable collective.

Gradients travel as one flat buffer (fp32, or fp16 under fp16 compression: half the bytes, averaged in fp32 again).
A parameter without a gradient on this rank contributes zeros, so every rank's buffer has the same layout.

State transfer: rank 0 (the member furthest along, `group.Formation`) serialises the model's and optimizer's
`state_dict` and the trainer's own state with `torch.save`, broadcasts the length, then the bytes; the others load
them. Loading copies values, so a joiner's parameters equal the source's bitwise.
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.optim import Optimizer

from harmonaize.jobs import Compression
from workloads.elastic.group import ElasticGroup

__all__ = ["average_gradients", "set_gradient", "transfer_state"]


def average_gradients(
    group: ElasticGroup, parameters: Iterable[nn.Parameter], compression: Compression = Compression.NONE
) -> None:
    """Replace every parameter's gradient by its mean over the group (collective, abortable)."""
    params = [p for p in parameters if p.requires_grad]
    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = _flatten_dense_tensors(grads)  # type: ignore[no-untyped-call]  # unannotated in torch
    wire = flat.to(torch.float16) if compression is Compression.FP16 else flat
    group.allreduce(wire)
    if wire is not flat:
        flat.copy_(wire)
    flat.div_(group.world_size)
    for param, averaged in zip(params, _unflatten_dense_tensors(flat, grads), strict=True):  # type: ignore[no-untyped-call]
        set_gradient(param, averaged)


def set_gradient(param: nn.Parameter, value: torch.Tensor) -> None:
    """Make `value` (cast to the parameter's dtype) `param`'s gradient, in place where it has one."""
    value = value.to(param.dtype)
    if param.grad is None:
        param.grad = value.clone()
    else:
        param.grad.copy_(value)


def transfer_state(
    group: ElasticGroup,
    *,
    model: nn.Module,
    optimizer: Optimizer,
    trainer: dict[str, Any] | None,
) -> dict[str, Any]:
    """Broadcast rank 0's model, optimizer and `trainer` state to every rank (collective, abortable).

    Returns the trainer state every rank now holds (rank 0's). Rank 0 passes its `trainer`; the others may pass None.
    """
    length = torch.zeros(1, dtype=torch.int64)
    payload: torch.Tensor
    if group.rank == 0:
        if trainer is None:
            raise ValueError("rank 0 is the source of the state: it must pass its trainer state")
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": optimizer.state_dict(), "trainer": trainer}, buffer)
        payload = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        length[0] = payload.numel()
    group.broadcast(length)
    if group.rank != 0:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    group.broadcast(payload)
    if group.rank == 0:
        assert trainer is not None
        return trainer
    state = torch.load(io.BytesIO(payload.numpy().tobytes()), weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optim"])
    return dict(state["trainer"])
