"""The run monitor: one callback that writes what the loop's own metrics don't.

It owns the ``run_start`` record (device, peak FLOP/s, prices, the loader sweep),
the system sampler, MFU's FLOP count, the cost ledger, and at the end the
diagnosis and ``run_end``. Step-time breakdowns are measured by the Trainer's
:class:`~skylift.monitor.breakdown.StepClock` and travel in the ``train`` records.
"""

from __future__ import annotations

import logging
import platform
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from skylift.config.schema import RunConfig
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import Callback, TrainState
from skylift.monitor.cost import CostLedger, previous_spend_usd
from skylift.monitor.metrics import MetricsLogger
from skylift.monitor.schema import read_records

__all__ = ["RunMonitor"]

log = logging.getLogger("skylift")

COST_INTERVAL_S = 5.0
"""Least seconds between two ``cost`` records."""


class RunMonitor(Callback):
    """Subscribe after the :class:`MetricsLogger` it writes through.

    Args:
        config: the run's configuration.
        context: the distributed context (only rank 0 writes; local rank 0 samples).
        metrics: the logger every record goes through.
        device: where the model runs.
        precision: the precision policy's name (``fp32``, ``bf16``, ...).
    """

    def __init__(self, config: RunConfig, context: DistributedContext, metrics: MetricsLogger, *,
                 device: torch.device, precision: str) -> None:
        self.config = config
        self.context = context
        self.metrics = metrics
        self.device = device
        self.precision = precision
        self.started_at = time.time()
        self.resumed_from_step: int | None = None
        self.accumulation_steps = 1
        """Micro-steps per optimizer step, as the runtime settled them."""
        self.micro_batch: dict[str, Any] | None = None
        """What ``data.micro_batch_size: auto`` measured and chose (for ``run_start``)."""
        self._sampler: Any = None
        self._ledger: CostLedger | None = None
        self._flops_counted = False
        self._sequence_flops: Any = None
        """The fitted FLOPs of a sequence by its length, under a token budget (``SequenceFlops``)."""
        self._peak: Any = None
        self._step = 0
        self._seconds_per_step: float | None = None
        self._last_cost_at = float("-inf")

    # -- events ---------------------------------------------------------------------

    def on_fit_start(self, state: TrainState) -> None:
        monitor = self.config.monitor
        self._step = state.step
        if monitor.mfu:
            from skylift.monitor.flops import device_peak

            self._peak = device_peak(self.device, self.precision)
        if self.context.is_main:
            earlier = list(_existing(self.metrics))  # earlier attempts of this run folder, read once
            self._open_ledger(earlier)
            self.metrics.write_event(self._run_start(state, earlier))
            self.metrics.after_flush.append(self._after_flush)
        if monitor.system_interval_s > 0 and self.context.local_rank == 0:
            self._start_sampler(monitor.system_interval_s)

    def on_step_end(self, state: TrainState) -> None:
        self._step = state.step

    def finish(self, state: TrainState, train_time_s: float, samples_per_s: float) -> None:
        """Stop sampling; write ``run_end`` and the diagnosis (before the metrics file closes)."""
        self.close()
        if not self.context.is_main:
            return
        self._after_flush(state, None, final=True)
        self.metrics.write_event({
            "kind": "run_end", "step": state.step, "samples_per_s": samples_per_s,
            "train_time_s": round(train_time_s, 3), "stopped_early": state.stop_requested, "time": time.time(),
        })
        if self.config.monitor.diagnose:
            self._diagnose()

    def close(self) -> None:
        """Stop the sampler (idempotent; also called when a run fails)."""
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None

    @property
    def wants_flops(self) -> bool:
        """Whether :meth:`count_flops` still has work: the first micro-batch of an attempt,
        and under a token budget every micro-batch (each has its own padded length; after
        the first, its FLOPs are arithmetic on the fitted formula, not a trace)."""
        if not self.config.monitor.mfu or self._peak is None:
            return False
        return not self._flops_counted or self._sequence_flops is not None

    def count_flops(self, module: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], torch.Tensor],
                    batch_size: int) -> None:
        """Count FLOPs per sample from the first micro-batch of ``batch_size`` samples (once per attempt).

        Per sample is exact for fixed-size inputs. Under ``data.batching: token_budget``
        the FLOPs of a sequence are fitted as a function of its padded length
        (:func:`~skylift.monitor.flops.fit_sequence_flops`) and every micro-batch is
        counted at its own length.
        """
        if self._sequence_flops is not None:
            self._add_sequence_batch(batch)
            return
        if self.config.data.batching == "token_budget":
            self._count_token_budget(module, batch, loss)
            return
        from skylift.monitor.flops import explain_step_flops

        flops, reason = explain_step_flops(module, batch, loss)
        per_sample = flops / batch_size if flops and batch_size > 0 else None
        self._write_flops_record(per_sample, reason)
        self.record_flops(flops, batch_size)

    def record_flops(self, micro_flops: float | None, batch_size: int) -> None:
        """FLOPs of one micro-step (forward + backward) of ``batch_size`` samples, counted by the caller."""
        self._flops_counted = True
        if micro_flops and self._peak.flops_per_s and batch_size > 0:
            self.metrics.set_flops(micro_flops / batch_size, self._peak.flops_per_s, self.context.world_size)

    def _count_token_budget(self, module: nn.Module, batch: Any,
                            loss: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        from skylift.monitor.flops import fit_sequence_flops, padded_shape

        self._flops_counted = True
        fit, reason = fit_sequence_flops(module, batch, loss)
        shape = padded_shape(batch)
        if fit is None or shape is None:
            self._write_flops_record(None, f"token budget: {reason}")
            return
        sequences, length = shape
        lengths = ", ".join(map(str, fit.counted_lengths))
        reason = f"{reason} ({lengths} tokens); each token-budget micro-batch counted at its own length"
        first = fit.batch_flops(sequences, length) / sequences
        self._write_flops_record(first, reason, sequence_flops=fit.as_record())
        self._sequence_flops = fit
        self.metrics.count_flops_by_step(self._peak.flops_per_s, self.context.world_size)
        self._add_sequence_batch(batch)

    def _add_sequence_batch(self, batch: Any) -> None:
        from skylift.monitor.flops import padded_shape

        shape = padded_shape(batch)
        if shape is None:  # the first micro-batch had token ids; a later one without is a recipe's bug
            raise ValueError("a token-budget micro-batch holds no two-dimensional tensor of token ids")
        self.metrics.add_flops(self._sequence_flops.batch_flops(*shape))

    def _write_flops_record(self, per_sample: float | None, reason: str, **fields: Any) -> None:
        if per_sample is None:
            log.warning("FLOPs not counted, so no MFU: %s", reason)
        if self.context.is_main:
            # In the run folder, not only the log: the report says why its MFU column is empty.
            self.metrics.write_event({"kind": "flops", "time": time.time(), "step": self._step,
                                      "flops_per_sample": per_sample, "reason": reason, **fields})

    # -- parts ----------------------------------------------------------------------

    def _run_start(self, state: TrainState, earlier: list[dict[str, Any]]) -> dict[str, Any]:
        config = self.config
        peak = self._peak
        attempt = 1 + sum(1 for r in earlier if r.get("kind") == "run_start")
        world_size = self.context.world_size
        return {
            "kind": "run_start",
            "attempt": attempt,
            "resumed_from_step": self.resumed_from_step,
            "step": state.step,
            "total_steps": state.total_steps,
            "steps_per_epoch": state.steps_per_epoch,
            "world_size": world_size,
            "num_nodes": self.context.num_nodes,
            "device": self.device.type,
            "device_name": _device_name(self.device),
            "precision": self.precision,
            "peak_flops_per_s": peak.flops_per_s if peak else None,
            "peak_flops_source": peak.source if peak else "unknown: monitor.mfu is off",
            "flops_per_step": None,
            "usd_per_hour": config.monitor.usd_per_hour,
            "on_demand_usd_per_hour": config.monitor.on_demand_usd_per_hour,
            "accumulation_steps": self.accumulation_steps,
            "micro_batch_size": _micro_batch_size(config, world_size, self.accumulation_steps),
            "micro_batch": self.micro_batch,
            "data_num_workers": config.data.num_workers,
            "cpu_count": _cpus(),
            "compile_enabled": config.compile.enabled,
            "checkpoint_async": config.checkpoint.async_save if config.checkpoint.enabled else None,
            "nccl_settings": _nccl_settings(),
            "time": time.time(),
        }

    def _open_ledger(self, earlier: list[dict[str, Any]]) -> None:
        price = self.config.monitor.usd_per_hour
        if price is None:
            return
        self._ledger = CostLedger(
            price,
            on_demand_usd_per_hour=self.config.monitor.on_demand_usd_per_hour,
            earlier_usd=previous_spend_usd(earlier),
            started_at=self.started_at,
            nodes=self.context.num_nodes,
            # An elastic job's price is for its most nodes; a fixed job's, for the nodes it has.
            nodes_priced=elastic.max if (elastic := self.config.distributed.nodes) else self.context.num_nodes,
        )

    def _after_flush(self, state: TrainState, seconds_per_step: float | None, *, final: bool = False) -> None:
        if self._ledger is None:
            return
        if seconds_per_step is not None:
            self._seconds_per_step = seconds_per_step
        # Flushes come every few steps; the ledger moves slowly, so one record per
        # COST_INTERVAL_S (and one at the end) draws the curve without bloating the file.
        now = time.monotonic()
        if final or now - self._last_cost_at >= COST_INTERVAL_S:
            self._last_cost_at = now
            self.metrics.write_event(self._ledger.record(
                step=state.step, total_steps=state.total_steps, steps_per_epoch=state.steps_per_epoch,
                seconds_per_step=self._seconds_per_step,
            ))

    def _start_sampler(self, interval_s: float) -> None:
        from skylift.monitor.system import SystemSampler

        sink = self.metrics.write_event if self.context.is_main else self.metrics.queue_remote
        self._sampler = SystemSampler(interval_s, sink, node_rank=self.context.node_rank, step=lambda: self._step)
        self._sampler.start()

    def _diagnose(self) -> None:
        from skylift.monitor.diagnosis import diagnose

        record = diagnose(list(_existing(self.metrics)))
        if record is None:
            return
        self.metrics.write_event(record)  # `skylift run` prints it with the report path
        log.debug("diagnosis: %s-bound", record["bound"])


def _existing(metrics: MetricsLogger) -> Any:
    path = metrics.run_dir.metrics_path
    return read_records(path) if path.exists() else iter(())


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nccl_settings() -> dict[str, Any] | None:
    """What skylift's launcher set for NCCL and why (from the workers' environment)."""
    from skylift.machine.nccl import recorded_settings

    return recorded_settings()


def _cpus() -> int:
    from skylift.data.autotune import available_cpus

    return available_cpus()


def _micro_batch_size(config: RunConfig, world_size: int, accumulation_steps: int) -> int | None:
    """Samples per rank per micro-step; ``None`` under a token budget (it varies)."""
    if config.data.batching == "token_budget":
        return None
    return config.data.global_batch_size // (world_size * accumulation_steps)
