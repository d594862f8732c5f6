"""A user's DataLoader, sharded across ranks, on the device, and resumable mid-epoch.

``Runtime.prepare`` gives a plain map-style loader (a ``RandomSampler``,
``SequentialSampler`` or ``DistributedSampler`` with a ``batch_size``) skylift's
:class:`~skylift.data.sampler.GlobalBatchSampler`: each epoch is one seeded permutation
of the whole dataset cut into global batches of ``batch_size x world_size x
accumulation_steps`` samples, so the sample order does not depend on the process
count. The loader's place in the epoch is counted in samples, saved with every
checkpoint and restored by ``Runtime.resume``: the next batch after a resume is the
one that would have come next, on the same or a different number of processes (with
the same per-rank batch size). The last partial global batch of an epoch is dropped,
so every optimizer step sees the same number of samples.

Loaders that cannot be re-sampled this way (a custom ``batch_sampler``, an iterable
dataset) are only moved to the device; their position is not saved, and a resume
mid-epoch says so.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from skylift.data.sampler import GlobalBatchSampler
from skylift.loop.distributed import DistributedContext

__all__ = ["EvalLoader", "PreparedLoader", "batch_size_of", "prepare_eval_loader", "prepare_loader"]

log = logging.getLogger("skylift")


class PreparedLoader:
    """Iterate a loader with batches on the device; ``state_dict`` is its place in the epoch."""

    def __init__(self, loader: DataLoader, runtime: Any, sampler: GlobalBatchSampler | None) -> None:
        self.loader = loader
        self.sampler = sampler
        self.epoch = 0
        self._runtime = runtime
        self._start_sample = 0
        self._batches_this_epoch = 0
        self._resumed_mid_epoch = False

    @property
    def resumable(self) -> bool:
        return self.sampler is not None

    @property
    def steps_per_epoch(self) -> int:
        if self.sampler is not None:
            return self.sampler.steps_per_epoch
        return len(self.loader) // self._runtime.accumulation_steps

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch, start_sample=self._start_sample)
        self._runtime.state.epoch = self.epoch
        self._batches_this_epoch = 0
        batches = iter(self.loader)
        while True:
            try:
                batch = self._runtime.fetch(batches)
            except StopIteration:
                break
            self._batches_this_epoch += 1
            yield batch
        self.epoch += 1
        self._start_sample = 0

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def state_dict(self) -> dict[str, Any]:
        """The place in the epoch at the step boundary just reached, in samples."""
        if self.sampler is None:
            return {"epoch": self.epoch, "resumable": False}
        sampler = self.sampler
        steps_done = self._batches_this_epoch // sampler.accumulation_steps
        samples = self._start_sample + steps_done * sampler.global_batch_size
        epoch = self.epoch
        if samples + sampler.global_batch_size > sampler.num_samples:  # no full global batch left
            epoch, samples = epoch + 1, 0
        return {"epoch": epoch, "samples_into_epoch": samples, "seed": sampler.seed, "resumable": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = int(state["epoch"])
        if self.sampler is None or not state.get("resumable", False):
            log.warning(
                "the data loader's place in epoch %d was not saved (%s): it starts the epoch from its beginning",
                self.epoch, "this loader cannot be re-sampled" if self.sampler is None else "saved without it",
            )
            return
        self.sampler.seed = int(state["seed"])
        self._start_sample = int(state["samples_into_epoch"])
        self._runtime.state.epoch = self.epoch


def prepare_loader(loader: DataLoader, runtime: Any, context: DistributedContext, seed: int) -> PreparedLoader:
    """Re-sample ``loader`` in global batches where it can be, and wrap it."""
    sampler = _global_sampler(loader, runtime.accumulation_steps, context, seed)
    if sampler is None:
        batch_sampler = getattr(loader, "batch_sampler", None)
        already_sharded = getattr(batch_sampler, "shards_by_rank", False) or isinstance(
            getattr(loader, "sampler", None), DistributedSampler
        )
        if context.is_distributed and not already_sharded:
            raise ValueError(
                "Runtime.prepare cannot shard this DataLoader across ranks (a custom batch_sampler or an iterable "
                "dataset): give it a batch size and a RandomSampler/SequentialSampler, or a sampler of your own "
                "with shards_by_rank = True"
            )
        return PreparedLoader(loader, runtime, None)
    rebuilt = DataLoader(
        loader.dataset,
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
        worker_init_fn=loader.worker_init_fn,
        prefetch_factor=loader.prefetch_factor if loader.num_workers > 0 else None,
    )
    return PreparedLoader(rebuilt, runtime, sampler)


def _global_sampler(loader: DataLoader, accumulation_steps: int, context: DistributedContext,
                    seed: int) -> GlobalBatchSampler | None:
    sampler = getattr(loader, "sampler", None)
    plain = isinstance(sampler, (RandomSampler, SequentialSampler, DistributedSampler))
    if loader.batch_size is None or isinstance(loader.dataset, IterableDataset) or not plain:
        return None
    shuffle = isinstance(sampler, RandomSampler) or (isinstance(sampler, DistributedSampler) and sampler.shuffle)
    global_batch = loader.batch_size * context.world_size * accumulation_steps
    return GlobalBatchSampler(_length(loader.dataset), global_batch, accumulation_steps, rank=context.rank,
                              world_size=context.world_size, seed=seed, shuffle=shuffle)


class EvalLoader:
    """Iterate an evaluation loader with batches on the device (not timed as training)."""

    def __init__(self, loader: DataLoader, runtime: Any) -> None:
        self.loader = loader
        self._runtime = runtime

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield self._runtime.to_device(batch)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def batch_size_of(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if none)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    return len(batch) if hasattr(batch, "__len__") else 0  # a batch type of the recipe's own


def prepare_eval_loader(loader: DataLoader, runtime: Any, context: DistributedContext) -> EvalLoader:
    """An evaluation loader: contiguous per-rank shards (every sample once), batches on the device."""
    return EvalLoader(_shard_for_eval(loader, context), runtime)


def _shard_for_eval(loader: DataLoader, context: DistributedContext) -> DataLoader:
    already_sharded = getattr(getattr(loader, "batch_sampler", None), "shards_by_rank", False) or isinstance(
        getattr(loader, "sampler", None), DistributedSampler
    )
    if not context.is_distributed or already_sharded:
        return loader
    if loader.batch_size is None:
        raise ValueError(
            "Runtime.prepare cannot shard an evaluation DataLoader built with a custom batch_sampler; "
            "give it a batch size, or a sampler with shards_by_rank = True"
        )
    from skylift.data.sampler import ShardedEvalSampler

    return DataLoader(
        loader.dataset,
        batch_sampler=ShardedEvalSampler(_length(loader.dataset), loader.batch_size, rank=context.rank,
                                         world_size=context.world_size),
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        persistent_workers=loader.persistent_workers,
    )


def _length(dataset: object) -> int:
    """A map-style dataset's length (a sampler over it needs one)."""
    if not isinstance(dataset, Sized):
        raise TypeError(f"{type(dataset).__name__} has no len(): a sampler over it needs one")
    return len(dataset)
