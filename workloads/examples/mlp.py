"""A small MLP learning a fixed random "teacher" network: the smallest job that shows loss falling, on any plan.

    python -m torch.distributed.run --standalone --nproc-per-node=2 -m workloads.examples.mlp \
        --checkpoint-dir /tmp/mlp-ckpt --max-steps 200
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from workloads.data import MicroBatch
from workloads.examples.common import configure_logging, example_arguments, parse, train
from workloads.trainer import LossFn, TrainingRun

IN, HIDDEN, OUT = 32, 64, 8
TEACHER_SEED = 1234


def make_model(hidden: int = HIDDEN) -> nn.Module:
    """`hidden` sets how much a step communicates: ~hidden² parameters, 4 bytes each, all-reduced per step."""
    return nn.Sequential(
        nn.Linear(IN, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, OUT)
    )


class Teacher:
    """The target function: the same fixed random network on every rank and every restart."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(TEACHER_SEED)
        self.w1 = torch.randn(IN, HIDDEN, generator=generator) / IN**0.5
        self.w2 = torch.randn(HIDDEN, OUT, generator=generator) / HIDDEN**0.5

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = torch.tanh(x @ self.w1.to(x.device)) @ self.w2.to(x.device)
        return y


def make_loss_fn() -> LossFn:
    teacher = Teacher()

    def loss_fn(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
        x = torch.randn(batch.size, IN, generator=batch.generator).to(batch.device)
        return nn.functional.mse_loss(model(x), teacher(x))

    return loss_fn



def main(argv: Sequence[str] | None = None) -> None:
    configure_logging()
    parser = example_arguments("Elastic MLP regression", batch_size=32, lr=3e-3)
    parser.add_argument("--hidden", type=int, default=HIDDEN, help="hidden width (a wider model communicates more)")
    args = parse(parser, argv)
    if not 1 <= args.hidden <= 8192:
        parser.error(f"--hidden must be in 1..8192, got {args.hidden}")
    run = TrainingRun(
        model_factory=lambda: make_model(args.hidden),
        optimizer_factory=lambda params: torch.optim.AdamW(params, lr=args.lr),
        batch_size=args.batch_size,
        gradient_accumulation=args.gradient_accumulation,
        checkpoint_interval_steps=args.checkpoint_interval,
        max_steps=args.max_steps,
        seed=args.seed,
        shard_modules=(nn.Linear,),
    )
    train(run, make_loss_fn(), args)


if __name__ == "__main__":
    main()
