"""`TrainingRun`: the few lines a torchrun training script adds to become an elastic HarmonAIze job.

    run = TrainingRun(model_factory=Net, optimizer_factory=lambda params: AdamW(params, lr=1e-3), batch_size=32)
    with run:                                   # process group, plan, model, resume from the latest checkpoint
        while run.running:                      # False once every rank agreed to stop (SIGTERM, max_steps)
            loss = run.train_step(loss_fn)      # loss_fn(model, MicroBatch) -> scalar tensor

One training step is: `gradient_accumulation` micro-batches (gradient sync only on the last), an optimizer step,
then the *step boundary*. At the boundary every rank joins one all-reduce (SUM, float64) of a small vector: its
stop flag, its loss, and, from global rank 0 only, a directive version newer than the last handled (zeros elsewhere,
so the sum is rank 0's values exactly). From the same reduced vector every rank derives the same decisions: stop
after this step, apply or refuse that directive version, checkpoint now. That is what makes "all ranks change at the
same step" true without extra rounds. Then, if due, a checkpoint (see `checkpoint`), then progress (rank 0).
Every worker also tells its host which phase it is in (step, agreement, checkpoint, the script's own code between
steps) through its liveness beat (`liveness`), so the launcher can tell a hung node from one waiting on a peer.

What a checkpoint holds beyond model and optimizer (`trainer.json`): the step, the last applied directives (level
state laid over the script's defaults on resume), the last handled directive version and `checkpoint_requests`
counter (so a restart neither re-applies nor re-checkpoints what it already did), and the recent outcomes.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from types import TracebackType
from typing import Any, Self

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from harmonaize.global_batch import plan_global_batch
from harmonaize.job_runtime import (
    DirectiveOutcome,
    Directives,
    DirectiveState,
    EpochChange,
    Membership,
    NodePhase,
)
from harmonaize.jobs import Compression, ParallelPlan
from workloads.checkpoint import CheckpointIO, checkpoint_name
from workloads.compression import POWERSGD_START_ITER, CompressionSetting, wrap_ddp
from workloads.data import MicroBatch, seeded_generator
from workloads.directives import (
    DirectiveReader,
    Settings,
    decide,
    decode,
    effective_settings,
    encode,
    with_compression_possible,
)
from workloads.dump import dump_mesh, dump_model, dump_replica
from workloads.elastic.group import Formation, MembershipChanged, PeerLost, RendezvousFailed
from workloads.elastic.powersgd import PowerSGD
from workloads.elastic.replica import average_gradients, transfer_state
from workloads.elastic.session import BOUNDARY_SLOTS, InPlaceSession
from workloads.liveness import LivenessBeacon
from workloads.plans import ParallelSetup, plan_parallelism, shard_model
from workloads.progress import ProgressReporter, ThroughputMeter
from workloads.signals import StopFlag
from workloads.spec import RunConfig, default_interval, load_run_config

__all__ = ["LossFn", "TrainingRun"]

LossFn = Callable[[nn.Module, MicroBatch], torch.Tensor]
"""Computes one micro-batch's mean loss: make `batch.size` samples from `batch.generator`, on `batch.device`."""

TRAINER_STATE_FORMAT = 1

_log = logging.getLogger("workloads")


def _parse_time(value: object) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


class TrainingRun:
    """One worker's view of an elastic training job; every method with a collective is called by all ranks alike."""

    def __init__(
        self,
        model_factory: Callable[[], nn.Module],
        optimizer_factory: Callable[[Iterable[nn.Parameter]], Optimizer],
        *,
        batch_size: int,
        gradient_accumulation: int = 1,
        checkpoint_interval_steps: int = 100,
        max_steps: int | None = None,
        seed: int = 0,
        shard_modules: tuple[type[nn.Module], ...] = (),
        keep_checkpoints: int = 3,
        config: RunConfig | None = None,
        install_signal_handlers: bool = True,
    ) -> None:
        """Prepare a run; nothing distributed happens before `start()` (or `with run:`).

        `batch_size` is the per-rank micro-batch size; a global step sees batch_size x gradient_accumulation x
        world_size samples. `checkpoint_interval_steps` is clamped into the tenant's range when a spec is present.
        `shard_modules` are the block types FSDP/HSDP shard one by one (e.g. transformer blocks).
        `install_signal_handlers=False` leaves SIGTERM/SIGINT alone (for runs embedded in another program or a
        test; `request_stop()` still works).
        """
        if batch_size < 1 or gradient_accumulation < 1:
            raise ValueError("batch_size and gradient_accumulation must be at least 1")
        self.config = config if config is not None else load_run_config()
        self._model_factory = model_factory
        self._optimizer_factory = optimizer_factory
        self._shard_modules = shard_modules
        self.max_steps = max_steps
        self.seed = seed
        self._keep = keep_checkpoints
        self.defaults = Settings(
            checkpoint_interval_steps=default_interval(checkpoint_interval_steps, self.config),
            batch_size=batch_size,
            gradient_accumulation=gradient_accumulation,
        )
        self.settings = self.defaults
        self._stop = StopFlag()
        if install_signal_handlers:
            self._stop.install()
        self._created = time.monotonic()
        self._started = False
        self._closed = False
        self._own_process_group = False
        self._running = False
        self._step = 0
        self._loss: float | None = None
        self.resumed_from_step: int | None = None
        self.last_checkpoint_step: int | None = None
        self._handled_version = -1
        self._requests_seen = 0
        self._applied: Directives | None = None
        self._restored_outcomes: list[DirectiveOutcome] = []
        self._meter = ThroughputMeter()
        self._stop_reason = ""
        self._stop_agreed = False
        """The ranks agreed to stop on a request (a new epoch): the run is not over, whatever ends the script."""
        self._session: InPlaceSession | None = None
        """In place (`workloads.elastic`): this worker forms the job's group itself and survives epoch changes."""
        self._powersgd: PowerSGD | None = None
        """In place under PowerSGD: its warm-started factors and error feedback (`workloads.elastic.powersgd`)."""
        self._formation: Formation | None = None
        self._epoch = self.config.epoch
        self._left = False
        """This worker's node left the job (a scale-down in place); the others carry on without it."""
        self._local_loss: float | None = None
        self._agreed = False
        """The boundary of step `_step` has been agreed (its all-reduce returned). With the step, where this rank
        stands: a failure can cut a boundary on some ranks after others got through it (`_progress_mark`)."""
        self._last_rank, self._last_world = 0, 1
        self._epoch_step = 0
        self._change_kind = EpochChange.FRESH
        self._pause_s: float | None = None
        self._saved_at: datetime | None = None
        """When the checkpoint this run resumed from was saved (wall clock: another process saved it)."""
        self.changes: list[dict[str, Any]] = []
        """Every in-place epoch change this worker went through: epoch, world sizes, why, how long the pause was."""
        self.parallel: ParallelSetup
        self._module: nn.Module
        self._model: nn.Module
        self._optimizer: Optimizer
        self._beacon: LivenessBeacon

    # -- public state ---------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True until all ranks agreed to stop (a stop signal on any rank, or `max_steps` reached)."""
        return self._running

    @property
    def step(self) -> int:
        """Optimizer steps completed (the step of the checkpoint this run would save now)."""
        return self._step

    @property
    def in_place(self) -> bool:
        """Epoch changes keep this process and its state (`workloads.elastic`); False under plain torchrun."""
        return self._session is not None

    @property
    def left(self) -> bool:
        """This worker's node left a running job (scale-down in place): the job goes on without it."""
        return self._left

    @property
    def epoch(self) -> int:
        """The provider's placement epoch this worker is in now (changes in place)."""
        return self._epoch

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self._last_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self._last_world

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def model(self) -> nn.Module:
        """The wrapped model (DDP or FSDP); `module` is the plain one inside."""
        return self._model

    @property
    def module(self) -> nn.Module:
        return self._module

    @property
    def optimizer(self) -> Optimizer:
        return self._optimizer

    @property
    def plan(self) -> ParallelPlan:
        """The plan actually used (HSDP falls back to FSDP when locality groups differ in size)."""
        return self.parallel.used

    @property
    def batch_size(self) -> int:
        return self.settings.batch_size

    @property
    def gradient_accumulation(self) -> int:
        return self.settings.gradient_accumulation

    @property
    def loss(self) -> float | None:
        """The last step's loss, averaged over ranks."""
        return self._loss

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(failed=exc_type is not None)

    def start(self) -> Self:
        """Join the process group, build the plan and the model, resume from the latest checkpoint (collective)."""
        if self._started:
            return self
        began = time.monotonic()
        self._beacon = LivenessBeacon(
            self.config.control_dir if self.config.has_spec else None,
            tenant=self.config.tenant,
            job=self.config.job,
            epoch=self.config.epoch,
            local_rank=self.local_rank,
        )
        self._beacon.start()
        try:
            self._start()
        except BaseException:
            self._beacon.stop()
            raise
        self._beacon.enter(NodePhase.SCRIPT)
        self._info(
            "ready at step %d: world %d, plan %s, batch %d x %d, checkpoint every %d (start took %.2f s)",
            self._step, self.world_size, self.plan.value, self.settings.batch_size,
            self.settings.gradient_accumulation, self.settings.checkpoint_interval_steps, time.monotonic() - began,
        )
        return self

    def _start(self) -> None:
        self._device = self._init_process_group()
        self.parallel = plan_parallelism(
            self.config.parallel_plan, self.config.locality_group, device_type=self._device.type
        )
        self._info("plan: %s", self.parallel.describe())
        if self.parallel.fallback_reason:
            self._warn("HSDP not possible: %s", self.parallel.fallback_reason)
        if self._session is not None:
            self._build_model()  # before arriving: the running ranks must not wait for a joiner's model
            self._formation = self._form(self._session.first_membership(self.config.standby_until), step=None)
            if self._formation.source_step is not None:
                self._join_running()
                return
        self._ckpt = self._checkpoint_io()
        latest, trainer_state = self._ckpt.find_latest()
        if trainer_state is not None:
            self._restore_trainer_state(trainer_state)
            self._saved_at = _parse_time(trainer_state.get("saved_at"))
        self.settings = self._runnable(effective_settings(self.defaults, self._applied))
        if self._session is None:
            self._build_model()
        else:
            self._bind_model()
        if latest is not None:
            loaded = time.monotonic()
            app_state = self._app_state()
            self._ckpt.load(latest, app_state)
            set_state_dict(
                self._model, self._optimizer, model_state_dict=app_state["model"], optim_state_dict=app_state["optim"]
            )
            self._step = self.resumed_from_step = self.last_checkpoint_step = latest.step
            self._epoch_step, self._change_kind = latest.step, EpochChange.CHECKPOINT
            dump_model(
                self.config.dump_dir,
                f"loaded-step{latest.step}-world{self.world_size}-{self.plan.value}.pt",
                self._model,
                rank=self.rank,
            )
            self._info(
                "resumed from %s (world %d, %s) in %.2f s", latest.path.name, self.world_size, self.plan.value,
                time.monotonic() - loaded,
            )
        self._ckpt.clean_partials()
        self._begin()

    def _begin(self, *, first_boundary: bool = True) -> None:
        """`first_boundary`: every rank starts together and agrees once before the first step (not a joiner: the
        running ranks are between two steps, not at a start)."""
        if first_boundary:  # collective (a test hook): only where every rank starts together
            dump_mesh(self.config.dump_dir, self.parallel, rank=self.rank, world_size=self.world_size)
        self._rank_helpers(self._restored_outcomes)
        self._started = True
        self._running = True
        self._beacon.stepped(self._step)
        if self._change_kind is EpochChange.CHECKPOINT and self._saved_at is not None:
            # a restart's pause: from the save of the state it resumed (a graceful stop saves at its last step) to now
            self._pause_s = max(0.0, (datetime.now(UTC) - self._saved_at).total_seconds())
        self._report(force=True)
        if first_boundary:
            self._safe_boundary()

    def _join_running(self) -> None:
        """A joiner of a running in-place job: the state (step, settings, parameters) comes from a live peer."""
        assert self._formation is not None
        self._ckpt = self._checkpoint_io()
        self._heal(self._formation)
        self._bind_model()
        self.resumed_from_step = None
        self._epoch_step, self._change_kind = self._step, EpochChange.IN_PLACE
        self._info("joined at step %d from a live peer (world %d)", self._step, self.world_size)
        dump_replica(self.config.dump_dir, f"inplace-e{self._epoch}-rank{self.rank}.pt", self._module)
        self._begin(first_boundary=False)

    def _checkpoint_io(self) -> CheckpointIO:
        return CheckpointIO(
            self.config.checkpoint_dir,
            rank=self.rank,
            world_size=self.world_size,
            keep=self._keep,
            crash_hook=self._crash_hook,
            replicated=self._session is not None,  # in place the plan is DDP: every rank holds the whole state
        )

    def _rank_helpers(self, outcomes: Iterable[DirectiveOutcome]) -> None:
        """What depends on this worker's rank: progress and directives are rank 0's (re-made after a change)."""
        self._progress = ProgressReporter(
            self.config.control_dir,
            tenant=self.config.tenant,
            job=self.config.job,
            epoch=self._epoch,
            enabled=self.rank == 0,
            outcomes=outcomes,
        )
        self._progress.plan_note = self.parallel.describe()
        self._reader = DirectiveReader(self.config.control_dir if self.rank == 0 else None)
        self._last_rank, self._last_world = self.rank, self.world_size

    def close(self, *, failed: bool = False) -> None:
        """Write final progress and leave the process group; after a failure, touch nothing collective.

        Afterwards `model` is the plain module: the DDP/FSDP wrappers (and the HSDP mesh) hold process groups, and
        dropping them here lets gloo's threads be joined now rather than during interpreter shutdown, where a
        late teardown can abort a worker that has already checkpointed and said goodbye.
        """
        if self._closed or not self._started:
            return
        self._closed = True
        if failed or self._left:
            if self._session is not None:
                self._session.close()
            self._beacon.stop()
            return
        self._beacon.enter(NodePhase.STOPPING)
        self._report(force=True)
        self._info("exiting at step %d (%s)", self._step, self._stop_reason or "closed")
        if self._session is not None:
            with contextlib.suppress(MembershipChanged, PeerLost):
                self._session.group.barrier()
            self._session.close()
            self._model = self._module
        elif self._own_process_group and dist.is_initialized():
            dist.barrier()  # leave together: no rank tears down its connections while a peer still talks
            dist.destroy_process_group()
            self._model = self._module
            self.parallel.mesh = None
            gc.collect()
        self._beacon.stop()

    def request_stop(self) -> None:
        """Stop after the current step as if SIGTERM had arrived (agreed at the next boundary, checkpointed)."""
        self._stop.request()

    # -- training -------------------------------------------------------------------------------------------------

    def train_step(self, loss_fn: LossFn) -> float:
        """One optimizer step over `gradient_accumulation` micro-batches, then the step boundary.

        Returns this step's loss averaged over ranks (the same number on every rank).
        """
        if not self._running:
            raise RuntimeError("the run has stopped (check `running` before stepping)")
        start = self._step
        while True:
            try:
                if self._step == start:
                    self._local_loss = self._compute_step(loss_fn)
                if not self._agreed:  # a healed state may have got through this boundary already
                    self._boundary(local_loss=self._local_loss)
                break
            except (MembershipChanged, PeerLost) as exc:
                self._recover(exc)  # the step is redone unless the state it heals to is already past it
                if self._left:
                    break
        self._beacon.enter(NodePhase.SCRIPT)
        return self._loss if self._loss is not None else float("nan")

    def _compute_step(self, loss_fn: LossFn) -> float:
        """Forward, backward, gradient averaging, optimizer step; returns this rank's mean loss."""
        self._beacon.enter(NodePhase.STEP)
        settings = self.settings
        total = 0.0
        for micro in range(settings.gradient_accumulation):
            batch = MicroBatch(
                step=self._step,
                micro=micro,
                rank=self.rank,
                size=settings.batch_size,
                generator=seeded_generator(self.seed, self._step, self.rank, micro),
                device=self._device,
            )
            with self._gradient_sync(micro == settings.gradient_accumulation - 1):
                loss = loss_fn(self._model, batch)
                (loss / settings.gradient_accumulation).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
            total += float(loss.detach())
        if self._session is not None:
            try:
                self._average_in_place(settings)
            except BaseException:
                self._optimizer.zero_grad(set_to_none=True)
                raise
        self._optimizer.step()
        self._optimizer.zero_grad(set_to_none=True)
        self._step += 1
        self._agreed = False
        self._beacon.stepped(self._step)
        self._meter.record(settings.batch_size * settings.gradient_accumulation * self.world_size)
        return total / settings.gradient_accumulation

    def micro_batches(self) -> Iterator[MicroBatch]:
        """The micro-batches the next `train_step` will draw (for scripts that evaluate on the same data)."""
        for micro in range(self.settings.gradient_accumulation):
            yield MicroBatch(
                step=self._step, micro=micro, rank=self.rank, size=self.settings.batch_size,
                generator=seeded_generator(self.seed, self._step, self.rank, micro), device=self._device,
            )

    # -- the step boundary ----------------------------------------------------------------------------------------

    def _safe_boundary(self) -> None:
        """The first boundary of a run or of a joiner: an interrupted one is recovered like a step's."""
        while not self._agreed:
            try:
                self._boundary(local_loss=None)
                return
            except (MembershipChanged, PeerLost) as exc:
                self._recover(exc)
                if self._left:
                    return

    def _boundary(self, *, local_loss: float | None) -> None:
        pending = self._reader.pending(self._handled_version) if self.rank == 0 else None
        slots = self._session.boundary_slots() if self._session is not None else [0.0] * BOUNDARY_SLOTS
        vector = [1.0 if self._stop else 0.0, local_loss or 0.0, *slots, *encode(pending)]
        agreed = torch.tensor(vector, dtype=torch.float64)
        self._beacon.enter(NodePhase.AGREEMENT)
        if self._session is not None:
            self._session.group.allreduce(agreed)
        else:
            dist.all_reduce(agreed, op=dist.ReduceOp.SUM)
        self._agreed = True
        values = agreed.tolist()
        stop = values[0] > 0
        if local_loss is not None:
            self._loss = values[1] / self.world_size
        switch = self._session.switch_now(values[2 : 2 + BOUNDARY_SLOTS]) if self._session is not None else None
        if switch is not None and switch.everyone_leaves:
            stop, switch = True, None  # the job is stopped on every node: checkpoint and exit, as on SIGTERM
            self._stop_reason = self._stop_reason or "every node was told to leave"
        directives = decode(values[2 + BOUNDARY_SLOTS :])
        checkpoint_now = self._handle_directives(directives) if directives is not None else False
        finished = self.max_steps is not None and self._step >= self.max_steps
        if stop and not self._stop_reason:
            self._stop_reason = f"stop requested ({self._stop.signal_name or 'by a peer'})"
        elif finished and not self._stop_reason:
            self._stop_reason = f"max_steps {self.max_steps} reached"
        since = self._step - (self.last_checkpoint_step or 0)
        due = checkpoint_now or stop or finished or since >= self.settings.checkpoint_interval_steps
        saved = False
        if due and self.last_checkpoint_step != self._step and (self._step > 0 or checkpoint_now):
            self._beacon.enter(NodePhase.CHECKPOINT)
            self._save()
            saved = True
        if stop or finished:
            self._running = False
            self._stop_agreed = self._stop_agreed or stop
        self._report(force=saved or directives is not None or not self._running)
        if switch is not None and self._running:
            if switch.leaving:
                self._leave_job(switch.membership)
            else:
                self._change(switch.membership, why=switch.membership.reason or "agreement", urgent=False)

    def _handle_directives(self, directives: Directives) -> bool:
        """Apply or refuse one version (same decision on every rank); True when it asks for a checkpoint now."""
        settings, outcome = decide(
            self.defaults, directives, ranges=self.config.ranges, plan=self.plan, step=self._step
        )
        self._handled_version = directives.version
        self._progress.record_outcome(outcome)
        if outcome.status is DirectiveState.REFUSED:
            reasons = "; ".join(outcome.reasons)
            self._warn("step %d: directives v%d refused: %s", self._step, directives.version, reasons)
            return False
        assert settings is not None
        self._applied = directives
        self._apply_settings(settings)
        checkpoint_now = directives.checkpoint_requests > self._requests_seen
        self._requests_seen = max(self._requests_seen, directives.checkpoint_requests)
        self._info(
            "step %d: directives v%d applied: compression %s%s, batch %d x %d, checkpoint every %d%s",
            self._step, directives.version, settings.compression.value,
            f" rank {settings.powersgd_rank}" if settings.powersgd_rank else "", settings.batch_size,
            settings.gradient_accumulation, settings.checkpoint_interval_steps,
            ", checkpoint now" if checkpoint_now else "",
        )
        return checkpoint_now

    def _apply_settings(self, settings: Settings) -> None:
        settings = self._runnable(settings)
        compression_changed = (settings.compression, settings.powersgd_rank) != (
            self.settings.compression,
            self.settings.powersgd_rank,
        )
        self.settings = settings
        if compression_changed and self.plan is ParallelPlan.DDP and hasattr(self, "_module"):
            old = self._model
            self._model = self._module if self._session is not None else self._wrap_ddp()
            del old

    def _runnable(self, settings: Settings) -> Settings:
        """`settings` minus what the plan in use cannot do (a fp16 directive from DDP days, resumed under FSDP)."""
        if not hasattr(self, "parallel"):
            return settings
        runnable, reason = with_compression_possible(settings, self.parallel.used)
        if reason:
            self._warn("%s", reason)
        return self._keep_global_batch(runnable)

    def _keep_global_batch(self, settings: Settings) -> Settings:
        """`settings` with batch size and accumulation split from the tenant's global batch for the world size now
        (unchanged when the tenant fixed none): the samples per optimizer step survive every resize."""
        ranges = self.config.ranges
        if ranges.global_batch is None or ranges.batch_size is None:
            return settings
        plan = plan_global_batch(ranges.global_batch, world=self.world_size, batch_size=ranges.batch_size,
                                 gradient_accumulation=ranges.gradient_accumulation)
        split = (plan.batch_size, plan.gradient_accumulation)
        if split != (self.settings.batch_size, self.settings.gradient_accumulation):
            (self._info if plan.exact else self._warn)("%s", plan.describe())
        return replace(settings, batch_size=plan.batch_size, gradient_accumulation=plan.gradient_accumulation)

    # -- checkpoints ----------------------------------------------------------------------------------------------

    def _save(self) -> None:
        began = time.monotonic()
        path = self._ckpt.save(self._step, self._app_state(), self._trainer_state())
        self.last_checkpoint_step = self._step
        dump_model(self.config.dump_dir, f"saved-step{self._step}.pt", self._model, rank=self.rank)
        self._info("checkpoint %s saved in %.2f s", path.name, time.monotonic() - began)

    def _app_state(self) -> dict[str, Any]:
        model_state, optim_state = get_state_dict(self._model, self._optimizer)
        return {"model": model_state, "optim": optim_state}

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "format": TRAINER_STATE_FORMAT,
            "step": self._step,
            "checkpoint": checkpoint_name(self._step),
            "world_size": self.world_size,
            "parallel_plan": self.plan.value,
            "seed": self.seed,
            "handled_version": self._handled_version,
            "checkpoint_requests_seen": self._requests_seen,
            "applied_directives": self._applied.model_dump(mode="json") if self._applied is not None else None,
            "outcomes": [outcome.model_dump(mode="json") for outcome in self._progress.outcomes],
            "loss": self._loss,
            "saved_at": datetime.now(UTC).isoformat(),
        }

    def _restore_trainer_state(self, state: dict[str, Any]) -> None:
        if state.get("format") != TRAINER_STATE_FORMAT:
            raise RuntimeError(f"unknown trainer state format {state.get('format')!r}")
        self._handled_version = int(state["handled_version"])
        self._requests_seen = int(state["checkpoint_requests_seen"])
        applied = state.get("applied_directives")
        self._applied = Directives.model_validate(applied) if applied is not None else None
        self._restored_outcomes = [DirectiveOutcome.model_validate(item) for item in state.get("outcomes", [])]
        self._loss = state.get("loss")

    def _crash_hook(self, step: int, point: str) -> None:
        """Test hook (`HZ_RUN_TEST_CRASH_SAVE`): the highest rank dies by SIGKILL at `point` of the save of `step`."""
        if self.config.crash_save == (step, point) and self.rank == self.world_size - 1:
            self._warn("test hook: killing myself during the save of step %d (%s)", step, point)
            for handler in logging.getLogger().handlers:
                handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    # -- plumbing -------------------------------------------------------------------------------------------------

    def _init_process_group(self) -> torch.device:
        """gloo on CPU; on CUDA, NCCL for tensors on the GPU and gloo for the CPU-side agreement and objects.

        In place (a spec with the job's store, plan DDP): the first epoch's group is formed on that store from the
        launcher's membership, not from torchrun's environment.
        """
        if torch.cuda.is_available():
            device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(device)
            backend = "cpu:gloo,cuda:nccl"
        else:
            device = torch.device("cpu")
            backend = "gloo"
        if self.config.in_place and self.config.parallel_plan is ParallelPlan.DDP and not dist.is_initialized():
            assert self.config.store_endpoint is not None and self.config.control_dir is not None
            self._session = InPlaceSession(
                store_endpoint=self.config.store_endpoint, control_dir=self.config.control_dir, backend=backend
            )
            self._own_process_group = True
        elif not dist.is_initialized():
            dist.init_process_group(backend=backend)
            self._own_process_group = True
        return device

    # -- in place: epoch changes without a restart ----------------------------------------------------------------

    def _form(self, membership: Membership, *, step: int | None) -> Formation:
        """Form `membership`'s group, or the newest one announced while trying; raises only on a bad membership."""
        assert self._session is not None
        session = self._session
        while True:
            if not membership.member:
                raise RuntimeError(f"epoch {membership.epoch} does not include this node")
            try:
                epoch = membership.epoch
                formation = session.group.form(
                    membership,
                    step=step,
                    identity=session.identity,
                    interrupted=lambda: session.superseded(epoch),  # noqa: B023 - called here, not kept
                )
            except (MembershipChanged, PeerLost, RendezvousFailed) as exc:
                self._warn("epoch %d could not be formed (%s); waiting for the next", membership.epoch, exc)
                latest = session.watch.wait_newer(membership.epoch, 120.0)
                if latest is None:
                    raise RuntimeError(f"epoch {membership.epoch} failed to form and no newer one came") from exc
                membership = latest
                continue
            self._epoch = membership.epoch
            return formation

    def _heal(self, formation: Formation) -> None:
        """Give every rank rank 0's state unless all of them hold it already (collective, abortable)."""
        if formation.in_sync:
            return
        assert self._session is not None
        began = time.monotonic()
        source = self._snapshot() if self.rank == 0 else None
        state = transfer_state(self._session.group, model=self._module, optimizer=self._optimizer, trainer=source)
        if self.rank != 0:
            self._restore_snapshot(state)
        self._info("state at step %d copied from rank 0 in %.3f s (%d joiner(s), %d holder(s))", self._step,
                   time.monotonic() - began, formation.joiners, formation.survivors)

    def _snapshot(self) -> dict[str, Any]:
        state = self._trainer_state()
        state["settings"] = {
            "checkpoint_interval_steps": self.settings.checkpoint_interval_steps,
            "batch_size": self.settings.batch_size,
            "gradient_accumulation": self.settings.gradient_accumulation,
        }
        state["last_checkpoint_step"] = self.last_checkpoint_step
        state["resumed_from_step"] = self.resumed_from_step
        state["agreed"] = self._agreed
        return state

    def _progress_mark(self) -> int:
        """How far this rank's state is, for choosing the source of a heal: steps taken, and whether the last one's
        boundary was agreed. Two ranks at one step can differ by a boundary (an abandoned all-reduce can complete
        on a peer), and ranks that redid it against ranks that went on would run different collectives."""
        return 2 * self._step + int(self._agreed)

    def _restore_snapshot(self, state: dict[str, Any]) -> None:
        self._restore_trainer_state(state)
        self._step = int(state["step"])
        self._agreed = bool(state.get("agreed", True))
        self.last_checkpoint_step = state.get("last_checkpoint_step")
        self.resumed_from_step = state.get("resumed_from_step")
        self.settings = self._runnable(effective_settings(self.defaults, self._applied))
        if hasattr(self, "_progress"):
            self._progress.outcomes.clear()
            self._progress.outcomes.extend(self._restored_outcomes)

    def _change(self, membership: Membership, *, why: str, urgent: bool) -> None:
        """Move this worker to `membership`'s epoch in place: new group, state healed, helpers re-made."""
        began = time.monotonic()
        old_epoch, old_world, old_step = self._epoch, self._last_world, self._step
        self._beacon.enter(NodePhase.STARTING)
        formation = self._form(membership, step=self._progress_mark())
        self._heal(formation)
        self._ckpt = self._checkpoint_io()
        self._bind_model()
        self.settings = self._runnable(self.settings)
        self._rank_helpers(self._progress.outcomes)
        pause = time.monotonic() - began
        self._epoch_step, self._change_kind, self._pause_s = self._step, EpochChange.IN_PLACE, pause
        self.resumed_from_step = None  # nothing was loaded into this epoch
        dump_replica(self.config.dump_dir, f"inplace-e{self._epoch}-rank{self.rank}.pt", self._module)
        self.changes.append({
            "epoch": self._epoch, "from_epoch": old_epoch, "world": self.world_size, "from_world": old_world,
            "step": self._step, "from_step": old_step, "why": why, "urgent": urgent, "pause_s": round(pause, 4),
        })
        self._info("epoch %d -> %d in place (%s): world %d -> %d at step %d, %.3f s", old_epoch, self._epoch, why,
                   old_world, self.world_size, self._step, pause)
        self._report(force=True)

    def _recover(self, exc: BaseException) -> None:
        """After an abandoned or failed collective: wait for the provider's next epoch and move to it."""
        assert self._session is not None
        self._optimizer.zero_grad(set_to_none=True)
        self._warn("step %d interrupted: %s", self._step, exc)
        membership = self._session.next_membership()
        if not membership.member:
            self._leave_job(membership)
            return
        self._change(membership, why=membership.reason or "failure", urgent=True)

    def _bind_model(self) -> None:
        """In place, the plain module: gradients are averaged (and compressed) by `workloads.elastic`."""
        self._model = self._module

    def _average_in_place(self, settings: Settings) -> None:
        """Average the gradients over the in-place group, abortably (fp16, PowerSGD or none)."""
        assert self._session is not None
        params = [p for p in self._module.parameters() if p.requires_grad]
        if settings.compression is not Compression.POWERSGD:
            average_gradients(self._session.group, params, settings.compression)
            return
        rank = settings.powersgd_rank or 1
        if self._powersgd is None or self._powersgd.rank != rank:
            self._powersgd = PowerSGD(rank, start_iter=POWERSGD_START_ITER, seed=self.seed)
        self._powersgd.average(self._session.group, params)

    def _leave_job(self, membership: Membership) -> None:
        """This node is not in `membership`: stop here without a collective; the others go on."""
        self._info("leaving the job at step %d: epoch %d goes on without this node", self._step, membership.epoch)
        self._left = True
        self._running = False
        if self._session is not None:
            self._session.group.leave()

    def _build_model(self) -> None:
        torch.manual_seed(self.seed)
        self._module = self._model_factory().to(self._device)
        if self._session is not None:
            self._model = self._module  # gradients averaged by `workloads.elastic.replica` (`_bind_model`)
        elif self.plan is ParallelPlan.DDP:
            self._model = self._wrap_ddp()
        else:
            self._model = shard_model(self._module, self.parallel, shard_modules=self._shard_modules)
        self._optimizer = self._optimizer_factory(self._model.parameters())

    def _wrap_ddp(self) -> DistributedDataParallel:
        setting = CompressionSetting(compression=self.settings.compression, powersgd_rank=self.settings.powersgd_rank)
        device_ids = [self._device.index] if self._device.type == "cuda" else None
        return wrap_ddp(self._module, setting, device_ids=device_ids)

    def _gradient_sync(self, sync: bool) -> contextlib.AbstractContextManager[object]:
        """Skip the gradient all-reduce / reduce-scatter on all but the last micro-batch."""
        if isinstance(self._model, DistributedDataParallel):
            return contextlib.nullcontext() if sync else self._model.no_sync()
        set_sync = getattr(self._model, "set_requires_gradient_sync", None)
        if set_sync is not None:
            set_sync(sync)
        return contextlib.nullcontext()

    def _report(self, *, force: bool) -> None:
        settings = self.settings
        self._progress.report(
            force=force,
            step=self._step,
            world_size=self.world_size,
            parallel_plan=self.plan,
            loss=self._loss,
            samples_per_s=self._meter.samples_per_s(),
            resumed_from_step=self.resumed_from_step,
            epoch_step=self._epoch_step,
            change=self._change_kind,
            pause_s=self._pause_s,
            last_checkpoint_step=self.last_checkpoint_step,
            checkpoint_interval_steps=settings.checkpoint_interval_steps,
            compression=settings.compression,
            powersgd_rank=settings.powersgd_rank if settings.compression is Compression.POWERSGD else None,
            batch_size=settings.batch_size,
            gradient_accumulation=settings.gradient_accumulation,
            directives_version=self._handled_version,
            finished=(self._closed or not self._running) and not self._stop_agreed,
        )

    def _info(self, message: str, *args: object) -> None:
        _log.info("[rank %d/%d] " + message, self.rank, self.world_size, *args)

    def _warn(self, message: str, *args: object) -> None:
        _log.warning("[rank %d/%d] " + message, self.rank, self.world_size, *args)
