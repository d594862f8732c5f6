"""Checkpointing for one run: lease, resume, cadence, emergency save, final save.

The Trainer calls :meth:`open` before building anything expensive, :meth:`resume`
once the model and optimizer exist, :meth:`after_step` at every step boundary with
the ranks' agreed :class:`~skylift.loop.agreement.Decision`, and :meth:`close` at the
end. Every decision that can abort is taken collectively.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from skylift.checkpoint import compatibility
from skylift.checkpoint.lease import FencedStore, LeaseHeldError, RunLease
from skylift.checkpoint.manager import CheckpointManager, SaveResult
from skylift.checkpoint.manifest import CorruptCheckpointError, Manifest, step_folder
from skylift.checkpoint.memory_tier import MemoryTier, check_budget, join_ring, passed_over_safe_step, refuse_misuse
from skylift.checkpoint.selection import ResumeSelection
from skylift.checkpoint.sharded import capture_sharded, is_sharded, restore_sharded
from skylift.checkpoint.state import (
    SHARDED,
    capture,
    restore_extra,
    restore_replicated,
    restore_rng,
    rng_files,
)
from skylift.checkpoint.tiers import LocalTier, read_with_fallback
from skylift.config.schema import CheckpointConfig
from skylift.errors import SkyliftConfigError, SkyliftError
from skylift.loop.agreement import Decision, StepAgreement, StopReason
from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.storage import StorageError, Store, open_store
from skylift.storage.local import LocalStore

__all__ = ["CheckpointLoadError", "Checkpointing", "TrainingObjects"]

log = logging.getLogger("skylift")
_SAFETY_FACTOR = 1.5
"""An emergency save starts only if 1.5x the last measured save time fits the window."""


class CheckpointLoadError(SkyliftError):
    """No checkpoint the resume may take loads into this run, though their files verify:
    they are kept, and the run does not start over."""


@dataclass
class TrainingObjects:
    """What a checkpoint holds, besides the counters in TrainState."""

    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    loader: Any = None
    """A data loader with ``state_dict()``/``load_state_dict()`` (its place in the epoch), or None."""
    extra: dict[str, Any] | None = None
    """The user's own state (tensors and JSON values), saved and filled in again on resume."""


class Checkpointing:
    def __init__(
        self,
        config: CheckpointConfig,
        *,
        run_dir: Path,
        context: DistributedContext,
        agreement: StepAgreement,
        control_group: Any = None,
        run_config: Any = None,
        precision: str | None = None,
        facts: dict[str, str] | None = None,
    ) -> None:
        """``run_config`` (a RunConfig), ``precision`` (as resolved) and ``facts`` (what the
        state depends on beyond the settings: the frozen base's fingerprint): recorded in
        every manifest and compared with a checkpoint's before it loads (compatibility.py)."""
        self.config = config
        self.run_config, self.precision, self.facts = run_config, precision, facts
        self.context = context
        self.agreement = agreement
        self._control_group = control_group
        self.store: Store = open_store(config.root or str(run_dir / "checkpoints"), endpoint_url=config.endpoint_url)
        commit_group = dist.new_group(backend="gloo") if context.is_distributed else None
        self.tier = self._local_tier(config, context)
        if isinstance(self.tier, MemoryTier):
            timeout_s = run_config.distributed.timeout_s if run_config is not None else 600.0
            join_ring(self.tier, context.node_rank, self._gather_all, timeout_s=timeout_s)
        self.lease = RunLease(self.store, ttl_s=config.lease_ttl_s) if context.is_main else None
        self.manager = CheckpointManager(
            FencedStore(self.store, self.lease),  # a job that lost the lease writes nothing more
            rank=context.rank,
            world_size=context.world_size,
            keep=config.keep,
            async_save=config.async_save,
            group=commit_group,
            on_commit_failure=self._on_save_failure,
            tier=self.tier,
        )
        if run_config is not None:
            self.manager.run_config = compatibility.recorded_config(run_config, precision or run_config.precision,
                                                                    facts)  # fmt: skip
        self._changed: list[str] = []  # changeable fields of the checkpoint restored that this run changes
        self._changes_line: str | None = None
        self.objects: TrainingObjects | None = None
        self._buffers: dict[str, Any] = {}  # host copies reused between saves
        self._recorded = 0
        self._last_saved_step: int | None = None
        self._sharded = False  # the model's parameters are DTensors (set by resume())
        self.selection = ResumeSelection(config.resume, self.store, self.tier, context, self._gather_all,
                                         self._broadcast)
        self._last_save_time = time.monotonic()
        self.resumed_manifest: Manifest | None = None  # as read (from whichever copy verified)
        self.stall_between_steps_s = 0.0
        self.stall_in_optimizer_s = 0.0

    def open(self) -> None:
        """Take the run lease (rank 0; every rank learns the outcome) and clean up."""
        error = None
        if self.lease is not None:
            try:
                self.lease.acquire()
                self.manager.remove_uncommitted()
            except LeaseHeldError as held:
                error = str(held)
        error = self._broadcast(error)
        if error:
            raise LeaseHeldError(error)
        if self.tier is not None and self.tier.node_leader:
            self.tier.remove_uncommitted()

    def resume(self, objects: TrainingObjects, state: TrainState) -> int | None:
        """Restore the checkpoint ``checkpoint.resume`` selects; return its step."""
        self.objects = objects
        if self.config.async_save:
            # A background save copies parameters and optimizer state while the next
            # forward and backward run; only the optimizer step must wait for it.
            objects.optimizer.register_step_pre_hook(self._before_optimizer_step)
        self._sharded = is_sharded(objects.model)
        built = compatibility.OptimizerSettings(objects.optimizer, objects.scheduler)  # before a load replaces them
        if isinstance(self.tier, MemoryTier):
            check_budget(self.tier, objects, self._sharded, self.context, self._gather_all)
        restored = self._select_and_restore(objects)
        if isinstance(self.tier, MemoryTier) and self.context.is_main:
            passed_over_safe_step(self.store, restored[0] if restored is not None else None)
        self.manager.timeline = self.selection.continue_timeline(restored[3] if restored is not None else None)
        if restored is None:
            return None
        step, contents, counters, self.resumed_manifest = restored
        if self._changed:
            built.put_back(self._changed, objects.optimizer, objects.scheduler)
        self._restore_rng(contents, step)
        state.step, state.epoch, state.samples_seen = counters["step"], counters["epoch"], counters["samples_seen"]
        if objects.loader is not None and "loader" in counters:
            objects.loader.load_state_dict(counters["loader"])
        if objects.extra is not None:
            restore_extra(contents, objects.extra)
        self._last_saved_step = step
        log.info("resumed from %s%s", self.store.describe(f"step-{step}"), self.selection.resumed_from)
        if self._changes_line and self.context.is_main:
            log.info("%s", self._changes_line)
        return step

    def _select_and_restore(
        self, objects: TrainingObjects
    ) -> tuple[int, dict[str, bytes], dict[str, Any], Manifest] | None:
        """The checkpoint ``checkpoint.resume`` selects, loaded into ``objects``: (its step,
        this rank's files of it, its counters, its manifest), or None for a fresh start.

        Before anything loads, the checkpoint's recorded config is compared with this
        run's: a change its state cannot take stops the resume on every rank (exit 2), and
        is never a reason to try an older checkpoint.

        A checkpoint that fails during the load fails on every rank alike, as the ranks
        agree: a sharded one's shard that fails its hash (DCP reads the shards during the
        load), or files that verify but do not load (a header that does not parse, a
        state dict that does not fit). ``auto`` goes on to the next older checkpoint (the
        load overwrites every tensor again). If none loads and some verified, the resume
        stops: the likely cause is this run's model, not every checkpoint, so none is
        passed over for step 0.
        """
        unloadable: list[str] = []
        for step, manifest, contents in self.selection.checkpoints():
            where = self.store.describe(step_folder(step))
            self._judge_config(manifest, where)
            failure, corrupt = None, False
            try:
                counters = self._restore(objects, manifest, contents)
            except (SkyliftConfigError, StorageError):
                raise  # a refusal, or a store that could not be read: never a reason to go back
            except CorruptCheckpointError as error:  # a shard read during a sharded load
                failure, corrupt = str(error), True
            except Exception as error:  # noqa: BLE001 - verified bytes that do not load, whatever the unpickler raised
                failure = _first_lines(error)
            reports = [report for report in self._gather_all((failure, corrupt)) if report[0]]
            if not reports:
                return step, contents, counters, manifest
            problem, corrupt = reports[0]
            if self.config.resume != "auto":
                if corrupt:
                    raise CorruptCheckpointError(problem)
                raise CheckpointLoadError(f"cannot resume {where}: its files verify but it does not load into this "
                                          f"run ({problem}); no other checkpoint is tried for an explicit step")
            if corrupt:
                log.warning("skipping checkpoint %s: %s", where, problem)
                continue
            log.warning("skipping checkpoint %s: it verifies but does not load into this run (%s)", where, problem)
            unloadable.append(f"{step_folder(step)}: {problem}")
        if unloadable:
            raise CheckpointLoadError(
                f"cannot resume: no checkpoint under {self.store.url} loads into this run ({'; '.join(unloadable)}); "
                "they are kept and the run did not start over: resume with the settings that wrote them, or train "
                "from step 0 in a new checkpoint.root")
        return None

    def _judge_config(self, manifest: Manifest, where: str) -> None:
        """Compare the checkpoint's recorded config with this run's (rank 0 decides for
        every rank): refuse, or note the changes it takes (:attr:`_changed`)."""
        if self.run_config is None:
            return
        verdict: tuple[tuple[str, str] | None, list[str], str | None] | None = None  # (refusal, changes, line)
        if self.context.is_main:
            if manifest.config is None:
                verdict = (None, [], (f"{where} records no config (written by an earlier skylift): this run's "
                                      "settings are not compared with its"))
            else:
                differences = compatibility.compare(manifest.config, self.run_config,
                                                    self.precision or self.run_config.precision, self.facts)
                verdict = (compatibility.refusal(differences, where), [item.field for item in differences],
                           compatibility.summary(differences, manifest.step))
        refused, self._changed, self._changes_line = self._broadcast(verdict)
        if refused is not None:
            raise SkyliftConfigError(refused[0], hint=refused[1])

    def _restore(self, objects: TrainingObjects, manifest: Manifest, contents: dict[str, bytes]) -> dict[str, Any]:
        """Load one checkpoint (either layout) into ``objects``; return its counters."""
        if manifest.layout == SHARDED:
            return restore_sharded(
                contents, self._shard_reader(manifest), model=objects.model, optimizer=objects.optimizer,
                scheduler=objects.scheduler, scaler=objects.scaler, group=self.manager.group,
                where=self.store.describe(step_folder(manifest.step)),
            )
        if self._sharded:
            raise SkyliftConfigError(
                f"{self.store.describe(step_folder(manifest.step))} holds a whole (replicated) model, saved by a "
                "run without sharding, and this run's model is sharded (distributed.strategy: fsdp)",
                hint="Resume it with distributed.strategy: ddp (its next save is then replicated too), or start "
                "the sharded run from a new checkpoint.root.",
            )
        return restore_replicated(
            contents, model=objects.model, optimizer=objects.optimizer, scheduler=objects.scheduler,
            scaler=objects.scaler,
        )

    def _shard_reader(self, manifest: Manifest) -> Callable[[str], bytes]:
        """Verified bytes of one of the checkpoint's shard files, local copy first."""
        local = self.tier.store if self.tier is not None else None

        def read(name: str) -> bytes:
            return read_with_fallback(manifest, [name], local, self.store)[0][name]

        return read

    def _before_optimizer_step(self, *_: Any) -> None:
        started = time.perf_counter()
        self.manager.wait_for_copies()
        self.stall_in_optimizer_s += time.perf_counter() - started

    def stall_s(self) -> tuple[float, float]:
        """Seconds the training thread spent saving, so far: (between steps, in optimizer steps)."""
        return self.stall_between_steps_s, self.stall_in_optimizer_s

    def finished_saves(self) -> list[dict[str, Any]]:
        """``checkpoint`` metrics records of the saves finished since the last call, in order."""
        records = []
        history = self.manager.history
        while self._recorded < len(history) and history[self._recorded].finished:
            result = history[self._recorded]
            records.append(
                {
                    "kind": "checkpoint",
                    "step": result.step,
                    "committed": result.committed,
                    "stall_s": round(result.stall_s, 4),
                    "write_s": round(result.write_s, 4),
                    "error": result.error,
                    **self._tier_fields(result),
                    "time": time.time(),
                }
            )
            self._recorded += 1
        return records

    def _tier_fields(self, result: SaveResult) -> dict[str, Any]:
        if self.tier is None:
            return {}
        local_s = None if result.local_commit_s is None else round(result.local_commit_s, 4)
        fields = {"local_commit_s": local_s, "uploaded": result.uploaded, "upload_error": result.upload_error}
        if self.tier.replicates:
            fields.update(safe=result.safe, safe_s=None if result.safe_s is None else round(result.safe_s, 4),
                          safe_error=result.safe_error)
        return fields

    def due(self, state: TrainState, decision: Decision) -> bool:
        """Whether to save at this step (the same answer on every rank).

        Rank 0's clock only *requests* a time-based save; the ranks agree on it at the
        next boundary, since their clocks differ.
        """
        minutes = self.config.every_minutes
        if minutes and self.context.is_main and time.monotonic() - self._last_save_time >= 60 * minutes:
            self.agreement.request_save()
            self._last_save_time = time.monotonic()
        every_steps = self.config.every_steps or 0
        by_steps = every_steps != 0 and state.step % every_steps == 0
        return (by_steps or decision.save) and state.step != self._last_saved_step

    def save(self, state: TrainState, *, blocking: bool = False) -> SaveResult | None:
        if state.step == self._last_saved_step:
            return None
        if self.config.when_busy == "skip" and self._any_rank_busy():
            log.warning("checkpoint at step %d skipped: the previous save is still being written", state.step)
            return None
        started = time.perf_counter()
        try:
            return self._save(state, blocking)
        finally:
            self.stall_between_steps_s += time.perf_counter() - started

    def _save(self, state: TrainState, blocking: bool) -> SaveResult | None:
        objects = self.objects
        assert objects is not None, "resume() attaches the training objects first"
        # The epoch a resume starts in, derived from the step (at an epoch boundary that
        # is the next epoch, not the one whose last step this was).
        epoch = state.step // state.steps_per_epoch if state.steps_per_epoch else state.epoch
        counters = {"step": state.step, "epoch": epoch, "samples_seen": state.samples_seen}
        if objects.loader is not None:
            counters["loader"] = objects.loader.state_dict()
        take = functools.partial(capture_sharded, group=self.manager.group) if self._sharded else capture
        result = self.manager.save(
            lambda: take(
                step=state.step,
                rank=self.context.rank,
                model=objects.model,
                optimizer=objects.optimizer,
                scheduler=objects.scheduler,
                scaler=objects.scaler,
                counters=counters,
                buffers=self._buffers,
                defer=self.config.async_save and not blocking,
                reference_host_tensors=blocking or not self.config.async_save,
                # Every node's disk gets the replicated state too, or a node's ranks
                # could never resume from their local copy alone.
                replicated=self.context.rank == 0 or (self.tier is not None and self.tier.node_leader),
                extra=objects.extra,
            ),
            state.step,
            blocking=blocking,
        )
        self._last_saved_step = state.step
        self._last_save_time = time.monotonic()
        return result

    def save_for_preemption(self, state: TrainState, decision: Decision) -> dict[str, Any]:
        """Save the current step if it fits the notice window; return the ``preemption`` record.

        A background save still in flight is for an older step: when the new save fits,
        the old one is cancelled (its files abandoned) instead of finishing first, so the
        worst case is one save, not one and a half.
        """
        noticed_at_s = decision.noticed_at_s if math.isfinite(decision.noticed_at_s) else time.time()
        estimate_s = self._save_estimate_s()
        seconds_left = decision.deadline_s - time.time()
        fits = bool(self._broadcast(estimate_s is None or estimate_s * _SAFETY_FACTOR < seconds_left))
        if fits and state.step != self._last_saved_step:
            self.manager.cancel_in_flight()
        self.manager.wait()
        result = self.save(state, blocking=True) if fits else None
        committed = self.manager.last_committed
        if not fits:
            log.warning(
                "preempted: a save needs ~%.1f s but %.1f s are left; relying on checkpoint step %s",
                estimate_s, seconds_left, committed.step if committed else None,
            )
        now = time.time()
        window_s = decision.deadline_s - noticed_at_s
        # With a local tier the checkpoint exists once committed locally; the upload
        # that follows is reported apart.
        local_at = result.local_committed_at if result is not None and result.committed else None
        return {
            "kind": "preemption",
            "step": state.step,
            "reason": decision.stop_reason,
            "seconds_left_at_notice": None if math.isinf(window_s) else round(window_s, 3),
            "saved": bool(result and result.committed) or self._last_saved_step == state.step,
            "checkpoint_step": committed.step if committed else None,
            "notice_to_commit_s": round((local_at or now) - noticed_at_s, 3),
            **({"notice_to_upload_s": round(now - noticed_at_s, 3) if result and result.uploaded else None}
               if self.tier is not None else {}),
            **({"notice_to_safe_s": round(result.safe_at - noticed_at_s, 3) if result and result.safe_at else None}
               if self.tier is not None and self.tier.replicates else {}),
            "time": now,
        }

    def finish(self, state: TrainState) -> None:
        """The final save (if configured), then wait until nothing is in flight."""
        if self.config.save_at_end and state.stop_requested is None:
            self.save(state)
        self.manager.wait()
        if isinstance(self.tier, MemoryTier) and state.stop_requested is None:
            self.tier.ended_durable = bool(self.manager.last_committed and self.manager.last_committed.uploaded)

    def close(self) -> None:
        self.manager.close()
        if isinstance(self.tier, MemoryTier):
            self.tier.close()
        if self.lease is not None:
            self.lease.release()

    def _gather_all(self, value: Any) -> list[Any]:
        if not self.context.is_distributed:
            return [value]
        values: list[Any] = [None] * self.context.world_size
        with collective("the checkpoint session's exchange (all_gather)"):
            dist.all_gather_object(values, value, group=self._control_group)
        return values

    def _local_tier(self, config: CheckpointConfig, context: DistributedContext) -> LocalTier | None:
        if config.memory.enabled:
            refuse_misuse(self.store, config.local_root)
            return MemoryTier(config.memory, self.store, node_leader=context.local_rank == 0)
        if config.local_root is None:
            return None
        if isinstance(self.store, LocalStore):
            raise SkyliftConfigError(
                f"checkpoint.local_root is set but checkpoint.root ({self.store.url}) is a local folder; a local "
                "copy only helps in front of an object store: set checkpoint.root to an s3://, oss:// or cos:// "
                "URL, or drop checkpoint.local_root"
            )
        return LocalTier(config.local_root, self.store, node_leader=context.local_rank == 0)

    def _restore_rng(self, contents: dict[str, bytes], step: int) -> None:
        tensors_file, json_file = rng_files(self.context.rank)
        if tensors_file in contents and json_file in contents:
            restore_rng(contents[tensors_file], contents[json_file])
        else:
            log.warning("checkpoint step %d has no RNG state for rank %d (saved with fewer ranks)",
                        step, self.context.rank)

    def _save_estimate_s(self) -> float | None:
        """The fastest of the last three saves (to the local commit, with a local tier):
        background saves are slowed by the training running beside them, which would
        overstate a blocking save."""
        done = [
            result.stall_s + (result.write_s if result.local_commit_s is None else result.local_commit_s)
            for result in self.manager.history
            if result.committed
        ]
        return min(done[-3:]) if done else None

    def _any_rank_busy(self) -> bool:
        busy = self.manager.busy
        if not self.context.is_distributed:
            return busy
        import torch

        flag = torch.tensor([float(busy)])
        with collective("the check for a save still being written (all_reduce)"):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control_group)
        return bool(flag.item())

    def _on_save_failure(self, error: str) -> None:
        if self.config.on_failure == "exit":
            self.agreement.request_stop(StopReason.SAVE_FAILED)

    def _broadcast(self, value: Any) -> Any:
        if not self.context.is_distributed:
            return value
        holder = [value]
        with collective("the checkpoint session's broadcast from rank 0"):
            dist.broadcast_object_list(holder, src=0, group=self._control_group)
        return holder[0]


def _first_lines(error: BaseException) -> str:
    """The error on one line: its type and first two lines (a state dict's mismatches run on)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    text = " ".join(lines[:2])
    return f"{type(error).__name__}: {text[:300]}{'...' if len(text) > 300 or len(lines) > 2 else ''}"
