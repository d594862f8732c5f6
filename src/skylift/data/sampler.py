"""Samplers whose global order does not depend on the number of processes.

Each epoch draws one seeded permutation of the whole dataset and cuts it into global
batches. Rank ``r`` of ``W`` takes the ``r``-th slice of every global batch and splits
it into ``accumulation_steps`` micro-batches. So the samples that form optimizer step
``s`` are the same on 1, 2 or 8 processes, which makes a DDP run reproduce a single
process run and lets a run resume on a different process count.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["GlobalBatchSampler", "ShardedEvalSampler"]


class GlobalBatchSampler(Sampler[list[int] | list[tuple[int, int]]]):
    """Yield this rank's micro-batches, ``accumulation_steps`` per global batch.

    Args:
        num_samples: dataset length.
        global_batch_size: samples per optimizer step across all ranks.
        accumulation_steps: micro-batches per optimizer step on each rank.
        rank, world_size: this process's place in the job.
        seed: with the epoch, fixes the permutation.
        shuffle: draw a new permutation per epoch (else dataset order).
        keyed_by_epoch: yield ``(epoch, index)`` keys instead of indices, for a dataset
            whose augmentation is seeded per epoch and sample
            (:class:`~skylift.data.images.EncodedImages`).

    The last partial global batch of an epoch is dropped: every optimizer step sees
    exactly ``global_batch_size`` samples, which is what keeps runs comparable.

    Example:
        >>> sampler = GlobalBatchSampler(10, 4, 1, rank=1, world_size=2, seed=0, shuffle=False)
        >>> list(sampler)
        [[2, 3], [6, 7]]
    """

    shards_by_rank = True

    def __init__(
        self,
        num_samples: int,
        global_batch_size: int,
        accumulation_steps: int,
        *,
        rank: int,
        world_size: int,
        seed: int,
        shuffle: bool = True,
        keyed_by_epoch: bool = False,
    ) -> None:
        per_step = world_size * accumulation_steps
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must divide by world_size x accumulation_steps ({per_step})"
            )
        if num_samples < global_batch_size:
            raise ValueError(
                f"the dataset has {num_samples} samples, fewer than one global batch ({global_batch_size}); "
                "lower data.global_batch_size"
            )
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.accumulation_steps = accumulation_steps
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.keyed_by_epoch = keyed_by_epoch
        self.epoch = 0
        self.start_step = 0
        self.start_sample = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch_size

    @property
    def _remaining_steps(self) -> int:
        return max((self.num_samples - self.start_sample) // self.global_batch_size - self.start_step, 0)

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // (self.world_size * self.accumulation_steps)

    def set_epoch(self, epoch: int, start_step: int = 0, *, start_sample: int = 0) -> None:
        """Select the epoch's permutation and skip its first ``start_sample`` samples, then
        ``start_step`` global batches. A position in samples survives a change of the
        global batch (a resume on another process count with the same per-rank batch)."""
        self.epoch = epoch
        self.start_step = start_step
        self.start_sample = start_sample

    def global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_samples))
        generator = torch.Generator()
        generator.manual_seed(self.seed * 1_000_003 + self.epoch)
        return torch.randperm(self.num_samples, generator=generator).tolist()

    def __iter__(self) -> Iterator[list[int] | list[tuple[int, int]]]:
        order = self.global_order()
        per_rank = self.global_batch_size // self.world_size
        micro = self.micro_batch_size
        first = self.start_sample + self.start_step * self.global_batch_size
        for step in range(self._remaining_steps):
            begin = first + step * self.global_batch_size + self.rank * per_rank
            mine = order[begin : begin + per_rank]
            for offset in range(0, per_rank, micro):
                batch = mine[offset : offset + micro]
                yield [(self.epoch, index) for index in batch] if self.keyed_by_epoch else batch

    def __len__(self) -> int:
        return self._remaining_steps * self.accumulation_steps

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "start_step": self.start_step, "start_sample": self.start_sample,
                "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.set_epoch(int(state["epoch"]), int(state["start_step"]), start_sample=int(state.get("start_sample", 0)))


class ShardedEvalSampler(Sampler[list[int]]):
    """Contiguous, unpadded shards for evaluation: every sample is scored exactly once.

    Ranks may get a different number of batches, so evaluation must not run
    collectives per batch; sums are all-reduced once at the end.
    """

    shards_by_rank = True

    def __init__(self, num_samples: int, batch_size: int, *, rank: int, world_size: int) -> None:
        per_rank = -(-num_samples // world_size)
        self.indices = list(range(rank * per_rank, min(num_samples, (rank + 1) * per_rank)))
        self.batch_size = batch_size

    def __iter__(self) -> Iterator[list[int]]:
        for offset in range(0, len(self.indices), self.batch_size):
            yield self.indices[offset : offset + self.batch_size]

    def __len__(self) -> int:
        return (len(self.indices) + self.batch_size - 1) // self.batch_size
