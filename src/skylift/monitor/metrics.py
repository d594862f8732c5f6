"""Per-step and evaluation metrics to ``metrics.jsonl`` and TensorBoard.

Records (one JSON object a line)::

    {"kind": "train", "step": 12, "epoch": 0, "loss": 0.41, "lr": 0.003,
     "grad_norm": 0.8, "samples_per_s": 5120.4, "step_time_s": 0.012,
     "data_wait_s": 0.0004, "samples_seen": 768, "time": 1764432000.1}
    {"kind": "eval", "step": 22, "epoch": 0, "loss": 0.2, "accuracy": 0.95, "time": ...}

``loss`` is the mean over the whole global batch (all ranks, all micro-steps).
``samples_per_s`` is the throughput over the logging interval the record belongs to,
measured after the device finished the interval's work, so it is honest on GPUs
where a single step's host time is not.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch
import torch.distributed as dist

from skylift.run_dir import RunDirectory
from skylift.train.events import Callback, TrainState

__all__ = ["MetricsLogger"]


class MetricsLogger(Callback):
    """Buffers step records with losses still on the device; flushes every N steps.

    Runs on every rank (the flush averages losses across ranks with one all-reduce
    per interval); only the writer rank opens files.
    """

    def __init__(self, run_dir: RunDirectory, *, log_every_steps: int, tensorboard: bool, is_writer: bool) -> None:
        self.run_dir = run_dir
        self.log_every_steps = log_every_steps
        self.is_writer = is_writer
        self.use_tensorboard = tensorboard and is_writer
        self.last_logged: dict[str, Any] = {}
        self._pending: list[dict[str, Any]] = []
        self._pending_tensors: list[torch.Tensor] = []
        self._interval_started = time.perf_counter()
        self._file: Any = None
        self._tensorboard: Any = None

    def on_fit_start(self, state: TrainState) -> None:
        self._interval_started = time.perf_counter()
        if not self.is_writer:
            return
        self._file = self.run_dir.metrics_path.open("a", buffering=1)
        if self.use_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(self.run_dir.tensorboard_dir))

    def on_step_end(self, state: TrainState) -> None:
        assert state.loss is not None
        norm = state.grad_norm if state.grad_norm is not None else torch.zeros((), device=state.loss.device)
        self._pending_tensors.append(torch.stack([state.loss.float(), norm.float()]))
        self._pending.append(
            {
                "kind": "train",
                "step": state.step,
                "epoch": state.epoch,
                "lr": state.lr,
                "step_time_s": round(state.step_time_s, 6),
                "data_wait_s": round(state.data_wait_s, 6),
                "samples_seen": state.samples_seen,
            }
        )
        if state.step % self.log_every_steps == 0 or state.step >= state.total_steps:
            self.flush(state)

    def on_eval_end(self, state: TrainState) -> None:
        self.flush(state)
        record = {"kind": "eval", "step": state.step, "epoch": state.epoch, **state.eval_metrics}
        self._write(record)
        for name, value in state.eval_metrics.items():
            self._scalar(f"eval/{name}", value, state.step)

    def on_fit_end(self, state: TrainState) -> None:
        self.flush(state)
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._file is not None:
            self._file.close()

    def write_event(self, record: dict[str, Any]) -> None:
        """Write a record of another kind (``checkpoint``, ``preemption``) at once."""
        self._write(record)
        if self._file is not None:
            self._file.flush()

    def flush(self, state: TrainState) -> None:
        """Materialise buffered losses (one device sync, one all-reduce) and write them."""
        if not self._pending:
            return
        values = torch.stack(self._pending_tensors)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(values, op=dist.ReduceOp.SUM)
            values /= dist.get_world_size()
        rows = values.tolist()
        elapsed = time.perf_counter() - self._interval_started
        samples_per_s = len(rows) * state.global_batch_size / elapsed if elapsed > 0 else 0.0
        for record, (loss, grad_norm) in zip(self._pending, rows, strict=True):
            record.update(loss=loss, samples_per_s=round(samples_per_s, 2), time=time.time())
            if state.grad_norm is not None:
                record["grad_norm"] = grad_norm
            self._write(record)
            self._scalar("train/loss", loss, record["step"])
            self._scalar("train/lr", record["lr"], record["step"])
        self._scalar("train/samples_per_s", samples_per_s, state.step)
        self.last_logged = self._pending[-1]
        self._pending, self._pending_tensors = [], []
        self._interval_started = time.perf_counter()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")

    def _scalar(self, tag: str, value: float, step: int) -> None:
        if self._tensorboard is not None:
            self._tensorboard.add_scalar(tag, value, step)
