"""skylift's survive-and-watch services for a loop that a framework owns.

The Hugging Face Trainer and Lightning run their own loops and write their own
checkpoints. :class:`ScriptRun` gives them what :class:`~skylift.train.runtime.Runtime`
gives a hand-written loop, through the same :class:`~skylift.train.services.RunServices`
(with skylift's own checkpoints off): the preemption watch and the ranks' agreement on
a stop, ``metrics.jsonl`` with the system sampler, MFU, the cost ledger, guards and
exporters, ``run_end``, the diagnosis and the report. A framework's callback calls, in
this order::

    start(state)                    once the framework has restored its checkpoint
    step_begin() / mark(phase)      where the framework's hooks allow (the step breakdown)
    step_end(state) -> stop reason  every optimizer step, on every rank
    log_train(state, ...)           the framework's training logs (every rank)
    saved(step, ...)                its checkpoint is sealed: checkpoint, preemption records
    finish() -> exit code           run_end, report; 143 after a preemption
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import yaml

from skylift.checkpoint.lease import LeaseLostError
from skylift.config.load import load_config
from skylift.config.schema import RunConfig
from skylift.config.script_environment import ScriptEnvironment
from skylift.errors import SkyliftError
from skylift.integrations.lease import FrameworkLease, FrameworkServices
from skylift.loop.agreement import StopReason
from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext, exit_cleanly, new_gloo_group
from skylift.loop.events import TrainState
from skylift.storage import Store

if TYPE_CHECKING:
    from skylift.monitor.report import Report

__all__ = ["BatchCount", "FrameworkJob", "ProcessGroupNotFormedError", "ScriptRun", "check_process_group",
           "exit_code_for", "resolve_config"]

log = logging.getLogger("skylift")



def resolve_config(config: RunConfig | str | os.PathLike[str] | None, *, default_run_dir: str | os.PathLike[str] | None,
                   environ: dict[str, str] | None = None) -> RunConfig:
    """The run configuration of a framework script: the YAML file, a :class:`RunConfig`, or
    the defaults; then what the launcher or platform set (``SKYLIFT_RUN_DIR``,
    ``SKYLIFT_CHECKPOINT_ROOT``), which wins.

    ``default_run_dir`` is the run folder when neither the config nor the environment
    names one (the Trainer's ``output_dir``)."""
    if config is None:
        resolved = load_config(None)
    elif isinstance(config, RunConfig):
        resolved = config.model_copy(deep=True)
    else:
        resolved = load_config(str(config))
    told = ScriptEnvironment.read(environ)
    if told.run_dir:
        resolved.run_dir = Path(told.run_dir)
    elif "run_dir" not in resolved.model_fields_set and default_run_dir is not None:
        resolved.run_dir = Path(default_run_dir)
    if told.checkpoint_root:
        resolved.checkpoint.root = told.checkpoint_root
    return resolved


_RANK_0_FIRST_S = 3.0


class ProcessGroupNotFormedError(SkyliftError):
    """The framework left the launched processes apart: each would run the whole job."""


def check_process_group(framework: str, framework_world_size: int, *, fix: str,
                        environ: dict[str, str] | None = None) -> None:
    """Refuse a launch whose framework did not form the process group it was given.

    torchrun (``skylift launch --nproc N``) started ``WORLD_SIZE`` processes; a framework
    that leaves them apart (a Trainer on the CPU without ``use_cpu``, Lightning with
    ``devices="auto"``) runs N single-process copies of the job side by side, each
    rank 0, all writing one ``metrics.jsonl`` and sealing the same folders. Every
    process raises, before any step; the shim prints rank 0's line only.

    Raises:
        ProcessGroupNotFormedError: ``framework_world_size`` is not ``WORLD_SIZE`` (one line, ending in
            ``fix``: the framework's setting to change).
    """
    variables: Mapping[str, str] = os.environ if environ is None else environ
    launched = int(variables.get("WORLD_SIZE", "1") or 1)
    if launched <= 1 or framework_world_size == launched:
        return
    if variables.get("RANK", "0") != "0":
        # The launcher stops every worker once one fails: the others give rank 0, which says
        # why (the shim prints rank 0's error only), the time to say it first.
        time.sleep(_RANK_0_FIRST_S)
    raise ProcessGroupNotFormedError(
        f"{launched} processes were launched (WORLD_SIZE={launched}) but {framework} runs in a process group "
        f"of {framework_world_size}: {launched // max(framework_world_size, 1)} copies of the job would train side by "
        f"side into one run folder. {fix}"
    )


@dataclass(frozen=True)
class FrameworkJob:
    """The job as the framework runs it, for the run records (not skylift's ``data`` defaults).

    Args:
        framework: its name, as the records say it (``Hugging Face Trainer``).
        per_device_batch_size: samples per process per forward pass (``run_start.micro_batch_size``).
        data_num_workers: the training loader's worker processes.
        compile_enabled: whether the framework compiles the model.
        settings: the framework's own arguments worth reading beside the records.
    """

    framework: str
    per_device_batch_size: int | None
    data_num_workers: int = 0
    compile_enabled: bool = False
    settings: dict[str, Any] = field(default_factory=dict)


_APPLIED_SECTIONS = ("run_dir", "preemption", "monitor", "checkpoint")
"""The parts of a run configuration that a framework job's callback applies."""


def exit_code_for(stopped: str | None) -> int:
    """143 after a preemption, 3 after a guard's stop, 1 after another stop (a failed save), else 0
    (:class:`StopReason`'s mapping)."""
    return StopReason.of_label(stopped).exit_code


class ScriptRun:
    """One attempt of a framework-driven run, on every rank.

    Args:
        config: the resolved run configuration (:func:`resolve_config`).
        context: where this process sits in the job.
        precision: ``fp32``, ``tf32``, ``fp16`` or ``bf16`` (the peak FLOP/s MFU divides by).
        micro_steps: forward passes per optimizer step.
        job: the job as the framework runs it (its batch, loader, compile), for ``run_start``
            and the run folder's ``config.yaml``.
        exit_on_stop: a lease another job took over ends the process (exit 1, one line from
            rank 0); with False, :meth:`step_end` raises :class:`LeaseLostError` instead.
    """

    def __init__(self, config: RunConfig, context: DistributedContext, *, precision: str, micro_steps: int,
                 job: FrameworkJob | None = None, exit_on_stop: bool = True) -> None:
        self.config = config
        self.exit_on_stop = exit_on_stop
        self.context = context
        self.job = job
        services_config = config.model_copy(deep=True)
        services_config.checkpoint.enabled = False  # the framework writes its own
        services_config.monitor.progress_bar = False  # and draws its own progress
        if job is not None:  # run_start describes the framework's batch, loader and compile, not skylift's defaults
            if job.per_device_batch_size:
                services_config.data.global_batch_size = job.per_device_batch_size * context.world_size * micro_steps
            services_config.data.num_workers = job.data_num_workers
            services_config.compile.enabled = job.compile_enabled
        self.services = FrameworkServices(services_config, context, device=context.device, precision=precision,
                                    ddp_module=lambda: None, micro_steps=micro_steps)
        # Barriers of the commit rule run on their own gloo group, off the framework's (NCCL) traffic.
        self._group = new_gloo_group() if context.is_distributed else None
        self.state = TrainState(total_steps=0, steps_per_epoch=0, global_batch_size=0)
        self.stopped: str | None = None
        """Why the run stops (``preemption notice``, ``guard``) once the ranks agreed, else None."""
        self.stop_step: int | None = None
        self.last_committed_step: int | None = None
        self._started_at = time.perf_counter()
        self._breakdowns: dict[int, dict[str, float]] = {}
        self._interval = _Interval()
        self._step_started_s: float | None = None
        self._finished = False
        self._lease = FrameworkLease(config, context, self.services, self._group)

    # -- the loop -------------------------------------------------------------------

    def take_lease(self, root: Store, *, job_name: str) -> None:
        """Hold the run lease of ``root`` (where the framework's checkpoints go) for this attempt;
        rank 0 checks it at every step boundary (:mod:`skylift.integrations.lease`).

        Raises:
            LeaseHeldError: another live job holds it (every rank; the shim prints rank 0's one line).
        """
        try:
            self._lease.take(root, job_name=job_name)
        except BaseException:
            self.close()
            raise

    def start(self, state: TrainState, *, resumed_from_step: int | None) -> None:
        """Refuse a resume past the budget, write ``run_start``, start the watchers (every rank)."""
        self.state = state
        self.services.resumed_from_step = resumed_from_step
        self.services.resume(None, state)
        self._write_config()
        self._started_at = time.perf_counter()
        self._interval.reset()

    def step_begin(self) -> None:
        """The step's batches are in hand: what came before was data wait (and the last save or log)."""
        self._step_started_s = time.perf_counter()
        self._interval.data_wait_s += self._step_started_s - self._interval.last_step_end_s
        self.services.clock.mark("data_wait")

    def mark(self, phase: str) -> None:
        """A phase of the step breakdown (``forward_backward``, ``optimizer``) ends now."""
        self.services.clock.mark(phase)

    def step_end(self, step: int, *, epoch: int, samples_seen: int, lr: float = 0.0,
                 loss: torch.Tensor | None = None, scalars: dict[str, Any] | None = None) -> str | None:
        """Optimizer step ``step`` is done (every rank): guards, the ranks' agreed decision.

        ``loss`` (still on the device): a ``train`` record through skylift's own logger,
        every ``monitor.log_every_steps``, with ``scalars`` (every rank the same names);
        ``None`` when the framework's logs bring the losses (:meth:`log_train`). Returns
        the agreed stop reason, or None."""
        self.services.clock.mark("between_steps")
        now_s = time.perf_counter()
        self._interval.step_done(now_s)
        state = self.state
        state.step, state.epoch, state.samples_seen, state.lr, state.loss = step, epoch, samples_seen, lr, loss
        state.step_time_s, state.data_wait_s = self._interval.last_step_s, self._interval.last_data_wait_s
        if scalars:
            state.extra["scalars"] = scalars
        self._lease.watch()
        stop = False
        try:
            stop = self.services.step_end(state)
        except LeaseLostError as lost:
            self._end_for_lost_lease(lost)
        breakdown = state.extra.pop("breakdown_s", None)
        if breakdown is not None and loss is None:
            self._breakdowns[step] = breakdown  # for the framework's log of this step
        state.extra.pop("scalars", None)
        if stop and self.stopped is None:
            self.stopped, self.stop_step = self.services.stopped, step
        return self.stopped if stop else None

    def before_save(self) -> None:
        """Every rank, at a step whose checkpoint the framework is about to write (after
        :meth:`step_end`): a lease lost at this step stops the job before the write."""
        try:
            self._lease.confirm_before_save(self.state)
        except LeaseLostError as lost:
            self._end_for_lost_lease(lost)

    def _end_for_lost_lease(self, lost: LeaseLostError) -> None:
        self.stopped, self.stop_step = StopReason.ROOT_LOST.label, self.state.step
        self.close()
        self._lease.end(lost, exit_process=self.exit_on_stop)

    def request_save(self) -> None:
        """Ask every rank to save at the next step boundary (from any one rank)."""
        self.services.agreement.request_save()

    @property
    def save_requested(self) -> bool:
        """Whether the ranks agreed at this step to save (a rebalance recommendation, say)."""
        return self.services.decision.save

    def log_train(self, step: int, *, loss: float, lr: float, grad_norm: float | None = None,
                  scalars: dict[str, float] | None = None, flops_so_far: float | None = None) -> None:
        """The framework's training log at ``step`` as one ``train`` record (every rank: one all-reduce).

        ``loss`` is the framework's (already averaged over ranks and its logging interval);
        ``flops_so_far``: the framework's count of model FLOPs of all ranks since the start,
        for MFU."""
        state = self.state
        device = self.context.device
        record_state = TrainState(total_steps=state.total_steps, steps_per_epoch=state.steps_per_epoch,
                                  global_batch_size=state.global_batch_size, step=step, epoch=state.epoch,
                                  samples_seen=state.samples_seen, lr=lr)
        record_state.loss = torch.tensor(float(loss), device=device)
        record_state.grad_norm = torch.tensor(float(grad_norm), device=device) if grad_norm is not None else None
        record_state.step_time_s, record_state.data_wait_s = self._interval.means()
        breakdown = self._breakdowns.pop(step, None)
        self._breakdowns = {key: value for key, value in self._breakdowns.items() if key > step}
        if breakdown is not None:
            record_state.extra["breakdown_s"] = breakdown
        if scalars:
            record_state.extra["scalars"] = scalars
        self._count_flops(flops_so_far)
        self.services.metrics.on_step_end(record_state)
        self.services.metrics.flush(record_state)
        self._interval.reset()

    def log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An ``eval`` record (rank 0 writes it)."""
        if self.context.is_main:
            self.services.metrics.write_event({"kind": "eval", "step": step, "epoch": self.state.epoch, **metrics,
                                               "time": time.time()})

    # -- checkpoints ----------------------------------------------------------------

    def barrier(self) -> None:
        """Every rank waits here (the framework's files are all written; the commit is done)."""
        if self._group is not None:
            with collective("the framework's checkpoint barrier"):
                dist.barrier(group=self._group)

    def saved(self, step: int, *, started_at_s: float, error: str | None = None,
              uploaded_at_s: float | None = None, upload_error: str | None = None) -> None:
        """Rank 0: the checkpoint of ``step`` was sealed (``error``: it was not): its records.

        ``started_at_s``: ``time.perf_counter()`` when the save began."""
        if not self.context.is_main:
            return
        now_s = time.perf_counter()
        committed = error is None
        if committed:
            self.last_committed_step = step
        record: dict[str, Any] = {"kind": "checkpoint", "step": step, "committed": committed,
                                  "stall_s": round(now_s - started_at_s, 6), "write_s": round(now_s - started_at_s, 6),
                                  "error": error, "time": time.time()}
        if uploaded_at_s is not None or upload_error is not None:
            record.update(uploaded=upload_error is None, upload_error=upload_error)
        self.services.metrics.write_event(record)
        if self.stopped == StopReason.PREEMPTED.label and step == self.stop_step:
            self.services.metrics.write_event(self._preemption_record(step, committed, uploaded_at_s, now_s))

    def _preemption_record(self, step: int, committed: bool, uploaded_at_s: float | None,
                           committed_at_s: float) -> dict[str, Any]:
        decision = self.services.decision
        now = time.time()
        noticed_at = decision.noticed_at_s if math.isfinite(decision.noticed_at_s) else now
        window_s = decision.deadline_s - noticed_at
        commit_wall_s = now - (time.perf_counter() - committed_at_s)
        record = {
            "kind": "preemption", "step": step, "reason": decision.stop_reason or self.stopped,
            "seconds_left_at_notice": None if math.isinf(window_s) else round(window_s, 3),
            "saved": committed, "checkpoint_step": self.last_committed_step,
            "notice_to_commit_s": round(commit_wall_s - noticed_at, 3), "time": now,
        }
        if uploaded_at_s is not None:
            upload_wall_s = now - (time.perf_counter() - uploaded_at_s)
            record["notice_to_upload_s"] = round(upload_wall_s - noticed_at, 3)
        return record

    # -- the end ----------------------------------------------------------------------

    def finish(self) -> int:
        """``run_end``, the diagnosis and the report; stop every thread. Returns the exit code
        the process should end with (see :func:`exit_code_for`); idempotent."""
        if self._finished:
            return exit_code_for(self.stopped)
        self._finished = True
        try:
            self.services.finish(self.state, self._started_at)
            if self.context.is_main:
                from skylift.monitor.report import write_run_report

                report = write_run_report(self.config)
                self._say_where_it_ended(report)
        finally:
            self.services.close()
            self._release_lease()
        return exit_code_for(self.stopped)

    def close(self) -> None:
        """Stop every background thread (after a failure; :meth:`finish` does it otherwise)."""
        self.services.close()
        self._release_lease()

    def _release_lease(self) -> None:
        self._lease.release()

    def exit(self, code: int) -> None:
        """End the process with ``code`` once every rank got here (so no rank's exit makes the
        launcher kill a peer still committing its checkpoint)."""
        self.barrier()
        exit_cleanly(code)

    def _write_config(self) -> None:
        """Rank 0: the run folder's ``config.yaml`` holds the sections skylift applied, under a
        header saying which framework ran the job and how; skylift's model, data and
        training defaults, which describe nothing here, are left out."""
        if self.job is None or not self.context.is_main:
            return
        from skylift.cloud.redact import redact_config

        resolved = redact_config(self.config.model_dump(mode="json"))
        applied = {key: resolved[key] for key in _APPLIED_SECTIONS if key in resolved}
        job = self.job
        described = {"framework": job.framework, "world_size": self.context.world_size,
                     "per_device_batch_size": job.per_device_batch_size, "data_num_workers": job.data_num_workers,
                     "compile": job.compile_enabled, **job.settings}
        header = [f"# A {job.framework} job: the framework's own arguments describe its model, data and training;",
                  "# skylift applied only the sections below (skylift's other settings do not describe this job).",
                  "# The job as the framework ran it:",
                  *(f"#   {line}" for line in yaml.safe_dump(described, sort_keys=False).splitlines())]
        run_dir = self.services.run_dir
        run_dir.write_text_atomic(run_dir.config_path,
                                  "\n".join(header) + "\n" + yaml.safe_dump(applied, sort_keys=False))

    def _say_where_it_ended(self, report: Report | None) -> None:
        run_dir = self.services.run_dir.root
        if self.stopped:
            print(f"skylift: stopped at step {self.state.step} ({self.stopped}); run folder {run_dir}", file=sys.stderr)
        if self.stopped == StopReason.PREEMPTED.label:
            committed = self.last_committed_step
            print(f"skylift: preempted; checkpoint step {committed} is complete; run the same command again to resume",
                  file=sys.stderr)
        elif report is not None:
            print(f"skylift: report {report.html_path}  (live view of a running job: skylift monitor {run_dir})",
                  file=sys.stderr)

    def _count_flops(self, flops_so_far: float | None) -> None:
        monitor = self.services.monitor
        if flops_so_far and monitor.wants_flops and self.state.samples_seen > 0:
            monitor.record_flops(flops_so_far, self.state.samples_seen)


class BatchCount:
    """Steps per epoch and samples seen, from a framework's training loader.

    The frameworks count steps, not samples; this counts full global batches, each
    epoch's last short one as what it holds (the dataset's length)."""

    def __init__(self, steps_per_epoch: int, global_batch: int, samples_per_epoch: int) -> None:
        self.steps_per_epoch = steps_per_epoch
        self.global_batch = global_batch
        self.samples_per_epoch = samples_per_epoch

    @classmethod
    def of(cls, loader: Any, *, per_rank_batch: int, world_size: int, accumulation: int) -> BatchCount:
        """``loader``: one rank's training loader (its length in batches, its dataset's in samples)."""
        global_batch = per_rank_batch * max(world_size, 1) * accumulation
        try:
            batches = len(loader)
        except TypeError:  # an iterable dataset: no epochs to count
            return cls(0, global_batch, 0)
        steps = max(math.ceil(batches / accumulation), 1)
        try:
            samples = len(loader.dataset)
        except (AttributeError, TypeError):
            samples = steps * global_batch
        return cls(steps, global_batch, samples)

    def samples_at(self, step: int) -> int:
        """Samples the first ``step`` optimizer steps took."""
        if not self.steps_per_epoch:
            return step * self.global_batch
        epochs, into = divmod(step, self.steps_per_epoch)
        return epochs * self.samples_per_epoch + min(into * self.global_batch, self.samples_per_epoch)


class _Interval:
    """Step and data-wait times since the last log, on this rank."""

    def __init__(self) -> None:
        self.reset()
        self.last_step_end_s = time.perf_counter()
        self.last_step_s = 0.0
        self.last_data_wait_s = 0.0

    def reset(self) -> None:
        self.steps = 0
        self.step_s = 0.0
        self.data_wait_s = 0.0
        self._data_wait_at_last_step = 0.0

    def step_done(self, now_s: float) -> None:
        self.last_step_s = now_s - self.last_step_end_s
        self.last_data_wait_s = self.data_wait_s - self._data_wait_at_last_step
        self._data_wait_at_last_step = self.data_wait_s
        self.step_s += self.last_step_s
        self.steps += 1
        self.last_step_end_s = now_s

    def means(self) -> tuple[float, float]:
        if not self.steps:
            return 0.0, 0.0
        return self.step_s / self.steps, self.data_wait_s / self.steps
