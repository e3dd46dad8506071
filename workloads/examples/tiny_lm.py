"""A tiny causal transformer language model on synthetic sequences; a step takes milliseconds on a CPU.

Each sequence is an arithmetic progression modulo the vocabulary with a random start and a random stride (1..4):
unpredictable at the first tokens, fully predictable once the stride is seen, so the loss falls visibly from
ln(VOCAB) towards the entropy of the first two tokens. The transformer blocks are what FSDP/HSDP shard one by one.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m workloads.examples.tiny_lm \
        --checkpoint-dir /tmp/lm-ckpt --max-steps 300 --parallel-plan fsdp
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from workloads.data import MicroBatch
from workloads.examples.common import configure_logging, example_arguments, parse, train
from workloads.trainer import TrainingRun

VOCAB = 32
CONTEXT = 24
WIDTH = 64
HEADS = 4
LAYERS = 2
MAX_STRIDE = 4


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, HEADS, WIDTH // HEADS).unbind(dim=2)
        attended = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, WIDTH))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.zeros(CONTEXT, WIDTH))
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits for every position, flattened to (batch * length, VOCAB).

        Flat because a 2-D matmul returns a fresh tensor, where a 3-D one returns a view, which FSDP2 warns about.
        """
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.norm(x).reshape(-1, WIDTH))
        return logits


def synthetic_sequences(count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` progressions of CONTEXT + 1 tokens: (start + stride * i) mod VOCAB."""
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    stride = torch.randint(1, MAX_STRIDE + 1, (count, 1), generator=generator)
    return (start + stride * torch.arange(CONTEXT + 1)) % VOCAB


def loss_fn(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    tokens = synthetic_sequences(batch.size, batch.generator).to(batch.device)
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits, tokens[:, 1:].reshape(-1))


def main(argv: Sequence[str] | None = None) -> None:
    configure_logging()
    args = parse(example_arguments("Elastic tiny transformer LM", batch_size=16, lr=3e-3), argv)
    run = TrainingRun(
        model_factory=TinyLM,
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=args.lr),
        batch_size=args.batch_size,
        gradient_accumulation=args.gradient_accumulation,
        checkpoint_interval_steps=args.checkpoint_interval,
        max_steps=args.max_steps,
        seed=args.seed,
        shard_modules=(Block,),
    )
    train(run, loss_fn, args)


if __name__ == "__main__":
    main()
