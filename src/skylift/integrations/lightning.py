"""skylift for a Lightning script: one callback, one resume helper.

::

    from skylift.integrations.lightning import SkyliftCallback, resume_checkpoint

    trainer = lightning.Trainer(..., callbacks=[SkyliftCallback()])   # or SkyliftCallback("run.yaml")
    trainer.fit(model, loader, ckpt_path=resume_checkpoint(trainer))

The callback starts skylift's preemption watch when training starts (taking SIGTERM
and SIGUSR1 over from Lightning's own handler, which would end the fit with an
exception instead of a checkpoint). On a notice all ranks stop at the same step:
``trainer.save_checkpoint`` writes ``step-N/lightning.ckpt``, skylift seals the folder
(``manifest.json`` written last), mirrors it to an object-store root, sets
``trainer.should_stop`` and ends the process with 143. It also saves on the
``checkpoint`` section's cadence (``every_steps``, ``every_minutes``, ``save_at_end``),
keeping ``checkpoint.keep`` of them. :func:`resume_checkpoint` returns the newest
complete one for ``ckpt_path=`` (torn ones skipped, a newer mirrored one restored).
Every full checkpoint Lightning writes elsewhere (a ``ModelCheckpoint``'s) is
hard-linked into ``step-N/`` and sealed as it is written, so resume uses it too. The
callback refuses a launch Lightning did not join into one process group
(``devices="auto"`` on the CPU under ``skylift launch --nproc 2``) and holds the run lease.

Metrics: the training loss of every step (averaged over ranks) and the scalars in
``trainer.callback_metrics``, with the system sampler, step breakdown, cost ledger,
guards and exporters; MFU where the LightningModule states ``flops_per_batch`` (the
attribute Lightning's own ``ThroughputMonitor`` reads).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from skylift.checkpoint.manifest import MANIFEST
from skylift.config.schema import RunConfig
from skylift.errors import EXIT_OK
from skylift.integrations.checkpoints import FolderCheckpoints, unseal
from skylift.integrations.commit import checkpoints_under, commit, lease_root, newest_complete
from skylift.integrations.run import BatchCount, FrameworkJob, ScriptRun, check_process_group, resolve_config
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.monitor.metrics import RESERVED_TRAIN_FIELDS

__all__ = ["CHECKPOINT_FILE", "PREFIX", "SkyliftCallback", "resume_checkpoint"]

log = logging.getLogger("skylift")

PREFIX = "step-"
"""skylift's Lightning checkpoint folders: ``CHECKPOINTS/step-<global step>``."""

CHECKPOINT_FILE = "lightning.ckpt"
"""What ``trainer.save_checkpoint`` writes in each folder."""


class SkyliftCallback(pl.Callback):
    """Spot survival, complete checkpoints and skylift's monitoring for a Lightning ``Trainer``.

    Args:
        config: a run configuration: the path of its YAML file, a
            :class:`~skylift.config.RunConfig`, or ``None`` for the defaults (run folder
            ``runs/default``). Its ``preemption``, ``monitor`` and ``checkpoint`` sections
            apply; ``SKYLIFT_RUN_DIR`` and ``SKYLIFT_CHECKPOINT_ROOT`` win.
        exit_on_stop: after a preemption (or a guard's stop) end the process with 143
            (or 3) once the checkpoint is complete. With False, ``fit`` returns and
            :attr:`exit_code` says what to do.
    """

    def __init__(self, config: RunConfig | str | os.PathLike[str] | None = None, *, exit_on_stop: bool = True) -> None:
        self.config = resolve_config(config, default_run_dir=None)
        self.checkpoints: FolderCheckpoints = checkpoints_under(PREFIX, self.config)
        self.exit_on_stop = exit_on_stop
        self.run: ScriptRun | None = None
        self.exit_code: int | None = None
        """Once training ended: 0, 143 (preempted: run again to resume) or 3 (a guard stopped it)."""
        self._batches = BatchCount(0, 0, 0)
        self._last_step = -1
        self._last_saved_step: int | None = None
        self._last_save_s = time.monotonic()
        self._eval_names: set[str] = set()
        self._names_before_eval: set[str] = set()

    @property
    def stopped(self) -> str | None:
        """Why the run stopped early (``preemption notice``, ``guard``), else None."""
        return self.run.stopped if self.run is not None else None

    # -- Lightning's hooks --------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        nodes = int(os.environ.get("WORLD_SIZE", "1") or 1) // max(processes, 1)
        fix = (f'Pass Trainer(devices={processes}, strategy="ddp"' + (f", num_nodes={nodes}" if nodes > 1 else "")
               + '): with devices="auto" on the CPU (or fewer devices than processes) Lightning runs each launched '
               "process alone.")
        check_process_group("the Lightning Trainer", trainer.world_size, fix=fix)
        strategy = trainer.strategy
        if isinstance(strategy.checkpoint_io, AsyncCheckpointIO):
            log.warning("Lightning writes checkpoints in the background (AsyncCheckpointIO): skylift seals only "
                        "its own, not ModelCheckpoint's")
        elif not isinstance(strategy.checkpoint_io, _SealingCheckpointIO):
            strategy.checkpoint_io = _SealingCheckpointIO(strategy.checkpoint_io, self)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if isinstance(trainer.strategy.checkpoint_io, _SealingCheckpointIO):
            trainer.strategy.checkpoint_io = trainer.strategy.checkpoint_io.inner

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        context = DistributedContext(rank=trainer.global_rank, world_size=trainer.world_size,
                                     local_rank=trainer.local_rank, device=pl_module.device, backend=_backend())
        accumulation = trainer.accumulate_grad_batches
        loader = trainer.train_dataloader
        job = FrameworkJob("Lightning Trainer", getattr(loader, "batch_size", None),
                           data_num_workers=getattr(loader, "num_workers", 0) or 0,
                           settings={"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs,
                                     "accumulate_grad_batches": accumulation, "precision": str(trainer.precision),
                                     "strategy": type(trainer.strategy).__name__})
        self.run = ScriptRun(self.config, context, precision=_precision(str(trainer.precision)),
                             micro_steps=accumulation, job=job, exit_on_stop=self.exit_on_stop)
        self.run.take_lease(lease_root(self.checkpoints, self.config, default=Path(self.config.run_dir)),
                           job_name="lightning")
        self._batches = BatchCount.of(loader, per_rank_batch=getattr(loader, "batch_size", None) or 1,
                                      world_size=trainer.world_size, accumulation=accumulation)
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else (
            self._batches.steps_per_epoch * (trainer.max_epochs or 1))
        step = trainer.global_step
        self._last_step = step
        state = TrainState(total_steps=total, steps_per_epoch=self._batches.steps_per_epoch,
                           global_batch_size=self._batches.global_batch, step=step, epoch=trainer.current_epoch,
                           samples_seen=self._batches.samples_at(step))
        self.run.start(state, resumed_from_step=step if trainer.ckpt_path else None)
        self._last_save_s = time.monotonic()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if self.run is not None and batch_idx % trainer.accumulate_grad_batches == 0:
            self.run.step_begin()

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        if self.run is not None:
            self.run.mark("forward_backward")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        run = self._require_run()
        step = trainer.global_step
        if step == self._last_step:
            return  # a micro-batch of an accumulation group: no optimizer step yet
        self._last_step = step
        run.mark("optimizer")
        self._count_flops(pl_module, step)
        stopped = run.step_end(step, epoch=trainer.current_epoch, samples_seen=self._batches.samples_at(step),
                               lr=_learning_rate(trainer), loss=_loss(outputs), scalars=self._scalars(trainer))
        if stopped or run.save_requested or self._due(step):
            self._save(trainer, step)
        if stopped:
            trainer.should_stop = True
        elif self._minutes_due() and run.context.is_main:
            run.request_save()  # time is rank 0's to read; every rank saves at the agreed step

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names_before_eval = set(trainer.callback_metrics)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run is None or trainer.sanity_checking:
            return
        self._eval_names |= set(trainer.callback_metrics) - self._names_before_eval
        metrics = {name: float(value) for name, value in trainer.callback_metrics.items()
                   if name in self._eval_names and _is_scalar(value)}  # fmt: skip
        if metrics:
            self.run.log_eval(trainer.global_step, metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        run = self._require_run()
        if run.stopped is None and self.config.checkpoint.save_at_end and self._last_saved_step != trainer.global_step:
            self._save(trainer, trainer.global_step)
        self.exit_code = run.finish()
        if self.exit_code != EXIT_OK and self.exit_on_stop:
            run.exit(self.exit_code)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.run is not None:
            self.run.close()

    # -- parts ------------------------------------------------------------------------------

    def _save(self, trainer: pl.Trainer, step: int) -> None:
        """``trainer.save_checkpoint`` into ``step-N/`` (every rank calls it), then the commit on rank 0."""
        run = self._require_run()
        run.before_save()  # a lease lost at this step stops every rank before the write
        folder = self.checkpoints.folder(step)
        started_at_s = time.perf_counter()
        if run.context.is_main:
            unseal(folder)  # a torn attempt's folder is written over
            folder.mkdir(parents=True, exist_ok=True)
        trainer.save_checkpoint(str(folder / CHECKPOINT_FILE))  # rank 0 writes; it returns after a barrier
        if run.context.is_main and commit(run, self.checkpoints, step, started_at_s=started_at_s):
            self.checkpoints.prune_local(step)
        self._last_saved_step = step
        self._last_save_s = time.monotonic()

    def _adopt(self, written: Path, step: int) -> None:
        """Rank 0, right after Lightning wrote a checkpoint of its own (a ``ModelCheckpoint``'s):
        link it into ``step-N/`` and seal that folder, so a kill after this point resumes from it.

        A hard link costs no copy and keeps these bytes even when ``ModelCheckpoint`` rotates
        its file away (Lightning replaces files by rename, never in place); across file
        systems it is a copy."""
        run = self.run
        if run is None or not run.context.is_main or _inside(written, self.checkpoints.directory):
            return
        folder = self.checkpoints.folder(step)
        if (folder / MANIFEST).is_file():
            return  # skylift saved this step itself (its hook runs before ModelCheckpoint's)
        started_at_s = time.perf_counter()
        unseal(folder)
        folder.mkdir(parents=True, exist_ok=True)
        target = folder / CHECKPOINT_FILE
        target.unlink(missing_ok=True)
        try:
            os.link(written, target)
        except OSError:
            shutil.copyfile(written, target)
        if commit(run, self.checkpoints, step, started_at_s=started_at_s):
            self.checkpoints.prune_local(step)
        self._last_saved_step = step

    def _due(self, step: int) -> bool:
        every = self.config.checkpoint.every_steps or 0
        return every != 0 and step % every == 0

    def _minutes_due(self) -> bool:
        minutes = self.config.checkpoint.every_minutes
        return minutes is not None and time.monotonic() - self._last_save_s >= minutes * 60.0

    def _scalars(self, trainer: pl.Trainer) -> dict[str, Any]:
        """``trainer.callback_metrics`` logged in training (not validation's), under names skylift does not write."""
        return {name: value.detach() if isinstance(value, torch.Tensor) else value
                for name, value in trainer.callback_metrics.items()
                if name not in self._eval_names and name not in RESERVED_TRAIN_FIELDS
                and _is_scalar(value)}  # fmt: skip

    def _count_flops(self, pl_module: pl.LightningModule, step: int) -> None:
        flops_per_batch = getattr(pl_module, "flops_per_batch", None)
        run = self._require_run()
        if flops_per_batch and run.services.monitor.wants_flops:
            # Lightning's convention: forward + backward FLOPs of one rank's batch.
            per_rank_batch = self._batches.global_batch // max(run.context.world_size, 1)
            run.services.monitor.record_flops(float(flops_per_batch), per_rank_batch)

    def _require_run(self) -> ScriptRun:
        if self.run is None:
            raise RuntimeError("SkyliftCallback: Lightning called it before on_train_start; pass it in "
                               "Trainer(callbacks=[SkyliftCallback()])")
        return self.run


def resume_checkpoint(where: pl.Trainer | SkyliftCallback | None = None, *,
                      config: RunConfig | str | os.PathLike[str] | None = None, wait_s: float = 1800.0) -> str | None:
    """The newest complete checkpoint for ``trainer.fit(..., ckpt_path=...)``, or None to start fresh.

    Args:
        where: the ``Trainer`` holding a :class:`SkyliftCallback`, the callback itself, or
            None (then ``config`` and the environment say where the checkpoints are).
        config: used when ``where`` is None.
        wait_s: how long a process other than its node's first waits for that one to
            restore a checkpoint from the mirror.

    A ``step-N/`` whose manifest is missing or does not verify is skipped with a warning;
    a newer complete checkpoint in an object-store root is copied onto local disk first.
    """
    if isinstance(where, pl.Trainer):
        # Lightning's callback connector sets Trainer.callbacks; the class does not declare it.
        callbacks = where.callbacks  # type: ignore[attr-defined]
        found = [callback for callback in callbacks if isinstance(callback, SkyliftCallback)]
        if not found:
            raise ValueError("resume_checkpoint(trainer): the Trainer has no SkyliftCallback; "
                             "add it with Trainer(callbacks=[SkyliftCallback()])")
        checkpoints = found[0].checkpoints
    elif isinstance(where, SkyliftCallback):
        checkpoints = where.checkpoints
    else:
        checkpoints = checkpoints_under(PREFIX, resolve_config(config, default_run_dir=None))
    folder = newest_complete(checkpoints, wait_s=wait_s)
    return str(folder / CHECKPOINT_FILE) if folder is not None else None


class _SealingCheckpointIO(CheckpointIO):
    """Lightning's checkpoint writer as it was, and after each full checkpoint it writes outside
    skylift's folders (a ``ModelCheckpoint``'s), that checkpoint sealed as ``step-N/``.

    Lightning calls it on global rank 0 only, and its other ranks wait at a barrier after the
    save. A weights-only checkpoint is left alone: ``fit`` cannot resume from it."""

    def __init__(self, inner: CheckpointIO, callback: SkyliftCallback) -> None:
        self.inner = inner
        self.callback = callback

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        written = Path(os.fspath(path))
        if "optimizer_states" in checkpoint and "loops" in checkpoint and written.is_file():
            self.callback._adopt(written, int(checkpoint["global_step"]))

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self.inner.load_checkpoint(*args, **kwargs)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()


def _inside(path: Path, directory: Path) -> bool:
    return path.resolve().is_relative_to(directory.resolve())


def _backend() -> str | None:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else None


def _precision(lightning_precision: str) -> str:
    """Lightning's ``32-true``, ``bf16-mixed``, ``16-mixed`` as skylift's precision names."""
    if "bf16" in lightning_precision:
        return "bf16"
    return "fp16" if lightning_precision.startswith("16") else "fp32"


def _learning_rate(trainer: pl.Trainer) -> float:
    optimizers = trainer.optimizers
    return float(optimizers[0].param_groups[0]["lr"]) if optimizers else 0.0


def _loss(outputs: Any) -> torch.Tensor | None:
    """The loss ``training_step`` returned (a tensor, or a dict with ``loss``), still on the device."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach().float() if isinstance(loss, torch.Tensor) else None


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
