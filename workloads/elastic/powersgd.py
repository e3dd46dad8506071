"""PowerSGD gradient compression over an `ElasticGroup`, so that a compressed step stays abortable in place.

torch's PowerSGD exists only as a DDP communication hook, and DDP waits inside autograd, where no membership change
can reach it: a frozen peer would hold a compressed job until gloo's timeout. This is the same algorithm (Vogels et
al., "PowerSGD: Practical Low-Rank Gradient Compression", NeurIPS 2019; torch's `powerSGD_hook` with warm start and
error feedback) run after `backward()` through the group's abortable all-reduces:

- every gradient with two or more dimensions whose reshaped matrix `M` (n x m) is larger than its rank-r factors
  is compressed: `P = M Q`, all-reduced and orthonormalised, then `Q = M^T P`, all-reduced and averaged, and the
  gradient becomes `P Q^T`; what that leaves out of `M` (error feedback) is added to the next step's gradient;
- everything else (biases, small matrices) is averaged uncompressed, in the same flat all-reduce as the `P`s;
- the first `start_iter` steps of a state are plain averages, as torch's hook does, so the warm-started `Q` starts
  from a useful gradient.

Each step costs two all-reduces of about `r (n + m)` values per matrix instead of one of `n m`. `Q` must be the same
on every rank: it starts from a fixed seed and is then the all-reduced result, so it stays identical. A new group
(any membership change, a joiner with no state of its own) starts a fresh state on every rank alike; the error
feedback of the old epoch is dropped, as torch's hook drops it when DDP is re-wrapped.
"""

from __future__ import annotations

import torch
from torch import nn

from workloads.elastic.group import ElasticGroup
from workloads.elastic.replica import set_gradient

__all__ = ["PowerSGD"]


class PowerSGD:
    """Rank-`rank` PowerSGD with error feedback for one worker's parameters; `average` is a collective."""

    def __init__(self, rank: int, *, start_iter: int = 2, seed: int = 0) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be at least 1, got {rank}")
        self.rank = rank
        self.start_iter = start_iter
        self.seed = seed
        self._epoch: int | None = None
        self._iter = 0
        self._q: dict[int, torch.Tensor] = {}
        self._error: dict[int, torch.Tensor] = {}

    def _reset(self, epoch: int | None) -> None:
        self._epoch, self._iter = epoch, 0
        self._q.clear()
        self._error.clear()

    def _compressible(self, grad: torch.Tensor) -> bool:
        if grad.ndim < 2:
            return False
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        return self.rank * (n + m) < n * m

    def average(self, group: ElasticGroup, parameters: list[nn.Parameter]) -> None:
        """Replace every parameter's gradient by the group's (compressed) mean; raises what the group raises."""
        if group.epoch != self._epoch:
            self._reset(group.epoch)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in parameters]
        warm = self._iter >= self.start_iter
        compress = [i for i, grad in enumerate(grads) if warm and self._compressible(grad)]
        plain = [i for i in range(len(grads)) if i not in set(compress)]
        matrices: dict[int, torch.Tensor] = {}
        ps: list[torch.Tensor] = []
        for i in compress:
            matrix = grads[i].detach().reshape(grads[i].shape[0], -1).float()
            if i in self._error:
                matrix = matrix + self._error[i]
            matrices[i] = matrix
            ps.append(matrix @ self._q_for(i, matrix.shape[1], device=matrix.device))
        sizes = [grads[i].numel() for i in plain] + [p.numel() for p in ps]
        first = torch.cat([grads[i].detach().reshape(-1).float() for i in plain] + [p.reshape(-1) for p in ps])
        group.allreduce(first)
        pieces = list(torch.split(first, sizes))
        for i, piece in zip(plain, pieces, strict=False):
            set_gradient(parameters[i], (piece / group.world_size).view_as(grads[i]))
        if not compress:
            self._iter += 1
            return
        orthonormal = [
            torch.linalg.qr(piece.view_as(p))[0] for piece, p in zip(pieces[len(plain):], ps, strict=True)
        ]
        qs = [matrices[i].t() @ p for i, p in zip(compress, orthonormal, strict=True)]
        second = torch.cat([q.reshape(-1) for q in qs])
        group.allreduce(second)
        second.div_(group.world_size)
        for i, p, q_piece, q in zip(compress, orthonormal, torch.split(second, [q.numel() for q in qs]), qs,
                                    strict=True):
            self._q[i] = q_piece.view_as(q).clone()
            approximation = p @ self._q[i].t()
            self._error[i] = matrices[i] - approximation
            set_gradient(parameters[i], approximation.view_as(grads[i]))
        self._iter += 1

    def _q_for(self, index: int, columns: int, *, device: torch.device) -> torch.Tensor:
        """The warm-started `Q` of matrix `index`: from the fixed seed at first, the same on every rank."""
        q = self._q.get(index)
        if q is None or q.shape != (columns, self.rank):
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
            q = torch.randn(columns, self.rank, generator=generator).to(device)
            self._q[index] = q
        return q

