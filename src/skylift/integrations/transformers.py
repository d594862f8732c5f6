"""skylift for a Hugging Face ``Trainer`` script: one callback, one resume helper.

::

    from skylift.integrations.transformers import SkyliftCallback, resume_checkpoint

    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(SkyliftCallback())                 # or SkyliftCallback(config="run.yaml")
    trainer.train(resume_from_checkpoint=resume_checkpoint(trainer))

The callback starts skylift's preemption watch (the five clouds' spot notices and
SIGTERM/SIGUSR1; all ranks agree on the step). On a notice it sets
``control.should_save`` and ``control.should_training_stop`` at the next step boundary,
so the Trainer writes its own ``checkpoint-N/``; skylift seals it (``manifest.json``
with every file's size and sha256, written last), mirrors it to the checkpoint root
if that is elsewhere (``SKYLIFT_CHECKPOINT_ROOT``, e.g. ``s3://``), and the process
exits 143 for the platform (or ``skylift submit --watch``) to restart it.
:func:`resume_checkpoint` returns the newest *complete* ``checkpoint-N/`` (a torn one
is skipped; a newer one in the mirror is restored onto local disk first).

The Trainer's logs go into skylift's ``metrics.jsonl`` (the ``train`` and ``eval``
records ``skylift report`` and ``skylift monitor`` read) with the system sampler, a
step breakdown from the Trainer's hooks, MFU from the Trainer's own FLOP count, the
cost ledger, the guards and the exporters, all as the ``monitor`` section says. The
run folder is ``SKYLIFT_RUN_DIR``, else the config's ``run_dir``, else ``output_dir``.
The loss recorded is per sample (:mod:`skylift.integrations.hf_loss`). The callback
refuses a launch the Trainer did not join into one process group, holds the run lease,
and makes a rerun of a finished job train nothing.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from transformers import TrainerCallback

from skylift.config.schema import RunConfig
from skylift.errors import EXIT_OK, SkyliftConfigError
from skylift.integrations.checkpoints import FolderCheckpoints, unseal
from skylift.integrations.commit import checkpoints_beside, commit, lease_root, newest_complete
from skylift.integrations.hf_loss import PerSampleLoss
from skylift.integrations.run import BatchCount, FrameworkJob, ScriptRun, check_process_group, resolve_config
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.monitor.metrics import RESERVED_TRAIN_FIELDS

if TYPE_CHECKING:
    from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

__all__ = ["PREFIX", "SkyliftCallback", "resume_checkpoint"]

PREFIX = "checkpoint-"
"""The Trainer's checkpoint folders: ``OUTPUT_DIR/checkpoint-<global step>``."""

_LOGGED_BY_NAME = {"loss", "learning_rate", "grad_norm", "epoch"}


class SkyliftCallback(TrainerCallback):
    """Spot survival, complete checkpoints and skylift's monitoring for a ``Trainer``.

    Args:
        config: a run configuration: the path of its YAML file, a
            :class:`~skylift.config.RunConfig`, or ``None`` for the defaults. Its
            ``preemption``, ``monitor`` and ``checkpoint`` (``root``, ``endpoint_url``,
            ``keep``) sections apply; ``SKYLIFT_RUN_DIR`` and ``SKYLIFT_CHECKPOINT_ROOT`` win.
        exit_on_stop: after a preemption (or a guard's stop) end the process with 143
            (or 3) once the checkpoint is complete, so the platform restarts it. With
            False, ``trainer.train()`` returns and :attr:`exit_code` says what to do.

    Example:
        >>> trainer.add_callback(SkyliftCallback("run.yaml"))
    """

    def __init__(self, config: RunConfig | str | os.PathLike[str] | None = None, *, exit_on_stop: bool = True) -> None:
        self.config_source = config
        self.exit_on_stop = exit_on_stop
        self.run: ScriptRun | None = None
        """This attempt's services (from ``on_train_begin``)."""
        self.checkpoints: FolderCheckpoints | None = None
        self.exit_code: int | None = None
        """Once training ended: 0, 143 (preempted: run again to resume) or 3 (a guard stopped it)."""
        self._batches: BatchCount | None = None
        self._save_started_s = time.perf_counter()
        self._finished_at: int | None = None
        self._loss: PerSampleLoss | None = None
        self._last_logged_step = 0
        """The step of a finished job this rerun resumed at (``max_steps``): the rerun trains nothing."""

    @property
    def stopped(self) -> str | None:
        """Why the run stopped early (``preemption notice``, ``guard``), else None."""
        return self.run.stopped if self.run is not None else None

    # -- the Trainer's events ---------------------------------------------------------

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> TrainerControl:
        _check_arguments(args)
        check_process_group("the Hugging Face Trainer", args.world_size, fix=_group_fix(args))
        if state.global_step > 0 and state.global_step >= state.max_steps > 0:
            return self._nothing_to_train(args, state, control)
        config = resolve_config(self.config_source, default_run_dir=_output_dir(args))
        self.checkpoints = checkpoints_beside(_output_dir(args), PREFIX, config)
        self._batches = BatchCount.of(kwargs.get("train_dataloader"), per_rank_batch=args.per_device_train_batch_size,
                                       world_size=args.world_size, accumulation=args.gradient_accumulation_steps)
        self.run = ScriptRun(config, _context(args), precision=_precision(args),
                             micro_steps=args.gradient_accumulation_steps, job=_job(args, state),
                             exit_on_stop=self.exit_on_stop)
        self.run.take_lease(lease_root(self.checkpoints, config), job_name="trainer")
        steps_per_epoch = self._batches.steps_per_epoch
        train_state = TrainState(total_steps=state.max_steps, steps_per_epoch=steps_per_epoch,
                                 global_batch_size=self._batches.global_batch, step=state.global_step,
                                 epoch=_epoch(state.epoch), samples_seen=self._batches.samples_at(state.global_step))
        self.run.start(train_state, resumed_from_step=state.global_step or None)
        self._last_logged_step = state.global_step
        if kwargs.get("model") is not None:
            self._loss = PerSampleLoss(kwargs["model"], processes=args.world_size,
                                       averaged_across_processes=getattr(args, "average_tokens_across_devices", False))
        return control

    def on_step_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        if self._finished_at is None:
            self._require_run().step_begin()

    def on_pre_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        if self._finished_at is not None:
            # The Trainer takes one step before it looks at should_training_stop: with no
            # gradients the optimizer leaves every weight of the finished model as it was.
            kwargs["optimizer"].zero_grad(set_to_none=True)
            return
        self._require_run().mark("forward_backward")

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                          **kwargs: Any) -> None:
        if self._finished_at is None:
            self._require_run().mark("optimizer")

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> TrainerControl:
        if self._finished_at is not None:
            state.global_step = self._finished_at  # that step changed nothing: no checkpoint, log or eval of it
            return _nothing_more(control)
        run = self._require_run()
        assert self._batches is not None
        stopped = run.step_end(state.global_step, epoch=_epoch(state.epoch),
                               samples_seen=self._batches.samples_at(state.global_step))
        if stopped:
            control.should_save = True  # the Trainer's own checkpoint, written before it stops
            control.should_training_stop = True
        elif run.save_requested:
            control.should_save = True
        self._before_a_save(args, state, control)
        return control

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> TrainerControl:
        if self._finished_at is not None:
            return _nothing_more(control)
        self._before_a_save(args, state, control)
        return control

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if self._finished_at is not None:
            return
        run = self._require_run()
        assert self.checkpoints is not None
        run.barrier()  # every rank has written its files (each writes its own RNG state)
        if run.context.is_main:
            commit(run, self.checkpoints, state.global_step, started_at_s=self._save_started_s)

    def on_log(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self._finished_at is not None:
            return
        run = self._require_run()
        logs = logs or {}
        numbers = {name: float(value) for name, value in logs.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool)}  # fmt: skip
        if "loss" in numbers:
            scalars = {name: value for name, value in numbers.items()
                       if name not in _LOGGED_BY_NAME and name not in RESERVED_TRAIN_FIELDS}  # fmt: skip
            loss = numbers["loss"]
            if self._loss is not None:  # the Trainer's figure can be processes x accumulation too large
                loss = self._loss.per_sample(loss, state.global_step - self._last_logged_step)
            self._last_logged_step = state.global_step
            run.log_train(state.global_step, loss=loss, lr=numbers.get("learning_rate", 0.0),
                          grad_norm=numbers.get("grad_norm"), scalars=scalars, flops_so_far=state.total_flos)
        elif any(name.startswith("eval_") for name in numbers):
            run.log_eval(state.global_step, {name: value for name, value in numbers.items() if name != "epoch"})

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._finished_at is not None:
            self.exit_code = EXIT_OK
            return
        if self._loss is not None:
            self._loss.close()
        run = self._require_run()
        self.exit_code = run.finish()
        if self.exit_code != EXIT_OK and self.exit_on_stop:
            run.exit(self.exit_code)

    # -- parts ----------------------------------------------------------------------------

    def _nothing_to_train(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> Any:
        """A rerun of a finished job: the Trainer restored its final checkpoint; train nothing,
        write nothing (no run records, no checkpoint), say so once."""
        self._finished_at = state.global_step
        if args.process_index == 0:
            print(f"skylift: nothing to train: this job finished (its newest complete checkpoint is at step "
                  f"{state.global_step}, max_steps {state.max_steps}); the final checkpoint stays as it is",
                  file=sys.stderr, flush=True)
        control.should_training_stop = True
        return control

    def _before_a_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl) -> None:
        if not control.should_save:
            return
        self._require_run().before_save()  # a lease lost at this step stops every rank before the write
        self._save_started_s = time.perf_counter()
        assert self.checkpoints is not None
        if args.process_index == 0:
            unseal(self.checkpoints.folder(state.global_step))  # the Trainer writes over a folder of a torn attempt

    def _require_run(self) -> ScriptRun:
        if self.run is None:
            raise RuntimeError("SkyliftCallback: the Trainer called it before on_train_begin; add it with "
                               "trainer.add_callback(SkyliftCallback()) before trainer.train()")
        return self.run


def resume_checkpoint(where: Trainer | str | os.PathLike[str], *,
                      config: RunConfig | str | os.PathLike[str] | None = None,
                      wait_s: float = 1800.0) -> str | None:
    """The newest complete ``checkpoint-N/`` for ``trainer.train(resume_from_checkpoint=...)``.

    Args:
        where: the ``Trainer`` (its ``output_dir``, and the config of its
            :class:`SkyliftCallback`) or an ``output_dir``.
        config: the run configuration, if ``where`` is a folder and the checkpoint root
            is not in ``SKYLIFT_CHECKPOINT_ROOT``.
        wait_s: how long a process other than its node's first waits for that one to
            restore a checkpoint from the mirror.

    Returns:
        The folder's path, or None for a fresh start. A folder without a manifest that
        verifies (a save cut short) is skipped with a warning; a newer complete
        checkpoint in the mirror (``s3://``, ``oss://``, ``cos://`` or another folder) is
        first copied onto local disk, each file verified.
    """
    if isinstance(where, (str, os.PathLike)):
        output_dir = os.fspath(where)
    else:
        output_dir = _output_dir(where.args)
        if config is None:
            callback = next((c for c in where.callback_handler.callbacks if isinstance(c, SkyliftCallback)), None)
            config = callback.config_source if callback is not None else None
    resolved = resolve_config(config, default_run_dir=output_dir)
    folder = newest_complete(checkpoints_beside(output_dir, PREFIX, resolved), wait_s=wait_s)
    return str(folder) if folder is not None else None


def _output_dir(args: TrainingArguments) -> str:
    """``output_dir``: TrainingArguments sets its default (``trainer_output``) when built."""
    if args.output_dir is None:
        raise ValueError("TrainingArguments.output_dir is None: it is set when the arguments are built")
    return args.output_dir


def _check_arguments(args: TrainingArguments) -> None:
    if args.save_total_limit == 1:
        raise SkyliftConfigError(
            "TrainingArguments.save_total_limit=1: the Trainer deletes the older checkpoint before skylift can seal "
            "the new one, so a save cut short would leave none complete",
            hint="Set save_total_limit=2 or more (or leave it None).",
        )


def _job(args: Any, state: Any) -> FrameworkJob:
    settings = {"max_steps": state.max_steps, "num_train_epochs": args.num_train_epochs,
                "gradient_accumulation_steps": args.gradient_accumulation_steps, "learning_rate": args.learning_rate,
                "output_dir": str(args.output_dir)}
    return FrameworkJob("Hugging Face Trainer", args.per_device_train_batch_size,
                        data_num_workers=args.dataloader_num_workers, compile_enabled=bool(args.torch_compile),
                        settings=settings)


def _group_fix(args: Any) -> str:
    if args.device.type == "cpu" and not args.use_cpu:
        return ("Pass TrainingArguments(use_cpu=True, ...): without a GPU the Trainer joins the launched processes "
                "into one group only with use_cpu.")
    return ("Give the Trainer one device per process (TrainingArguments' device settings), or launch one process "
            "(skylift launch --nproc 1).")


def _nothing_more(control: TrainerControl) -> TrainerControl:
    control.should_save = control.should_log = control.should_evaluate = False
    control.should_training_stop = True
    return control


def _context(args: Any) -> DistributedContext:
    backend = dist.get_backend() if dist.is_available() and dist.is_initialized() else None
    return DistributedContext(rank=args.process_index, world_size=args.world_size,
                              local_rank=args.local_process_index, device=args.device, backend=backend)


def _precision(args: TrainingArguments) -> str:
    if args.bf16:
        return "bf16"
    if args.fp16:
        return "fp16"
    return "tf32" if args.tf32 else "fp32"


def _epoch(epoch: float | None) -> int:
    """The Trainer's fractional epoch (1.0 at the end of the first) as skylift's 0-based epoch."""
    return max(math.ceil(epoch or 0.0) - 1, 0)
