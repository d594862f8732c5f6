"""The runtime for users who keep their own training loop.

The whole contract (``examples/own_loop.py`` is a complete script)::

    runtime = Runtime.from_config("run.yaml")          # or Runtime(precision=..., ...) without survive/watch
    model, optimizer, loader, scheduler = runtime.prepare(model, optimizer, loader, scheduler)
    step = runtime.resume()                            # 0, or the step of the newest complete checkpoint
    for epoch in range(runtime.epoch, epochs):
        for inputs, targets in loader:                 # on the device, sharded, resumable mid-epoch
            with runtime.autocast():
                loss = loss_fn(model(inputs), targets)
            runtime.backward(loss)
            if runtime.optimizer_step():               # steps on the last micro-batch of each group
                step += 1
                runtime.log(step, loss=loss)           # metrics.jsonl + TensorBoard, no per-step sync
                if runtime.step_end(step):             # checkpoints; a spot notice or SIGTERM: saved, stop
                    break
        if runtime.stopped:
            break
    runtime.close()                                    # final save; exit 143 after a preemption, else 0

``autocast()`` also tells DDP (or FSDP: ``distributed.strategy: fsdp``) whether this
micro-step reduces gradients (only the last of each accumulation group does), ``backward``
scales the loss for accumulation and fp16, and ``optimizer_step`` unscales, clips, steps,
updates the GradScaler, zeroes gradients and steps the LR scheduler. The Trainer runs its
loop on the same calls, so both share one checkpoint, preemption and monitoring path
(:mod:`skylift.train.services`). Under FSDP the model is sharded in place, the optimizer
given to ``prepare`` is moved onto the sharded parameters, and evaluation goes through
``runtime.evaluation_batches(loader)``, which pairs the ranks' forwards (collectives there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from skylift.config.distributed import FsdpConfig
from skylift.loop.distributed import DistributedContext, exit_cleanly, init_distributed
from skylift.loop.events import TrainState
from skylift.train.gradient_step import GradientStep
from skylift.train.placement import Placement
from skylift.train.precision import PrecisionPolicy
from skylift.train.prepared_loader import EvalLoader, PreparedLoader, prepare_eval_loader, prepare_loader
from skylift.train.runtime_options import runtime_options
from skylift.train.sharding import Sharding, lockstep, sharding_for
from skylift.train.step_meter import StepMeter

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.loop.events import Callback
    from skylift.monitor.breakdown import StepClock
    from skylift.monitor.report import Report
    from skylift.monitor.watch import RunMonitor
    from skylift.train.services import RunServices

__all__ = ["Runtime"]

log = logging.getLogger("skylift")


class Runtime:
    """Precision, accumulation, DDP or FSDP, and clipping for a hand-written loop.

    Three parts that change for different reasons: :attr:`placement` (device and
    precision: the machine), :attr:`gradients` (accumulation, DDP, the optimizer step:
    the job's batch shape and world size) and :attr:`services` (checkpoints,
    preemption, monitoring: the run configuration, with ``from_config``; a
    :class:`~skylift.train.step_meter.StepMeter` measures each step for them).

    Args:
        precision: ``auto``, ``fp32``, ``tf32``, ``fp16`` or ``bf16`` (see
            :func:`~skylift.train.precision.resolve_precision`).
        accumulation_steps: micro-batches per optimizer step.
        grad_clip_norm: clip the global gradient norm to this (``None``: no clipping).
        device: ``auto``, ``cpu`` or ``cuda``.
        compile: wrap the model in ``torch.compile``.
        channels_last: convert conv nets to the channels-last memory format.
        activation_checkpointing: class names of submodules to recompute in backward.
        strategy: ``ddp`` (every rank holds the whole model) or ``fsdp`` (FSDP2 shards it).
        fsdp: the FSDP settings (``strategy: fsdp``; default: :class:`~skylift.config.FsdpConfig`'s).
        context: an already initialised :class:`DistributedContext` (else read from
            the torchrun environment).
    """

    def __init__(
        self,
        *,
        precision: str = "auto",
        accumulation_steps: int = 1,
        grad_clip_norm: float | None = None,
        device: str = "auto",
        backend: str = "auto",
        timeout_s: float = 600.0,
        compile: bool = False,
        compile_mode: str = "default",
        channels_last: bool = False,
        activation_checkpointing: list[str] | None = None,
        find_unused_parameters: bool = False,
        bucket_cap_mib: int = 25,
        strategy: str = "ddp",
        fsdp: FsdpConfig | None = None,
        context: DistributedContext | None = None,
    ) -> None:
        if accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {accumulation_steps}")
        self.dist = context or init_distributed(device, backend, timeout_s)
        self.device = self.dist.device
        self.placement = Placement(self.device, precision, channels_last=channels_last,
                                   activation_checkpointing=activation_checkpointing, compile=compile,
                                   compile_mode=compile_mode)  # fmt: skip
        self.gradients = GradientStep(accumulation_steps=accumulation_steps, grad_clip_norm=grad_clip_norm,
                                      scaler=self.placement.new_grad_scaler(),
                                      find_unused_parameters=find_unused_parameters, bucket_cap_mib=bucket_cap_mib,
                                      sharding=sharding_for(strategy, fsdp, self.placement))  # fmt: skip
        self._model: nn.Module | None = None
        self._loader: PreparedLoader | None = None
        self._extra: dict[str, Any] | None = None
        self.seed = 0
        self.config: RunConfig | None = None
        """The run configuration (``from_config`` only): read your own settings from it."""
        self.services: RunServices | None = None
        """The run's :class:`~skylift.train.services.RunServices` (``from_config`` only)."""
        self.state = TrainState(total_steps=0, steps_per_epoch=0, global_batch_size=0)
        """Where the run is: step, epoch, samples seen (shared with the Trainer's loop)."""
        self._meter = StepMeter()
        self._last_logged_step = 0
        self._run_started = 0.0
        self.micro_batch_pending = False
        """``data.micro_batch_size: auto`` not yet settled by trials (see :meth:`set_accumulation_steps`)."""

    @classmethod
    def from_config(cls, config: RunConfig | str | os.PathLike[str], context: DistributedContext | None = None, *,
                    overrides: Sequence[str] = (), callbacks: Sequence[Callback] = ()) -> Runtime:
        """Build from a :class:`~skylift.config.RunConfig` or the path of its YAML file
        (``overrides``: ``section.key=value`` strings, as ``--set`` takes them), with
        checkpoints, preemption handling and monitoring as the config says."""
        from skylift.train.services import RunServices, seed_everything

        if isinstance(config, (str, os.PathLike)):
            from skylift.config.load import load_config

            config = load_config(str(config), list(overrides))
        from skylift.config.script_environment import apply_to

        # skylift launch / submit -- SCRIPT name the platform's run folder and checkpoint root.
        config = apply_to(config)
        seed_everything(config.seed, config.deterministic)
        runtime = cls(**runtime_options(config), context=context)
        if config.data.micro_batch_size is not None:
            runtime.accumulation_steps = config.with_micro_batch(
                config.micro_batch_size(runtime.dist.world_size), runtime.dist.world_size).accumulation.steps
            # auto: the Trainer's trials settle it before anything is prepared.
            runtime.micro_batch_pending = config.data.micro_batch_size == "auto"
        runtime.config = config
        runtime.seed = config.seed
        runtime.services = RunServices(
            config, runtime.dist, device=runtime.device, precision=runtime.precision.name,
            ddp_module=lambda: runtime.gradients.ddp, micro_steps=runtime.accumulation_steps, callbacks=callbacks,
        )
        runtime.state.total_steps = config.schedule.max_steps or 0
        return runtime

    @property
    def sharding(self) -> Sharding | None:
        """FSDP's sharding of the model (``strategy: fsdp``), else ``None``."""
        return self.gradients.sharding

    @property
    def precision(self) -> PrecisionPolicy:
        return self.placement.precision

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.gradients.scaler

    @property
    def accumulation_steps(self) -> int:
        return self.gradients.accumulation_steps

    @accumulation_steps.setter
    def accumulation_steps(self, steps: int) -> None:
        self.gradients.accumulation_steps = steps

    @property
    def grad_clip_norm(self) -> float | None:
        return self.gradients.grad_clip_norm

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm before the last clip (``None`` without clipping)."""
        return self.gradients.last_grad_norm

    @property
    def last_lr(self) -> float:
        """The learning rate the last optimizer step used."""
        return self.gradients.last_lr

    @property
    def sync_gradients(self) -> bool:
        """True on the last micro-step of an accumulation group (the one that steps)."""
        return self.gradients.sync_gradients

    def prepare(self, model: nn.Module, *objects: Any) -> Any:
        """Move and wrap the model; register the optimizer, data loaders and scheduler.

        The first DataLoader is the training loader (re-sampled in global batches and
        resumable mid-epoch, see :mod:`skylift.train.prepared_loader`); later ones are
        evaluation loaders (sharded, every sample once). Returns the model followed by
        the other objects in the order given.
        """
        prepared = [self.prepare_model(model), *self.register(*objects)]
        return prepared[0] if len(prepared) == 1 else tuple(prepared)

    def register(self, *objects: Any) -> list[Any]:
        """:meth:`prepare` without a model: the optimizer (moved onto the shards under
        FSDP), data loaders and LR scheduler, returned in the order given."""
        prepared = []
        for item in objects:
            if isinstance(item, torch.optim.Optimizer):
                if self.sharding is not None:
                    self.sharding.adopt_optimizer(item)
                self.gradients.optimizer = item
            elif isinstance(item, DataLoader):
                item = self.prepare_dataloader(item, train=self._loader is None)  # noqa: PLW2901 - given back prepared
            elif item is not None and hasattr(item, "step") and hasattr(item, "get_last_lr"):
                self.gradients.scheduler = item
            prepared.append(item)
        return prepared

    def set_accumulation_steps(self, steps: int) -> None:
        """Micro-steps per optimizer step, settled after construction (the micro-batch trials)."""
        if steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {steps}")
        self.accumulation_steps = steps
        self.micro_batch_pending = False
        if self.services is not None:
            self.services.clock.micro_steps = steps
            self.services.monitor.accumulation_steps = steps

    def place_model(self, model: nn.Module) -> nn.Module:
        """Activation checkpointing, the device and the memory format, without wrappers;
        idempotent, so the model can be measured as it will train before :meth:`prepare`."""
        return self.placement.place(model)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        if self.micro_batch_pending:
            from skylift.errors import SkyliftConfigError

            raise SkyliftConfigError(
                "data.micro_batch_size: auto is chosen by skylift's Trainer (skylift run); a hand-written loop "
                "sets a number: data.micro_batch_size: 16, or accumulation.steps")
        model = self.place_model(model)
        wrapped = self.gradients.wrap(model, self.dist)
        if self.sharding is not None:
            self._model = wrapped  # sharded in place; its blocks compiled before sharding
            return wrapped
        self._model = model
        return self.placement.compiled(wrapped)

    def prepare_dataloader(self, loader: DataLoader, *, train: bool = True) -> PreparedLoader | EvalLoader:
        """A training loader: sharded, on the device, resumable. ``train=False``: an
        evaluation loader, split into contiguous per-rank shards (no sample dropped)."""
        if not train:
            return prepare_eval_loader(loader, self, self.dist)
        prepared = prepare_loader(loader, self, self.dist, self.seed)
        self._loader = prepared
        self.state.steps_per_epoch = prepared.steps_per_epoch
        if not self.state.total_steps and self.services is not None:
            self.state.total_steps = prepared.steps_per_epoch * self.services.config.schedule.epochs
        self.state.global_batch_size = (prepared.batch_size or 0) * self.dist.world_size * self.accumulation_steps
        return prepared

    def to_device(self, batch: Any) -> Any:
        """Move tensors (in tuples, lists and dicts) to the device, asynchronously when pinned."""
        return self.placement.to_device(batch)

    def evaluation_batches(self, loader: Any) -> Iterator[tuple[Any, bool]]:
        """``(batch, counted)`` for this rank's evaluation batches. Under FSDP, where every
        forward is a collective, a rank out of batches repeats its last with ``counted``
        False (leave its outputs out) until every rank is done; else always True."""
        if self.sharding is None:
            return ((batch, True) for batch in loader)
        return lockstep(loader, self.gradients.collective_device, self.dist.rank)

    def fetch(self, batches: Iterator[Any]) -> Any:
        """The next training batch of ``batches``, on the device; the wait is timed as data
        wait and the copy as host-to-device. Raises ``StopIteration`` at the end."""
        clock = self._clock
        self._meter.begin(clock, self.gradients.micro_step)
        batch = self.to_device(self._meter.next_batch(batches, clock))
        if clock is not None:
            clock.mark("host_to_device")
        return batch

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Run the forward pass of one micro-step: autocast plus the DDP sync decision."""
        self._meter.begin(self._clock, self.gradients.micro_step)
        self.gradients.before_forward()
        self._meter.start_flop_count(self._monitor)
        with self.placement.autocast():
            yield

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of the micro-step loss, averaged over the accumulation group."""
        self.gradients.backward(loss)
        self._meter.finish_flop_count(self._monitor)
        if self._clock is not None:
            self._clock.mark("forward_backward")

    def optimizer_step(self) -> bool:
        """Step at the end of an accumulation group; return whether it stepped."""
        if not self.gradients.step():
            return False
        if self._clock is not None:
            self._clock.mark("optimizer")
        return True

    # -- survive and watch (Runtime.from_config) -------------------------------------

    def resume(self, extra: dict[str, Any] | None = None) -> int:
        """Restore model, optimizer, LR scheduler, GradScaler, RNG, the training loader's
        place and ``extra`` (your own tensors and JSON values, filled in place) from the
        checkpoint ``checkpoint.resume`` selects (``auto``: the newest complete one).
        Returns its step, or 0 for a fresh start. Call once, after :meth:`prepare`."""
        services = self._require_services("resume")
        from skylift.checkpoint.session import TrainingObjects

        self._extra = extra
        objects = TrainingObjects(model=self._require_model(), optimizer=self.gradients.require_optimizer(),
                                  scheduler=self.gradients.scheduler, scaler=self.scaler, loader=self._loader,
                                  extra=extra)
        step = services.resume(objects, self.state) or 0
        self._last_logged_step = step
        self._run_started = time.perf_counter()
        return step

    @property
    def epoch(self) -> int:
        """The epoch the training loader is in (after :meth:`resume`: the checkpoint's)."""
        return self._loader.epoch if self._loader is not None else self.state.epoch

    @property
    def stopped(self) -> str | None:
        """Why the run stopped (``preempted``, ...) once :meth:`step_end` returned True, else None."""
        return self.services.stopped if self.services is not None else None

    def log(self, step: int, **scalars: Any) -> None:
        """Record step ``step``'s scalars (tensors stay on the device until the flush every
        ``monitor.log_every_steps`` steps). ``loss`` is averaged over ranks, as are the others;
        every rank must log the same names. The gradient norm and LR are added."""
        self._require_services("log")
        from skylift.monitor.metrics import RESERVED_TRAIN_FIELDS

        loss = scalars.pop("loss", None)
        if loss is None:
            raise ValueError("runtime.log(step, loss=...) needs the step's loss")
        clashes = sorted(set(scalars) & RESERVED_TRAIN_FIELDS)
        if clashes:
            raise ValueError(f"runtime.log: {clashes} are fields skylift writes itself; give your scalars other names")
        self.state.loss = torch.as_tensor(loss, device=self.device).detach().float()
        self.state.extra["scalars"] = scalars
        self._last_logged_step = step

    def step_end(self, step: int, *, samples: int | None = None) -> bool:
        """Optimizer step ``step`` (counted from 1) is done: metrics, checkpoint cadence,
        and the ranks' agreement on a spot notice or SIGTERM. Returns True when the job
        must stop; the save that a preemption allows is committed by then.

        ``samples``: samples this step took across all ranks (default: this rank's
        batches times the number of ranks)."""
        services = self._require_services("step_end")
        if not services.started:
            services.start(self.state)
        state = self.state
        if self._last_logged_step != step:
            state.loss = None  # no runtime.log for this step: no train record
        measures = self._meter.end()
        state.step = step
        state.samples_seen += samples if samples is not None else measures.samples * self.dist.world_size
        state.lr = self.last_lr
        state.grad_norm = self.last_grad_norm
        state.data_wait_s = measures.data_wait_s
        state.step_time_s = measures.step_time_s
        if self._loader is not None and self.state.steps_per_epoch == 0:
            self.state.steps_per_epoch = self._loader.steps_per_epoch
        stop = services.step_end(state)
        state.extra.pop("scalars", None)
        return stop

    def finish(self, save_model: Callable[[], None] | None = None, *,
               started_at: float | None = None) -> tuple[float, float]:
        """The final save (``checkpoint.save_at_end``, unless stopped), the final weights
        (``save_model``: a callable that writes them; default the prepared model's to
        ``RUN_DIR/model.safetensors``), ``run_end`` and the diagnosis. Returns (training
        seconds, samples/s). :meth:`close` calls it."""
        services = self._require_services("finish")
        if not services.started:
            services.start(self.state)
        started_at = started_at if started_at is not None else self._run_started or time.perf_counter()
        return services.finish(self.state, started_at, save_model or self.final_model_writer(self._require_model()))

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module under any compile and DDP wrappers (under FSDP the module
        itself: ``fully_shard`` shards it in place)."""
        model = getattr(model, "_orig_mod", model)
        return model.module if isinstance(model, DistributedDataParallel) else model

    def close(self, exit_code: int | None = None) -> None:
        """Finish the run (with ``from_config``), stop every background thread, and end the
        process: exit code 143 after a preemption (run the same command again to resume),
        3 after a guard's stop (``monitor.guards``), else ``exit_code`` (default 0)."""
        from skylift.errors import EXIT_FAILURE
        from skylift.loop.agreement import StopReason

        code = exit_code if exit_code is not None else 0
        services = self.services
        if services is not None:
            from skylift.monitor.report import write_run_report

            report = None
            try:
                _, samples_per_s = self.finish()
                report = write_run_report(self.config) if self.dist.is_main else None  # before exporters close
            finally:
                services.close()
            stopped = StopReason.of_label(self.stopped)
            if exit_code is None:
                code = stopped.exit_code
            preempted = stopped is StopReason.PREEMPTED
            if self.dist.is_main:
                self._say_where_it_ended(services, samples_per_s, preempted, report)
            if services.unsaved is not None:  # the final checkpoint failed: not a success
                code = EXIT_FAILURE if exit_code is None else exit_code
                if self.dist.is_main:
                    print(f"skylift: {services.unsaved}", file=sys.stderr)
        exit_cleanly(code)

    def _say_where_it_ended(self, services: RunServices, samples_per_s: float, preempted: bool,
                            report: Report | None) -> None:
        run_dir = services.run_dir.root
        ending = f"stopped at step {self.state.step} ({self.stopped})" if self.stopped else f"{self.state.step} steps"
        print(f"skylift: {ending}, {samples_per_s:,.0f} samples/s; run folder {run_dir}", file=sys.stderr)
        if preempted:
            print("skylift: preempted; run the same command again to resume", file=sys.stderr)
        elif report is not None:
            print(f"Next: open {report.html_path}  (live view of a running job: skylift monitor {run_dir})",
                  file=sys.stderr)

    @property
    def _clock(self) -> StepClock | None:
        return self.services.clock if self.services is not None else None

    @property
    def _monitor(self) -> RunMonitor | None:
        return self.services.monitor if self.services is not None else None

    def final_model_writer(self, model: nn.Module) -> Callable[[], None] | None:
        """What writes ``model``'s weights to ``RUN_DIR/model.safetensors`` on rank 0. Under
        FSDP (and ``checkpoint.save_final_model``) every rank gathers them here: a collective."""
        from safetensors.torch import save_model

        services = self._require_services("finish")
        path = str(services.run_dir.model_path)
        if self.sharding is None:
            return lambda: save_model(self.unwrap(model), path)
        wanted = services.config.checkpoint.save_final_model
        return self.sharding.weights_writer(self.unwrap(model), path) if wanted else None

    def _require_services(self, call: str) -> RunServices:
        if self.services is None:
            raise RuntimeError(
                f"runtime.{call}() needs a run configuration (checkpoint, preemption, monitor, run_dir): "
                "build the runtime with Runtime.from_config('run.yaml')"
            )
        return self.services

    def _require_model(self) -> nn.Module:
        if self._model is None:
            raise RuntimeError("the runtime has no model yet: call runtime.prepare(model, optimizer, ...) first")
        return self._model
