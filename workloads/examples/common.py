"""What the example jobs share: their command line and their training loop around `TrainingRun`."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Sequence

from workloads.spec import runtime_argument_parser
from workloads.trainer import LossFn, TrainingRun

__all__ = ["example_arguments", "train"]


def example_arguments(description: str, *, batch_size: int, lr: float) -> argparse.ArgumentParser:
    """The examples' flags plus the runtime's (`--checkpoint-dir`, `--control-dir`, `--parallel-plan`, ...)."""
    parser = argparse.ArgumentParser(description=description, parents=[runtime_argument_parser()])
    parser.add_argument(
        "--max-steps", type=int, default=None, help="stop after this step (default: run until stopped)"
    )
    parser.add_argument("--batch-size", type=int, default=batch_size, help="per-rank micro-batch size")
    parser.add_argument("--gradient-accumulation", type=int, default=1)
    parser.add_argument("--checkpoint-interval", type=int, default=100, help="steps (clamped to the tenant's range)")
    parser.add_argument("--lr", type=float, default=lr)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--step-delay-ms", type=float, default=0.0, help="sleep after each step (slows a job for tests)"
    )
    parser.add_argument(
        "--sample-delay-ms", type=float, default=0.0,
        help="sleep this long per sample the rank processed in the step (batch x accumulation): compute that "
             "scales with each worker's share, as on a GPU, where the workers share a CPU",
    )
    parser.add_argument("--log-every", type=int, default=10, help="log the loss every N steps (rank 0)")
    return parser


def train(
    run: TrainingRun,
    loss_fn: LossFn,
    args: argparse.Namespace,
    *,
    on_log: Callable[[int, float], None] | None = None,
) -> None:
    """The whole loop of an example: step until every rank agreed to stop; rank 0 logs `step=N loss=X`."""
    log = logging.getLogger("workloads.examples")
    with run:
        while run.running:
            loss = run.train_step(loss_fn)
            if run.rank == 0 and (run.step % args.log_every == 0 or not run.running):
                log.info("step=%d loss=%.6f world=%d plan=%s", run.step, loss, run.world_size, run.plan.value)
                if on_log is not None:
                    on_log(run.step, loss)
            delay_ms = args.step_delay_ms + args.sample_delay_ms * run.batch_size * run.gradient_accumulation
            if delay_ms > 0 and run.running:
                time.sleep(delay_ms / 1000)


def configure_logging() -> None:
    """Timestamped log lines on stderr (line-buffered, so a SIGKILL loses nothing already logged)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s.%(msecs)03d %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    return parser.parse_args(list(argv) if argv is not None else None)
