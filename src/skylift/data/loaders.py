"""Build the training and evaluation loaders a run needs, in memory or streamed from shards."""

from __future__ import annotations

import os
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch.utils.data import DataLoader, IterableDataset

from skylift.config.schema import RunConfig
from skylift.data.datasets import DatasetSplit
from skylift.data.sampler import GlobalBatchSampler, ShardedEvalSampler
from skylift.loop.distributed import DistributedContext

__all__ = ["Loaders", "build_loaders", "epoch_records", "samples_in_step", "with_workers"]


@dataclass
class Loaders:
    """``order`` has ``set_epoch(epoch, start_step)`` and ``steps_per_epoch``."""

    data: DatasetSplit
    order: Any
    train: DataLoader
    val: DataLoader | None


def build_loaders(config: RunConfig, recipe: Any, context: DistributedContext, *, pin_memory: bool,
                  data: DatasetSplit | None = None) -> Loaders:
    """The loaders ``config`` asks for; ``data``: in-memory datasets built before (kept
    when only the batching changes)."""
    if config.data.url:
        return _streamed(config, recipe, context, pin_memory)
    data = data if data is not None else recipe.build_datasets()
    if isinstance(data.train, IterableDataset):  # streamed by the recipe itself (a table source's rows)
        return _recipe_streamed(config, data, context, pin_memory)
    order = _training_order(config, data, context)
    train = _loader(data.train, config, pin_memory, batch_sampler=order, collate_fn=_collate(recipe, True))
    val = None
    if data.val is not None:
        shards = ShardedEvalSampler(len(cast(Sized, data.val)), config.data.eval_batch_size, rank=context.rank,
                                    world_size=context.world_size)
        val = _loader(data.val, config, pin_memory, batch_sampler=shards, collate_fn=_collate(recipe, False))
    return Loaders(data, order, train, val)


def _training_order(config: RunConfig, data: DatasetSplit, context: DistributedContext) -> Any:
    if config.data.batching == "token_budget":
        from skylift.data.token_steps import TokenBudgetSteps
        from skylift.errors import SkyliftConfigError

        lengths = getattr(data.train, "lengths", None)
        if lengths is None:
            raise SkyliftConfigError("data.batching: token_budget needs a dataset with sequence lengths (text)")
        try:
            return TokenBudgetSteps(lengths, config.data.max_tokens, config.accumulation.steps, rank=context.rank,
                                    world_size=context.world_size, seed=config.seed, epochs=config.schedule.epochs)
        except ValueError as error:
            raise SkyliftConfigError(str(error)) from None
    return GlobalBatchSampler(
        len(cast(Sized, data.train)),
        config.data.global_batch_size,
        config.accumulation.steps,
        rank=context.rank,
        world_size=context.world_size,
        seed=config.seed,
        keyed_by_epoch=getattr(data.train, "keyed_by_epoch", False),
    )


def samples_in_step(order: Any, step: int, global_batch_size: int) -> int:
    """Samples optimizer step ``step`` (0-based) took on all ranks: ``global_batch_size``
    unless the order batches by tokens; computed from the order's plan, no collective."""
    counter = getattr(order, "samples_in_step", None)
    return counter(step) if counter is not None else global_batch_size


def micro_batch_weight(batch_samples: int, step_samples: int, micro_batches: int) -> float:
    """Factor for one micro-batch's mean loss so that the optimizer step follows the mean
    over all ``step_samples`` samples of the step (``micro_batches``: accumulation steps
    x ranks, whose losses accumulation and DDP average with equal weights).

    1.0 for fixed batches. Under a token budget micro-batches hold different numbers of
    samples, and equal weights would count a sample of a small batch (long sequences)
    several times as much as one of a large batch (short sequences).
    """
    return batch_samples * micro_batches / step_samples


def epoch_records(order: Any, epoch: int, step: int) -> list[dict[str, Any]]:
    """The ``epoch`` metrics record (padding share and token counts) of an order that
    batches by tokens; none for fixed batches."""
    describe = getattr(order, "epoch_record", None)
    return [{"kind": "epoch", "epoch": epoch, "step": step, **describe()}] if describe is not None else []


def _streamed(config: RunConfig, recipe: Any, context: DistributedContext, pin_memory: bool) -> Loaders:
    from skylift.data.shards import read_shard_samples
    from skylift.data.streaming import EvalStream, StreamingDataset

    data = config.data
    cache_dir, cache_limit_bytes = os.path.expanduser(data.cache_dir), int(data.cache_limit_gib * 2**30)
    train = StreamingDataset(
        data.url or "",
        decode=lambda sample: sample,  # replaced below, once the fields are known
        global_batch_size=data.global_batch_size,
        accumulation_steps=config.accumulation.steps,
        rank=context.rank,
        world_size=context.world_size,
        seed=config.seed,
        prefetch_shards=data.prefetch_shards,
        shuffle_block_shards=data.shuffle_block_shards,
        endpoint_url=data.endpoint_url,
        cache_dir=cache_dir,
        cache_limit_bytes=cache_limit_bytes,
    )
    classes = train.index.metadata.get("classes") or []
    if hasattr(recipe, "set_classes"):  # a recipe that maps label names to indices
        recipe.set_classes(classes)
    train.decode = recipe.decoder(train.index.fields)
    train.collate = _collate(recipe, True) or train.collate
    first = train.decode(next(read_shard_samples(train.store.read_bytes(train.index.shards[0].name))))
    # A recipe with a num_classes setting (the built-in classifiers) may give the count itself.
    if not classes and getattr(getattr(recipe, "settings", None), "num_classes", None) is None:
        from skylift.errors import SkyliftConfigError

        raise SkyliftConfigError(f"data.url: {data.url} lists no classes in its index; set recipe.num_classes")
    split = DatasetSplit(train=train, val=None, num_classes=len(classes), in_channels=int(first[0].shape[0]))
    val = None
    if data.val_url:
        eval_decoder = getattr(recipe, "eval_decoder", recipe.decoder)
        stream = EvalStream(data.val_url, decode=eval_decoder(train.index.fields), batch_size=data.eval_batch_size,
                            rank=context.rank, world_size=context.world_size, endpoint_url=data.endpoint_url,
                            cache_dir=cache_dir, cache_limit_bytes=cache_limit_bytes)
        if (collate := _collate(recipe, False)) is not None:
            stream.collate = collate
        val = _loader(stream, config, pin_memory, batch_size=None, workers=0)
    return Loaders(split, train, _loader(train, config, pin_memory, batch_size=None), val)


def _recipe_streamed(config: RunConfig, data: DatasetSplit, context: DistributedContext,
                     pin_memory: bool) -> Loaders:
    """Loaders of a recipe's streams, placed on this rank: the training stream is its own
    order (``set_epoch``, ``steps_per_epoch``), the evaluation stream reads in this process."""
    train: Any = data.train
    train.place(context.rank, context.world_size)
    val = None
    if isinstance(data.val, IterableDataset):
        cast(Any, data.val).place(context.rank, context.world_size)
        val = _loader(data.val, config, pin_memory, batch_size=None, workers=0)
    elif data.val is not None:  # validation documents in memory (a JSONL file)
        shards = ShardedEvalSampler(len(cast(Sized, data.val)), config.data.eval_batch_size, rank=context.rank,
                                    world_size=context.world_size)
        val = _loader(data.val, config, pin_memory, batch_sampler=shards, collate_fn=train.collate)
    return Loaders(data, train, _loader(train, config, pin_memory, batch_size=None, streamed=True), val)


def _collate(recipe: Any, train: bool) -> Any:
    """The recipe's collate function for the training or evaluation loader; ``None``:
    PyTorch's default (also for a recipe object without the method)."""
    collate = getattr(recipe, "collate", None)
    return collate(train) if collate is not None else None


def _loader(dataset: Any, config: RunConfig, pin_memory: bool, workers: int | None = None, *,
            streamed: bool = False, **batching: Any) -> DataLoader:
    num_workers = config.data.num_workers if workers is None else workers
    if not isinstance(num_workers, int):  # the Trainer measures `auto` before it builds loaders
        raise ValueError("data.num_workers: auto is resolved to a count before the loaders are built")
    return DataLoader(
        dataset,
        num_workers=num_workers,
        pin_memory=pin_memory,
        # A streamed dataset's epoch is set in the main process before each iteration;
        # persistent workers would keep the previous epoch's copy.
        persistent_workers=num_workers > 0 and not (config.data.url or streamed),
        # Each new iterator draws a worker seed from this generator. From the global one,
        # the draw would shift the model's dropout stream whenever a resume starts an
        # iterator mid-epoch that the uninterrupted run started at the epoch's start.
        generator=torch.Generator().manual_seed(config.seed),
        **batching,
    )


def with_workers(loader: DataLoader, num_workers: int) -> DataLoader:
    """The same loader (dataset, batching, sampler object, collate) with ``num_workers``.

    The batch order lives in the sampler (or the streamed dataset), not in the
    workers, so after ``set_epoch(epoch, start_step)`` the new loader continues exactly
    where the old one would have.
    """
    streamed = isinstance(loader.dataset, IterableDataset)
    batching: dict[str, Any]
    if streamed:
        batching = {"batch_size": loader.batch_size, "drop_last": loader.drop_last}
    elif loader.batch_size is None:
        batching = {"batch_sampler": loader.batch_sampler}
    else:
        batching = {"batch_size": loader.batch_size, "sampler": loader.sampler, "drop_last": loader.drop_last}
    return DataLoader(
        loader.dataset,
        num_workers=num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        # as in _loader: a streamed dataset gets its epoch in the main process, per iterator
        persistent_workers=num_workers > 0 and not streamed,
        generator=loader.generator,
        **batching,
    )
