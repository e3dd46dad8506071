"""The drop-in runtime for elastic PyTorch training scripts under HarmonAIze.

A torchrun script wraps its model and optimizer factories in a `TrainingRun` and steps with `train_step`; the
runtime does the rest: the parallel plan from the launcher's `WorkerSpec` (DDP, FSDP2, or HSDP grouped by locality),
atomic DCP checkpoints (periodic, on request, on SIGTERM) and resume resharded to any world size and plan, provider
directives applied by all ranks at the same step boundary, and progress for the provider and the tenant.

One module per concern: `spec` (configuration), `checkpoint` (directory protocol + DCP), `plans` (mesh and
wrapping), `compression` (DDP hooks), `directives` (read, agree, decide), `progress` (JobProgress writer),
`signals` (graceful stop), `data` (seeded micro-batches), `dump` (test hook), `trainer` (the loop around them).
The package imports only torch, numpy, pydantic, the standard library and the shared contract `harmonaize`.
"""

from workloads.data import MicroBatch
from workloads.spec import RunConfig, SpecError, load_run_config, runtime_argument_parser
from workloads.trainer import LossFn, TrainingRun

__all__ = [
    "LossFn",
    "MicroBatch",
    "RunConfig",
    "SpecError",
    "TrainingRun",
    "load_run_config",
    "runtime_argument_parser",
]
