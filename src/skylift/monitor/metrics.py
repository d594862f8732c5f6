"""Per-step and evaluation metrics to ``metrics.jsonl`` and TensorBoard.

Records (one JSON object a line)::

    {"kind": "train", "step": 12, "epoch": 0, "loss": 0.41, "lr": 0.003,
     "grad_norm": 0.8, "samples_per_s": 5120.4, "step_time_s": 0.012,
     "data_wait_s": 0.0004, "samples_seen": 768, "time": 1764432000.1}
    {"kind": "eval", "step": 22, "epoch": 0, "loss": 0.2, "accuracy": 0.95, "time": ...}

``loss`` is the mean over the whole global batch (all ranks, all micro-steps).
``samples_per_s`` is the throughput over the logging interval the record belongs to,
measured after the device finished the interval's work, so it is honest on GPUs
where a single step's host time is not; ``mfu`` is over the same interval. Sampled
steps carry ``breakdown_s`` (rank 0's phases) and ``breakdown_by_rank_s`` (every
rank's, gathered with the losses). The full schema: :mod:`skylift.monitor.schema`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from skylift.loop.collectives import collective
from skylift.loop.events import Callback, TrainState
from skylift.monitor.schema import BREAKDOWN_PHASES
from skylift.run_dir import RunDirectory

__all__ = ["RESERVED_TRAIN_FIELDS", "MetricsLogger"]

RESERVED_TRAIN_FIELDS = frozenset({
    "kind", "step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s", "data_wait_s",
    "samples_seen", "time", "mfu", "flops_per_step", "breakdown_s", "breakdown_by_rank_s",
})
"""Fields of a ``train`` record that skylift writes; a user's own scalars take other names."""


class MetricsLogger(Callback):
    """Buffers step records with losses still on the device; flushes every N steps.

    Runs on every rank (the flush averages losses across ranks with one all-reduce
    per interval); only the writer rank opens files.
    """

    def __init__(self, run_dir: RunDirectory, *, log_every_steps: int, tensorboard: bool, is_writer: bool,
                 num_nodes: int = 1) -> None:
        self.run_dir = run_dir
        self.log_every_steps = log_every_steps
        self.is_writer = is_writer
        self.use_tensorboard = tensorboard and is_writer
        self.num_nodes = num_nodes
        self.last_logged: dict[str, Any] = {}
        self.after_flush: list[Callable[[TrainState, float | None], None]] = []
        """Called after each flush with the state and the interval's seconds per step."""
        self._pending: list[dict[str, Any]] = []
        self._pending_tensors: list[torch.Tensor] = []
        self._pending_breakdowns: list[torch.Tensor] = []
        self._pending_scalars: list[tuple[dict[str, Any], list[str], torch.Tensor]] = []
        """(record, names, values on the device) of the user's own scalars (``Runtime.log``)."""
        self._interval_started = time.perf_counter()
        self._file: Any = None
        self._tensorboard: Any = None
        # The system sampler writes from its own thread; reentrant, since an observer of
        # one record may write another (a guard's).
        self._lock = threading.RLock()
        self.observers: list[Callable[[dict[str, Any]], None]] = []
        """Called with every record written here (the guards watch ``cost`` and ``system``)."""
        self._remote: list[dict[str, Any]] = []
        self._flops_per_sample: float | None = None
        self._peak_flops_per_s: float | None = None
        self._world_size = 1
        self._samples_at_interval_start = 0
        self._flops_by_step = False
        self._step_flops = 0.0
        self._pending_flops: list[float] = []

    def set_flops(self, flops_per_sample: float, peak_flops_per_s: float, world_size: int = 1) -> None:
        """Turn on MFU: model FLOPs per training sample (forward + backward), one device's peak.

        Per sample rather than per step, so batches of varying size (token budgets)
        are counted by what they hold.
        """
        self._flops_per_sample = flops_per_sample
        self._peak_flops_per_s = peak_flops_per_s
        self._world_size = world_size

    def count_flops_by_step(self, peak_flops_per_s: float | None, world_size: int = 1) -> None:
        """Turn on MFU from each step's own FLOPs (:meth:`add_flops`), for batches whose
        cost per sample varies (token budgets); ``peak_flops_per_s`` ``None``: FLOPs only."""
        self._flops_by_step = True
        self._peak_flops_per_s = peak_flops_per_s
        self._world_size = world_size

    def add_flops(self, flops: float) -> None:
        """FLOPs of one micro-batch of this rank, added to the current step."""
        self._step_flops += flops

    def queue_remote(self, record: dict[str, Any]) -> None:
        """Hold a record of another node (its system samples) until the next gather."""
        with self._lock:
            self._remote.append(record)

    def on_fit_start(self, state: TrainState) -> None:
        self._interval_started = time.perf_counter()
        self._samples_at_interval_start = state.samples_seen  # after a resume: the checkpoint's count
        if not self.is_writer:
            return
        self._file = self.run_dir.metrics_path.open("a", buffering=1)
        if _ends_torn(self.run_dir.metrics_path):
            self._file.write("\n")  # a killed attempt left half a line: keep ours whole
        if self.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir.tensorboard_dir))

    def on_step_end(self, state: TrainState) -> None:
        assert state.loss is not None
        norm = state.grad_norm if state.grad_norm is not None else torch.zeros((), device=state.loss.device)
        self._pending_tensors.append(torch.stack([state.loss.float(), norm.float()]))
        record: dict[str, Any] = {
            "kind": "train",
            "step": state.step,
            "epoch": state.epoch,
            "lr": state.lr,
            "step_time_s": round(state.step_time_s, 6),
            "data_wait_s": round(state.data_wait_s, 6),
            "samples_seen": state.samples_seen,
        }
        breakdown = state.extra.get("breakdown_s")
        if breakdown is not None:
            record["breakdown_s"] = breakdown
            values = [breakdown[phase] for phase in BREAKDOWN_PHASES]
            self._pending_breakdowns.append(torch.tensor(values, dtype=torch.float64))
        self._pending.append(record)
        if self._flops_by_step:
            self._pending_flops.append(self._step_flops)
            self._step_flops = 0.0
        scalars = state.extra.get("scalars")
        if scalars:
            names = sorted(scalars)
            device = state.loss.device
            scalar_values = torch.stack([torch.as_tensor(scalars[name], device=device).detach().float().reshape(())
                                         for name in names])
            self._pending_scalars.append((record, names, scalar_values))
        if state.step % self.log_every_steps == 0 or state.step >= state.total_steps:
            self.flush(state)

    def on_eval_end(self, state: TrainState) -> None:
        self.flush(state)
        record = {"kind": "eval", "step": state.step, "epoch": state.epoch, **state.eval_metrics, "time": time.time()}
        self.write_event(record)
        for name, value in state.eval_metrics.items():
            self._scalar(f"eval/{name}", value, state.step)

    def on_fit_end(self, state: TrainState) -> None:
        self.flush(state)
        if self._tensorboard is not None:
            self._tensorboard.close()
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def write_event(self, record: dict[str, Any]) -> None:
        """Write a record of another kind (``checkpoint``, ``system``, ...) at once."""
        with self._lock:
            self._write(record)
            if self._file is not None:
                self._file.flush()

    def flush(self, state: TrainState) -> None:
        """Materialise buffered losses (one device sync, one all-reduce) and write them."""
        if not self._pending:
            return
        values = torch.stack(self._pending_tensors)
        if dist.is_available() and dist.is_initialized():
            with collective("the metrics flush (all_reduce)"):
                dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= dist.get_world_size()
        rows = values.tolist()
        by_rank = self._gather_breakdowns()
        self._resolve_scalars()
        remote = self._gather_remote()
        elapsed = time.perf_counter() - self._interval_started
        # The samples the interval really took (token-budget steps vary in size).
        samples = state.samples_seen - self._samples_at_interval_start
        samples_per_s = samples / elapsed if elapsed > 0 else 0.0
        step_flops = self._steps_flops(len(rows), samples, values.device)
        mfu = self._mfu(step_flops, elapsed)
        with self._lock:
            for record, (loss, grad_norm), flops in zip(self._pending, rows, step_flops, strict=True):
                record.update(loss=loss, samples_per_s=round(samples_per_s, 2), time=time.time())
                if state.grad_norm is not None:
                    record["grad_norm"] = grad_norm
                if flops is not None:
                    record["flops_per_step"] = flops
                if mfu is not None:
                    # Significant digits, not decimals: a small model on an H200 runs at an MFU
                    # of 1e-6, which five decimals would write as 0.
                    record["mfu"] = float(f"{mfu:.4g}")
                if "breakdown_s" in record and by_rank:
                    record["breakdown_by_rank_s"] = by_rank.pop(0)
                self._write(record)
                self._scalar("train/loss", loss, record["step"])
                self._scalar("train/lr", record["lr"], record["step"])
            for record in remote:
                self._write(record)
        self._scalar("train/samples_per_s", samples_per_s, state.step)
        if mfu is not None:
            self._scalar("train/mfu", mfu, state.step)
        self.last_logged = self._pending[-1]
        self._pending, self._pending_tensors = [], []
        self._interval_started = time.perf_counter()
        self._samples_at_interval_start = state.samples_seen
        for hook in self.after_flush:
            hook(state, elapsed / len(rows) if rows else None)

    def _resolve_scalars(self) -> None:
        """Average the user's scalars over ranks (one all-reduce for the interval) into their records."""
        pending, self._pending_scalars = self._pending_scalars, []
        if not pending:
            return
        values = torch.cat([entry[2] for entry in pending])
        if dist.is_available() and dist.is_initialized():
            with collective("the metrics flush (all_reduce)"):
                dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= dist.get_world_size()
        flat = iter(values.tolist())
        for record, names, _ in pending:
            for name in names:
                record[name] = next(flat)
                self._scalar(f"train/{name}", record[name], record["step"])

    def _steps_flops(self, steps: int, samples: int, device: torch.device) -> list[float | None]:
        """One rank's FLOPs of each pending step (the mean over ranks): counted per step, or
        FLOPs per sample times the interval's samples, spread evenly over its steps."""
        if not self._flops_by_step:
            if self._flops_per_sample is None or not self._peak_flops_per_s:
                return [None] * steps
            return [self._flops_per_sample * samples / (steps * self._world_size)] * steps
        counted, self._pending_flops = self._pending_flops, []
        if dist.is_available() and dist.is_initialized():
            # float64: FLOP counts are integers, exact below 2**53 (9e15 per step per rank).
            summed = torch.tensor(counted, dtype=torch.float64, device=device)
            with collective("the FLOP count (all_reduce)"):
                dist.all_reduce(summed, op=dist.ReduceOp.SUM)
            counted = (summed / dist.get_world_size()).tolist()
        return [None] * (steps - len(counted)) + counted

    def _mfu(self, step_flops: list[float | None], elapsed_s: float) -> float | None:
        """One rank's FLOPs over the interval / (its seconds x one device's peak)."""
        counted = [flops for flops in step_flops if flops is not None]
        if not self._peak_flops_per_s or elapsed_s <= 0 or len(counted) < len(step_flops):
            return None
        return sum(counted) / (elapsed_s * self._peak_flops_per_s)

    def _gather_breakdowns(self) -> list[list[dict[str, float]]]:
        """Every rank's breakdowns of the pending sampled steps: one list (by rank) per step."""
        pending, self._pending_breakdowns = self._pending_breakdowns, []
        if not pending:
            return []
        local = torch.stack(pending)
        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return []  # one rank: breakdown_s already says it all
        device = self._pending_tensors[0].device if self._pending_tensors else local.device
        local = local.to(device)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
        with collective("the metrics gather (all_gather)"):
            dist.all_gather(gathered, local)
        per_rank = torch.stack(gathered, dim=1).cpu().tolist()  # [step][rank][phase]
        return [[{phase: round(v, 6) for phase, v in zip(BREAKDOWN_PHASES, rank, strict=True)} for rank in step]
                for step in per_rank]

    def _gather_remote(self) -> list[dict[str, Any]]:
        """Other nodes' queued records, brought to rank 0 (every rank calls this)."""
        if self.num_nodes <= 1 or not (dist.is_available() and dist.is_initialized()):
            return []
        with self._lock:
            mine, self._remote = self._remote, []
        gathered: list[Any] = [None] * dist.get_world_size()
        with collective("the metrics gather of remote records (all_gather)"):
            dist.all_gather_object(gathered, mine)
        return [record for records in gathered if records for record in records] if self.is_writer else []

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
        for observer in self.observers:
            observer(record)

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._tensorboard is not None:
            self._tensorboard.add_scalar(tag, value, step)


def _ends_torn(path: Any) -> bool:
    """Whether the file's last byte is not a newline (a writer was killed mid-line)."""
    with open(path, "rb") as existing:
        existing.seek(0, 2)
        if existing.tell() == 0:
            return False
        existing.seek(-1, 2)
        return existing.read(1) != b"\n"
