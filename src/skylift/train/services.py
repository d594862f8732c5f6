"""Survive and watch, for any loop: checkpoints, preemption, metrics and monitoring.

:class:`~skylift.train.runtime.Runtime` owns one :class:`RunServices` when it is built
from a run configuration; its public calls (``resume``, ``log``, ``step_end``,
``close``) are thin doors onto the methods here, and the Trainer's loop goes through
the same doors. So a hand-written loop and ``skylift run`` share one checkpoint,
preemption and monitoring path.

The order of a run::

    open()                      the run lease (a second writer fails before any work)
    resume(objects, state)      newest complete checkpoint; FIT_START; watchers start
    step_end(state) -> stop     per optimizer step: STEP_END, agreement, saves, notices
    finish(state, ...)          final save, run_end, diagnosis, FIT_END
    close()                     watchers, sampler and checkpoint threads stop
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from skylift.checkpoint.faults import fault_point
from skylift.checkpoint.lease import LeaseLostError
from skylift.cloud.redact import redact_config
from skylift.config.schema import RunConfig
from skylift.errors import SkyliftError
from skylift.loop.agreement import Decision, StepAgreement, StopReason
from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext, new_gloo_group
from skylift.loop.events import Callback, Event, EventBus, TrainState
from skylift.monitor.breakdown import StepClock
from skylift.monitor.exporters import check_exporters as _check_exporters
from skylift.monitor.guards import GuardWatch
from skylift.monitor.metrics import MetricsLogger
from skylift.monitor.progress import ProgressBar
from skylift.monitor.watch import RunMonitor
from skylift.run_dir import RunDirectory
from skylift.storage import StorageTransientError
from skylift.train.membership import MembershipWatch
from skylift.train.preemption import PreemptionWatch

if TYPE_CHECKING:
    from torch import nn

    from skylift.checkpoint.session import Checkpointing, TrainingObjects
    from skylift.monitor.exporters.hub import ExportHub

__all__ = ["RunNotSavedError", "RunServices", "seed_everything"]

log = logging.getLogger("skylift")


class RunNotSavedError(SkyliftError):
    """The run stopped, or ended, with its state not committed: the checkpoint root was
    lost or unreachable, the final checkpoint failed, or the final model could not be
    written. The message says why and names the newest committed checkpoint."""


def seed_everything(seed: int, deterministic: bool) -> None:
    """Seed Python, NumPy and torch; with ``deterministic``, deterministic kernels only."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace; the variable is read
        # when its first handle is created, which is after this point.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True)


class RunServices:
    """Checkpointing, preemption, metrics and monitoring of one run.

    Args:
        config: the run's configuration (``checkpoint``, ``preemption``, ``monitor``,
            ``run_dir``, ``seed`` are read).
        context: the distributed context.
        device: where the model runs.
        precision: the precision policy's name.
        ddp_module: returns the DDP wrapper once the model is prepared (for the
            communication share of the step breakdown).
        micro_steps: forward passes per optimizer step.
        callbacks: extra subscribers to the loop's events.
    """

    def __init__(self, config: RunConfig, context: DistributedContext, *, device: torch.device, precision: str,
                 ddp_module: Callable[[], nn.Module | None], micro_steps: int,
                 callbacks: Sequence[Callback] = ()) -> None:
        _check_exporters(config.monitor.exporters)  # a missing package stops the run before any work
        self.config = config
        self.context = context
        self.run_dir = RunDirectory(config.run_dir)
        self.events = EventBus()
        self.metrics = MetricsLogger(self.run_dir, log_every_steps=config.monitor.log_every_steps,
                                     tensorboard=config.monitor.tensorboard, is_writer=context.is_main,
                                     num_nodes=context.num_nodes)
        self.events.add(self.metrics)
        self.monitor = RunMonitor(config, context, self.metrics, device=device, precision=precision)
        self.monitor.accumulation_steps = micro_steps
        self.events.add(self.monitor)
        if context.is_main and _progress_wanted(config.monitor.progress_bar):
            self.events.add(ProgressBar(self.metrics))
        for callback in callbacks:
            self.events.add(callback)
        self.membership = MembershipWatch(context, self.metrics.write_event) if MembershipWatch.wanted() else None
        if self.membership is not None:  # an elastic job's worker (skylift.launch.elastic)
            self.events.add(self.membership)
        # Collectives for step-boundary decisions run on their own gloo group, so they
        # never queue behind (or stall) the NCCL gradient traffic.
        control_group = new_gloo_group() if context.is_distributed else None
        self.agreement = StepAgreement(control_group, distributed=context.is_distributed)
        self.preemption = PreemptionWatch(config.preemption, self.agreement, local_rank=context.local_rank)
        self.checkpointing: Checkpointing | None = None
        if config.checkpoint.enabled:
            from skylift.checkpoint.session import Checkpointing
            from skylift.recipes.base_weights import frozen_base_facts

            self.checkpointing = Checkpointing(config.checkpoint, run_dir=config.run_dir, context=context,
                                               agreement=self.agreement, control_group=control_group,
                                               run_config=config, precision=precision,
                                               facts=frozen_base_facts(config))  # fmt: skip
        self.guards = GuardWatch(
            config.monitor.guards, request_stop=lambda: self.agreement.request_stop(StopReason.GUARD),
            write_record=self.metrics.write_event if context.is_main else None, run_dir=self.run_dir.root,
            rank=context.rank,
        )
        if context.is_main:
            self.metrics.observers.append(self.guards.observe)
        self._control_group = control_group
        self.exports: ExportHub | None = None  # on rank 0 with monitor.exporters, from start()
        self.clock = StepClock(
            config.monitor.breakdown_every_steps, device,
            checkpoint_stall_s=self.checkpointing.stall_s if self.checkpointing is not None else lambda: (0.0, 0.0),
            ddp_module=ddp_module, micro_steps=micro_steps,
        )
        self.resumed_from_step: int | None = None
        self.samples_at_start = 0
        """``samples_seen`` when this attempt started (after a resume: the checkpoint's)."""
        self.started = False
        self.stopped: str | None = None
        """The agreed stop reason, once a stop was decided."""
        self.decision = Decision()
        """The ranks' decision at the last step boundary (a loop a framework owns acts on it)."""
        self.root_problem: str | None = None
        """Why the checkpoint root can no longer be written (the lease was taken over, or
        the store stayed unreachable), once this rank learned it."""
        self.unsaved: str | None = None
        """After :meth:`finish`: why the run's final state is not committed (None: it is)."""
        self._unreachable_since: float | None = None  # time.time() the first failing save started
        self._opened = False
        self._closed = False

    def open(self) -> None:
        """Take the run lease (with checkpoints on); idempotent."""
        if self._opened:
            return
        self._opened = True
        if self.checkpointing is not None:
            self.checkpointing.open()

    def resume(self, objects: TrainingObjects | None, state: TrainState) -> int | None:
        """Restore the checkpoint ``checkpoint.resume`` selects into ``objects`` and
        ``state``; then start the run (config written, watchers on, FIT_START). ``None``:
        a framework that restores its own (checkpoints off here)."""
        self.open()
        self._refuse_past_budget()
        if self.checkpointing is not None:
            if objects is None:
                raise ValueError("checkpoint.enabled: resume needs the model, optimizer and loader to restore")
            self.resumed_from_step = self.checkpointing.resume(objects, state)
            resumed = self.checkpointing.resumed_manifest
            if self.membership is not None and self.resumed_from_step is not None and resumed is not None:
                self.membership.resumed(self.resumed_from_step, resumed)
        self.start(state)
        return self.resumed_from_step

    def start(self, state: TrainState) -> None:
        if self.started:
            return
        self.started = True
        self.samples_at_start = state.samples_seen
        self.monitor.resumed_from_step = self.resumed_from_step
        if self.context.is_main:
            self.run_dir.create()
            # Every field, but no secret in clear: submit.envs values and URLs' user-info are redacted.
            resolved = redact_config(self.config.model_dump(mode="json"))
            self.run_dir.write_text_atomic(self.run_dir.config_path, yaml.safe_dump(resolved, sort_keys=False))
        self.preemption.start()
        self.guards.start()
        self._start_exports()
        self.events.fire(Event.FIT_START, state)
        self.clock.end_of_previous_step(state.step + 1)

    def step_end(self, state: TrainState) -> bool:
        """The step ``state.step`` finished: metrics, then the ranks' agreed decision.

        Returns True when the run must stop (a notice, a signal, a failed save with
        ``checkpoint.on_failure: exit``); a preemption's save is done by then.
        """
        self.guards.step_done(state.step)
        state.extra["breakdown_s"] = self.clock.finish()
        self.clock.end_of_previous_step(state.step + 1)
        if state.loss is not None:
            self.events.fire(Event.STEP_END, state)
        fault_point("step_end", step=state.step, rank=self.context.rank)
        self._watch_lease()
        decision = self.decision = self.agreement.exchange()
        if decision.stop_code == StopReason.ROOT_LOST:
            self._stop_for_lost_root(state)
        if self.checkpointing is not None:
            if self.checkpointing.due(state, decision):
                self.metrics.flush(state)  # metrics up to a checkpoint are on disk before it commits
                self.checkpointing.save(state)
            self.record_saves()
        if decision.stop_code == StopReason.NONE:
            return False
        decision = self.decision = self.agreement.flush() if self.context.is_distributed else decision
        state.stop_requested = self.stopped = decision.stop_reason
        log.warning("stopping at step %d: %s", state.step, decision.stop_reason)
        if decision.stop_code == StopReason.PREEMPTED and self.checkpointing is not None:
            self.metrics.flush(state)
            self.metrics.write_event(self.checkpointing.save_for_preemption(state, decision))
            self.record_saves()
        elif decision.stop_code == StopReason.GUARD:
            self._stop_for_guard(state)
        self.events.fire(Event.PREEMPTION_NOTICE, state)
        return True

    def _stop_for_guard(self, state: TrainState) -> None:
        """A guard stops the run: commit this step (no notice window to fit), say why."""
        self.metrics.flush(state)
        committed = None
        if self.checkpointing is not None:
            self.checkpointing.manager.wait()
            self.checkpointing.save(state, blocking=True)
            self.checkpointing.manager.wait()
            self.record_saves()
            last = self.checkpointing.manager.last_committed
            committed = last.step if last is not None else None
        finding = self.guards.fired
        if finding is not None and self.context.is_main:
            self.metrics.write_event({**finding.record(state.step), "checkpoint_step": committed})

    def _refuse_past_budget(self) -> None:
        """A resume whose earlier attempts spent the budget does not start (every rank raises)."""
        from skylift.errors import SkyliftConfigError
        from skylift.monitor.guards import resume_refusal

        refusal = None
        if self.context.is_main and self.run_dir.metrics_path.exists():
            from skylift.monitor.cost import previous_spend_usd
            from skylift.monitor.schema import read_records

            refusal = resume_refusal(previous_spend_usd(read_records(self.run_dir.metrics_path)),
                                     self.config.monitor.guards)
        if self.context.is_distributed:
            holder = [refusal]
            with collective("the guards' decision (broadcast from rank 0)"):
                dist.broadcast_object_list(holder, src=0, group=self._control_group)
            refusal = holder[0]
        if refusal:
            raise SkyliftConfigError(refusal, hint="Nothing was resumed; the last checkpoint stands.")

    def record_saves(self) -> None:
        if self.checkpointing is None:
            return
        for record in self.checkpointing.finished_saves():
            self.metrics.write_event(record)
            self._track_unreachable_root(record)

    def finish(self, state: TrainState, started_at: float,
               save_model: Callable[[], None] | None = None) -> tuple[float, float]:
        """The final save (unless stopped), ``run_end`` and diagnosis, FIT_END.

        Returns (training seconds since ``started_at``, a ``time.perf_counter()`` value,
        up to the final save's commit; this attempt's samples per second over them)."""
        self.agreement.flush()
        if self.checkpointing is not None:
            self.checkpointing.finish(state)
            self.record_saves()
            self.unsaved = self._final_state_problem(state)
        train_time_s = time.perf_counter() - started_at
        self.events.fire(Event.CHECKPOINT, state)
        if save_model is not None and self.config.checkpoint.save_final_model and self.context.is_main:
            self._save_final_model(save_model)
        # This attempt's samples over this attempt's time: after a resume, samples_seen also
        # counts the earlier attempts' samples, which this attempt's clock did not see.
        attempt_samples = state.samples_seen - self.samples_at_start
        samples_per_s = round(attempt_samples / train_time_s, 2) if train_time_s > 0 else 0.0
        self.monitor.finish(state, train_time_s, samples_per_s)
        self.events.fire(Event.FIT_END, state)
        return train_time_s, samples_per_s

    def raise_if_unsaved(self) -> None:
        """After :meth:`finish`: a run whose final state is not committed does not report success."""
        if self.unsaved is not None:
            raise RunNotSavedError(self.unsaved)

    def _watch_lease(self) -> None:
        """Rank 0: a lease another job took over stops every rank at the next agreed step
        boundary, before any save (a write that comes sooner is refused by the fenced store)."""
        lease = self.checkpointing.lease if self.checkpointing is not None else None
        if lease is None or self.root_problem is not None:
            return
        try:
            lease.check()
        except LeaseLostError as lost:
            self._lose_root(str(lost))

    def _track_unreachable_root(self, record: dict[str, Any]) -> None:
        """Every rank, from the same save records: the root failing every save with transient
        errors for longer than ``checkpoint.unreachable_limit_s`` stops the run."""
        if record["committed"] and record.get("uploaded") is not False:
            self._unreachable_since = None
            return
        error = record.get("upload_error") or record.get("error") or ""
        # The save's error is text by then (it crossed ranks); a transient one survived its retries.
        if StorageTransientError.__name__ not in error:
            return
        started = record["time"] - record["write_s"] - record["stall_s"]
        if self._unreachable_since is None:
            self._unreachable_since = started
        down_s = record["time"] - self._unreachable_since
        limit_s = self.config.checkpoint.unreachable_limit_s
        if down_s >= limit_s and self.root_problem is None:
            self._lose_root(
                f"the checkpoint root {self._checkpoints().store.describe()} has been unreachable for {down_s:.0f} s, "
                f"past checkpoint.unreachable_limit_s ({limit_s:g} s); last error: {error}"
            )

    def _lose_root(self, problem: str) -> None:
        self.root_problem = problem
        self._checkpoints().manager.cancel_in_flight()
        self.agreement.request_stop(StopReason.ROOT_LOST)

    def _stop_for_lost_root(self, state: TrainState) -> None:
        """Every rank at the same boundary: stop without saving, and say why."""
        if self.context.is_distributed:
            self.agreement.flush()  # no rank is left in the exchange in flight
        state.stop_requested = self.stopped = StopReason.ROOT_LOST.label
        self.record_saves()
        lease = self.checkpointing.lease if self.checkpointing is not None else None
        lost_lease = lease is not None and lease.lost is not None
        if self.checkpointing is not None:
            self.checkpointing.manager.cancel_in_flight()
            if lease is not None:
                lease.abandon()  # nothing more to the root: its release would write or wait on it
        problem = self.root_problem or "another rank found the checkpoint root lost (rank 0's message says why)"
        message = f"stopped at step {state.step}: {problem}; {self._newest_committed()}"
        log.error("%s", message)
        raise (LeaseLostError if lost_lease else RunNotSavedError)(message)

    def _final_state_problem(self, state: TrainState) -> str | None:
        """Why the state at the end of the run is not committed to the root, or None."""
        if not self.config.checkpoint.save_at_end or state.stop_requested is not None:
            return None  # nothing to commit, or a stop whose own exit code says so
        history = self._checkpoints().manager.history
        if self.resumed_from_step == state.step and not history:
            return None  # resumed at the end: the checkpoint it resumed from is the final state
        attempts = [result for result in history if result.step == state.step]
        final = attempts[-1] if attempts else None
        if final is not None and final.committed and final.uploaded is not False:
            return None
        why = "it was never saved" if final is None else (final.upload_error or final.error or "unknown error")
        return (f"the final state (step {state.step}) is not committed to {self._checkpoints().store.describe()}: "
                f"{why}; {self._newest_committed()}")

    def _save_final_model(self, save_model: Callable[[], None]) -> None:
        from safetensors import SafetensorError

        try:
            save_model()
        except (OSError, SafetensorError) as error:
            path = self.run_dir.model_path
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)  # a torn file must not pass for the model
            committed = f"; {self._newest_committed()}" if self.checkpointing is not None else ""
            raise RunNotSavedError(
                f"could not write the final model {path}: {type(error).__name__}: {error}; free space on that disk "
                f"or set run_dir to a larger one{committed}"
            ) from error

    def _newest_committed(self) -> str:
        """Which checkpoint a new start would resume from, in words."""
        checkpointing = self.checkpointing
        last = checkpointing.manager.last_committed if checkpointing is not None else None
        step = last.step if last is not None else self.resumed_from_step
        if step is None:
            return "no checkpoint is committed: a new start begins from step 0"
        return (f"the newest committed checkpoint is step {step} "
                f"({self._checkpoints().store.describe(f'step-{step}')}): run the same command again to resume from it")

    def _checkpoints(self) -> Checkpointing:
        """The checkpointing of a run that has it (save records and a resumed step come only from it)."""
        if self.checkpointing is None:
            raise RuntimeError("checkpoint.enabled is false: this run has no checkpoints")
        return self.checkpointing

    def close_exports(self) -> None:
        """Send what the exporters still hold and close them (after the report, which some upload)."""
        exports, self.exports = self.exports, None
        if exports is not None:
            exports.close()

    def close(self) -> None:
        """Stop every background thread; idempotent, also after a failure."""
        if self._closed:
            return
        self._closed = True
        self.close_exports()
        self.guards.stop()
        preempted = self.decision.stop_code == StopReason.PREEMPTED or self.preemption.notice is not None
        self.preemption.stop(leaving_until_s=self.decision.deadline_s if preempted else None)
        self.monitor.close()
        if self.checkpointing is not None:
            self.checkpointing.close()


    def _start_exports(self) -> None:
        names = self.config.monitor.exporters
        if not names or not self.context.is_main:
            return
        from skylift.monitor.exporters import RunInfo, build_exporter
        from skylift.monitor.exporters.hub import ExportHub

        run = RunInfo(self.config, run_id=_run_id(self.run_dir.root), resumed=self.resumed_from_step is not None)
        self.exports = ExportHub([build_exporter(name, self.config) for name in names], run,
                                 max_queued=self.config.monitor.export_queue_records)
        self.metrics.observers.append(self.exports.observe)


def _run_id(run_dir: Any) -> str:
    """The run folder's own id, made at its first start: a resumed run continues the same
    MLflow or W&B run."""
    import uuid

    path = run_dir / "run_id"
    if path.exists():
        return path.read_text().strip()
    run_id = uuid.uuid4().hex
    path.write_text(run_id + "\n")
    return run_id


def _progress_wanted(setting: bool | str) -> bool:
    return sys.stdout.isatty() if setting == "auto" else bool(setting)
