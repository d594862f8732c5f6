"""The Trainer: runs the loop drawn in :mod:`skylift.loop.events` from a RunConfig.

It wires the parts (runtime, recipe, data, optimizer, callbacks) and leaves each
concern to its owner: precision, DDP and FSDP to :class:`~skylift.train.runtime.Runtime`,
metrics and progress to callbacks, the task to the :class:`~skylift.recipes.base.Recipe`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from skylift.config.schema import RunConfig
from skylift.data.datasets import DatasetSplit
from skylift.data.loaders import (
    build_loaders,
    epoch_records,
    micro_batch_weight,
    samples_in_step,
    with_workers,
)
from skylift.loop.collectives import collective
from skylift.loop.distributed import DistributedContext
from skylift.loop.events import Callback, Event, TrainState
from skylift.recipes import build_recipe
from skylift.recipes.base import Recipe
from skylift.train.ema import WeightAverage
from skylift.train.optim import build_lr_schedule, build_optimizer
from skylift.train.reference_pass import prepare_reference_table
from skylift.train.runtime import Runtime
from skylift.train.services import seed_everything

if TYPE_CHECKING:
    from skylift.monitor.watch import RunMonitor

__all__ = ["RunSummary", "Trainer"]

log = logging.getLogger("skylift")


@dataclass
class RunSummary:
    """What a finished run reports (also written to ``RUN_DIR/summary.json``)."""

    run_dir: str
    steps: int
    epochs_completed: int
    samples_seen: int
    train_time_s: float
    samples_per_s: float
    precision: str
    precision_reason: str
    device: str
    world_size: int
    eval_metrics: dict[str, float]
    replicas_agree: bool | None
    replica_max_abs_diff: float | None
    stopped_early: str | None
    resumed_from_step: int | None

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Parts:
    """Everything :meth:`Trainer.fit` builds before the loop starts."""

    data: DatasetSplit
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    sampler: Any
    """The epoch's sample order: ``set_epoch(epoch, start_step)``, ``steps_per_epoch``."""
    train_loader: Any
    val_loader: Any | None
    ema: WeightAverage | None = None
    """The moving average of the weights (``optim.ema_decay``): evaluated and saved."""


class Trainer:
    """Train ``recipe`` as ``config`` says.

    Args:
        config: the validated run configuration.
        recipe: the task; default: the one named by ``config.recipe.name``.
        callbacks: extra subscribers to the loop's events.
        context: an initialised distributed context (default: from the environment).

    Example:
        >>> from skylift.config import load_config
        >>> summary = Trainer(load_config("examples/quickstart.yaml")).fit()  # doctest: +SKIP
    """

    def __init__(
        self,
        config: RunConfig,
        recipe: Recipe | None = None,
        callbacks: Sequence[Callback] = (),
        context: DistributedContext | None = None,
    ) -> None:
        self.config = config
        self.recipe = recipe or build_recipe(config)
        self.runtime = Runtime.from_config(config, context, callbacks=callbacks)
        services = self.runtime.services
        if services is None:  # from_config always builds them; a Runtime made by hand has none
            raise RuntimeError("the Trainer needs a Runtime built by Runtime.from_config")
        # The parts the loop shares with a hand-written one (skylift.train.services).
        self.services = services
        self.run_dir, self.events, self.metrics = services.run_dir, services.events, services.metrics
        self.monitor: RunMonitor | _FlopsOnMetaCopy = services.monitor
        if self.runtime.sharding is not None:
            self.runtime.sharding.keep_meta_copy = config.monitor.mfu
            self.monitor = _FlopsOnMetaCopy(services.monitor, self.runtime.sharding)
        self.agreement, self.preemption, self.checkpointing, self.clock = (
            services.agreement, services.preemption, services.checkpointing, services.clock)
        self.report: Any = None
        """The HTML report written at the end (rank 0, ``monitor.report``)."""
        self.tuner: Any = None  # a LoaderTuner with data.num_workers: auto
        self._tuning_recorded = False

    def fit(self) -> RunSummary:
        """Build the parts, resume, run every epoch, evaluate, save, and report."""
        seed_everything(self.config.seed, self.config.deterministic)
        self.services.open()  # the run lease: a second writer fails here, before any work
        try:
            summary = self._fit()
        finally:
            self.services.close()
            if self.runtime.sharding is not None:
                self.runtime.sharding.release()  # the one-rank group of a one-process run, if it made one
        self.services.raise_if_unsaved()  # the final checkpoint failed: not a success (summary.json says the rest)
        return summary

    def _fit(self) -> RunSummary:
        parts = self._build()
        state = self.runtime.state
        state.total_steps = self._total_steps(parts.sampler)
        state.steps_per_epoch = parts.sampler.steps_per_epoch
        state.global_batch_size = self.config.data.global_batch_size
        policy = self.runtime.precision
        log.info("precision %s (%s)", policy.name, policy.reason)
        # Before the checkpoint loads: the model is still the starting one (DPO's reference).
        checkpoints = self.services.checkpointing
        prepare_reference_table(self.recipe, parts.model, parts.data, self.runtime,
                                batch_size=self.config.data.eval_batch_size,
                                stores=(checkpoints.store, checkpoints.manager.store) if checkpoints else None)
        self.runtime.resume(extra=parts.ema.state() if parts.ema is not None else None)
        resumed_from = self.services.resumed_from_step  # None on a fresh start (resume() returns 0)
        started = time.perf_counter()
        self._run_epochs(parts, state)
        final = parts.ema.module if parts.ema is not None else parts.model
        train_time_s, samples_per_s = self.runtime.finish(self.runtime.final_model_writer(final), started_at=started)
        summary = self._summarize(parts, state, train_time_s, resumed_from, samples_per_s)
        earlier = self._summary_of_finished_run(summary) if state.step == resumed_from else None
        if self.runtime.dist.is_main:
            from skylift.monitor.report import write_run_report

            if earlier is None:
                self.run_dir.write_json(self.run_dir.summary_path, summary.as_dict())
            else:  # nothing trained now: the run's figures are the attempt's that finished it
                log.info("the run had already finished at step %d; %s kept", state.step, self.run_dir.summary_path)
                summary = earlier
            # Before the exporters close, which upload it with summary.json.
            self.report = write_run_report(self.config)
        return summary

    def _build(self) -> _Parts:
        runtime = self.runtime
        pin_memory = self.config.data.pin_memory and runtime.device.type == "cuda"
        if self.config.data.num_workers == "auto":
            self.config = self._start_tuner()
        if isinstance(self.config.data.micro_batch_size, int):
            self.config = self.config.with_micro_batch(self.config.data.micro_batch_size, runtime.dist.world_size)
        loaders = build_loaders(self.config, self.recipe, runtime.dist, pin_memory=pin_memory)
        model = self._build_model(loaders.data)
        if self.config.data.micro_batch_size == "auto":
            loaders = self._choose_micro_batch(model, loaders, pin_memory)
        config = self.config
        if runtime.sharding is not None:
            # The optimizer on the sharded parameters (a model built on meta has no others).
            model = runtime.prepare(model)
            reference = getattr(self.recipe, "frozen_reference", lambda: None)()
            if reference is not None:  # DPO's frozen copy: sharded as the policy, not whole on every rank
                runtime.sharding.shard_alike(reference, runtime.unwrap(model))
        optimizer = build_optimizer(runtime.unwrap(model), config.optim, runtime.device)
        scheduler = build_lr_schedule(optimizer, config.schedule, self._total_steps(loaders.order))
        if runtime.sharding is not None:
            runtime.register(optimizer, scheduler)
        else:
            model, optimizer, scheduler = runtime.prepare(model, optimizer, scheduler)
        ema = WeightAverage(runtime.unwrap(model), config.optim.ema_decay) if config.optim.ema_decay else None
        # Both loaders come sharded by rank; the loop fetches training batches through the runtime.
        return _Parts(loaders.data, model, optimizer, scheduler, loaders.order, loaders.train, loaders.val, ema)

    def _build_model(self, data: DatasetSplit) -> nn.Module:
        """The recipe's model in training mode (``from_pretrained`` hands it over in eval
        mode, which would leave dropout off until the first evaluation). Under FSDP, with
        the recipe's weights folder: the structure on the ``meta`` device, whose shards
        each rank then loads from the folder (:class:`~skylift.train.sharding.Sharding`),
        so no rank ever holds the whole model; built whole for ``micro_batch_size: auto``,
        whose trials run it."""
        sharding = self.runtime.sharding
        source = self.recipe.weights_source() if sharding is not None else None
        if sharding is None or source is None or self.config.data.micro_batch_size == "auto":
            return self.recipe.build_model(data).train()
        sharding.weights_source = source
        sharding.weights_name, sharding.initialise_unloaded = self.recipe.weights_name, self.recipe.initialise_unloaded
        with torch.device("meta"):
            return self.recipe.build_model(data).train()

    def _choose_micro_batch(self, model: nn.Module, loaders: Any, pin_memory: bool) -> Any:
        """``data.micro_batch_size: auto``: trials on one per-rank batch of real samples,
        then the loaders again at the chosen size (the datasets are kept)."""
        from skylift.train.micro_batch import choose_micro_batch

        runtime = self.runtime

        def first_batch() -> Any:
            loaders.order.set_epoch(0)
            return next(iter(loaders.train))

        choice = choose_micro_batch(runtime.place_model(model), first_batch, self.recipe.training_loss,
                                    runtime=runtime, config=self.config, batch_size=self.recipe.batch_size)
        self.config = self.config.with_micro_batch(choice.micro_batch_size, runtime.dist.world_size)
        runtime.set_accumulation_steps(choice.accumulation_steps)
        self.monitor.micro_batch = choice.record()
        return build_loaders(self.config, self.recipe, runtime.dist, pin_memory=pin_memory, data=loaders.data)

    def _start_tuner(self) -> RunConfig:
        """``data.num_workers: auto``: start with the first candidate; the loop tries the rest."""
        from skylift.data.autotune import LoaderTuner, default_candidates

        self.tuner = LoaderTuner(default_candidates(), budget_s=self.config.data.autotune_s_per_setting)
        first = self.config.model_copy(deep=True)
        first.data.num_workers = self.tuner.current
        return first

    def _tune_step(self, parts: _Parts, state: TrainState, epoch: int, batches: Iterator[Any]) -> Iterator[Any]:
        """Time the step for the tuner; on a switch, a loader with the next worker count
        continues at the exact next batch (the order does not depend on workers)."""
        tuner = self.tuner
        switch = tuner.after_step(samples_in_step(parts.sampler, state.step - 1, state.global_batch_size))
        if tuner.done and not self._tuning_recorded and self.runtime.dist.is_main:
            self._tuning_recorded = True
            self.metrics.write_event(tuner.as_record(state.step))
        if switch is None:
            return batches
        parts.train_loader = with_workers(parts.train_loader, switch)
        parts.sampler.set_epoch(epoch, start_step=state.step - epoch * state.steps_per_epoch)
        return iter(parts.train_loader)

    def _total_steps(self, sampler: Any) -> int:
        planned = sampler.steps_per_epoch * self.config.schedule.epochs
        cap = self.config.schedule.max_steps
        return min(planned, cap) if cap else planned

    def _run_epochs(self, parts: _Parts, state: TrainState) -> None:
        schedule = self.config.schedule
        for epoch in range(state.epoch, schedule.epochs):
            state.epoch = epoch
            parts.sampler.set_epoch(epoch, start_step=state.step - epoch * state.steps_per_epoch)
            for record in epoch_records(parts.sampler, epoch, state.step):  # token-budget padding share
                self.metrics.write_event(record)
            self.events.fire(Event.EPOCH_START, state)
            batches = iter(parts.train_loader)
            if self.tuner is not None:
                self.tuner.restart_timing()
            self.clock.end_of_previous_step(state.step + 1)  # evaluation is not the next step's time
            while state.step < min(state.total_steps, (epoch + 1) * state.steps_per_epoch):
                step_samples = self._train_step(parts, state, batches)
                if self.runtime.step_end(state.step + 1, samples=step_samples):
                    return
                if self.tuner is not None:
                    batches = self._tune_step(parts, state, epoch, batches)
            last = state.step >= state.total_steps
            if parts.val_loader is not None and (last or (epoch + 1) % schedule.eval_every_epochs == 0):
                state.eval_metrics = self._evaluate(parts)
                self.events.fire(Event.EVAL_END, state)
            self.events.fire(Event.EPOCH_END, state)
            if last:
                return

    def _train_step(self, parts: _Parts, state: TrainState, batches: Iterator[Any]) -> int:
        """One optimizer step through the runtime; returns the samples it took (all ranks).

        Each micro-batch's mean loss is weighed by its share of the step's terms (samples,
        or the recipe's ``loss_count``: labelled tokens), so the step follows the sum over
        every term of the step divided by their number (:mod:`skylift.data.loss_counts`)."""
        from skylift.data.loss_counts import step_micro_batches

        runtime, recipe = self.runtime, self.recipe
        self.events.fire(Event.STEP_START, state)
        loss_sum: torch.Tensor | None = None
        extra_sums: dict[str, torch.Tensor] | None = None  # the recipe's training_sums over the step
        step_samples = samples_in_step(parts.sampler, state.step, state.global_batch_size)
        micro_batches = runtime.accumulation_steps * runtime.dist.world_size
        for batch, count, step_count in step_micro_batches(
                lambda: runtime.fetch(batches), recipe, accumulation_steps=runtime.accumulation_steps,
                step_samples=step_samples, distributed=runtime.dist.is_distributed):
            if self.monitor.wants_flops:
                self.monitor.count_flops(runtime.unwrap(parts.model), batch, recipe.training_loss,
                                         recipe.batch_size(batch))
            with runtime.autocast():
                loss = recipe.training_loss(parts.model, batch)
            extra_sums = _add_sums(extra_sums, recipe, batch)
            weight = micro_batch_weight(count, step_count, micro_batches)
            if isinstance(weight, torch.Tensor) or weight != 1.0:  # a tensor: no host sync to compare it
                loss = loss * weight
            runtime.backward(loss)
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            if runtime.optimizer_step() and parts.ema is not None:
                parts.ema.update(runtime.unwrap(parts.model))
        assert loss_sum is not None
        loss_mean = loss_sum / runtime.accumulation_steps if runtime.accumulation_steps > 1 else loss_sum
        runtime.log(state.step + 1, loss=loss_mean,
                    **_step_scalars(_across_ranks(extra_sums, runtime.dist.is_distributed)))
        return step_samples

    @torch.no_grad()
    def _evaluate(self, parts: _Parts) -> dict[str, float]:
        # The unwrapped module: DDP's forward may broadcast buffers (a collective), and
        # ranks can hold different numbers of evaluation batches. Under FSDP the module
        # is the sharded one, and evaluation_batches pairs the ranks' forwards.
        module = parts.ema.module if parts.ema is not None else self.runtime.unwrap(parts.model)
        module.eval()
        totals: dict[str, torch.Tensor] = {}
        for host_batch, counted in self.runtime.evaluation_batches(parts.val_loader):
            batch = self.runtime.to_device(host_batch)
            with self.runtime.precision.autocast(self.runtime.device.type):
                sums = self.recipe.eval_sums(module, batch)
            if not counted:
                continue
            for key, value in sums.items():
                totals[key] = totals.get(key, 0) + value.detach().double()
        module.train()
        summed = _evaluation_totals(totals, self.runtime.dist.is_distributed, self.runtime.device)
        return self.recipe.summarize(summed)

    def _summarize(self, parts: _Parts, state: TrainState, train_time_s: float, resumed_from: int | None,
                   samples_per_s: float) -> RunSummary:
        agree, max_diff = self._check_replicas(parts.model)
        if agree is False:
            log.error("DDP replicas diverged: max |param - rank 0 param| = %.3g", max_diff)
        steps_run = state.step
        return RunSummary(
            run_dir=str(self.run_dir.root),
            steps=steps_run,
            epochs_completed=state.step // state.steps_per_epoch,
            samples_seen=state.samples_seen,
            train_time_s=round(train_time_s, 3),
            samples_per_s=samples_per_s,
            precision=self.runtime.precision.name,
            precision_reason=self.runtime.precision.reason,
            device=str(self.runtime.device),
            world_size=self.runtime.dist.world_size,
            eval_metrics=state.eval_metrics,
            replicas_agree=agree,
            replica_max_abs_diff=max_diff,
            stopped_early=state.stop_requested,
            resumed_from_step=resumed_from,
        )

    def _summary_of_finished_run(self, summary: RunSummary) -> RunSummary | None:
        """A run resumed at its last step trains nothing: its ``summary.json``, written when it
        finished at that step, holds the validation metrics and throughput this attempt has
        not measured (rank 0; None: no such file, or it is of another step)."""
        import json

        path = self.run_dir.summary_path
        if not self.runtime.dist.is_main or not path.is_file():
            return None
        try:
            earlier = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(earlier, dict) or earlier.get("steps") != summary.steps or earlier.get("stopped_early"):
            return None
        return RunSummary(**{name: earlier.get(name, value) for name, value in summary.as_dict().items()})

    def _check_replicas(self, model: nn.Module) -> tuple[bool | None, float | None]:
        """Compare every rank's parameters with rank 0's (one broadcast at the end).

        Under FSDP there are no replicas to compare: each rank holds a different slice of
        every parameter, and the gathered weights every rank computes with are the same by
        construction (one all-gather of the slices), so there is nothing to check."""
        if not self.runtime.dist.is_distributed or self.runtime.sharding is not None:
            return None, None
        flat = torch.cat([p.detach().reshape(-1).float() for p in self.runtime.unwrap(model).parameters()])
        reference = flat.clone()
        with collective("the check that every rank holds the same weights (broadcast, all_reduce)"):
            dist.broadcast(reference, src=0)
            local = (flat - reference).abs().max()
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
        max_diff = float(local)
        return max_diff == 0.0, max_diff


class _FlopsOnMetaCopy:
    """The run monitor, with FLOPs counted on the model's unsharded ``meta`` copy (kept by
    :class:`~skylift.train.sharding.Sharding`): under FSDP a forward gathers parameters
    from every rank, and the monitor's meta-tensor trace through the sharded module
    breaks its state (seen with torch 2.14: the next real forward fails)."""

    def __init__(self, monitor: Any, sharding: Any) -> None:
        object.__setattr__(self, "_monitor", monitor)
        object.__setattr__(self, "_sharding", sharding)

    def count_flops(self, module: nn.Module, batch: Any, loss: Any, batch_size: int) -> None:
        copy = self._sharding.meta_copy
        if copy is None:
            self._monitor.record_flops(None, batch_size)
            return
        self._monitor.count_flops(copy, batch, loss, batch_size)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._monitor, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._monitor, name, value)


def _add_sums(totals: dict[str, torch.Tensor] | None, recipe: Any, batch: Any) -> dict[str, torch.Tensor] | None:
    """``totals`` plus the recipe's :meth:`~skylift.recipes.base.Recipe.training_sums` of ``batch``."""
    training_sums = getattr(recipe, "training_sums", None)  # a duck-typed recipe may not define it
    sums = training_sums(batch) if training_sums is not None else None
    if not sums:
        return totals
    if totals is None:
        return {name: value.detach() for name, value in sums.items()}
    return {name: totals[name] + sums[name].detach() for name in totals}


def _evaluation_totals(totals: dict[str, torch.Tensor], distributed: bool, device: torch.device) -> dict[str, float]:
    """The evaluation sums over every rank. A rank can hold no evaluation batch (fewer
    shards, row groups or rows than ranks): it knows no names, so the ranks first agree on
    them (each rank's sorted names, gathered), and it adds zeros; an all-reduce of tensors
    of different lengths would wait forever."""
    keys = sorted(totals)
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        with collective("the evaluation totals' names (all_gather_object)"):
            dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
    stacked = (torch.stack([totals[key].to(device) if key in totals else torch.zeros((), dtype=torch.float64,
                                                                                     device=device) for key in keys])
               if keys else torch.zeros(0, dtype=torch.float64, device=device))  # fmt: skip
    if distributed:
        with collective("the evaluation totals (all_reduce)"):
            dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return dict(zip(keys, stacked.tolist(), strict=True))


def _across_ranks(sums: dict[str, torch.Tensor] | None, distributed: bool) -> dict[str, torch.Tensor] | None:
    """The step's sums over every rank: ranks can hold different numbers of samples (pairs
    kept whole, the last batch), so a mean of the ranks' means would weigh them wrongly."""
    if not sums or not distributed:
        return sums
    names = list(sums)
    stacked = torch.stack([sums[name].float() for name in names])
    with collective("the recipe's training sums (all_reduce)"):
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
    return dict(zip(names, stacked.unbind(), strict=True))


def _step_scalars(sums: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Each ``NAME_sum`` of ``sums`` divided by its ``count``, named ``NAME`` (tensors: no host sync)."""
    if not sums:
        return {}
    count = sums["count"].clamp(min=1)
    return {name.removesuffix("_sum"): value / count for name, value in sums.items() if name != "count"}
