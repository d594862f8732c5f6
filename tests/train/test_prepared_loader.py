"""A plain DataLoader given to Runtime.prepare resumes at the exact next batch, also on
another process count (the epoch's order does not depend on it)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from skylift.loop.distributed import DistributedContext
from skylift.loop.events import TrainState
from skylift.train.prepared_loader import prepare_loader

SAMPLES = 100


class _Runtime:
    """What PreparedLoader asks of the runtime: accumulation, state, fetch."""

    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.state = TrainState(total_steps=0, steps_per_epoch=0, global_batch_size=0)

    def fetch(self, batches):
        return next(batches)


def _loader(world_size: int, rank: int, *, batch_size: int = 4, accumulation_steps: int = 2, shuffle: bool = True):
    dataset = TensorDataset(torch.arange(SAMPLES))
    context = DistributedContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                                 backend=None)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=shuffle)
    return prepare_loader(loader, _Runtime(accumulation_steps), context, seed=7)


def _take_steps(loaders, steps: int, accumulation_steps: int = 2) -> list[int]:
    """Run ``steps`` optimizer steps over every rank's loader; the samples seen, in global order."""
    iterators = [iter(loader) for loader in loaders]
    seen = []
    for _ in range(steps):
        for iterator in iterators:
            for _ in range(accumulation_steps):
                seen += next(iterator)[0].tolist()
    return seen


def test_an_epoch_is_one_permutation_cut_into_global_batches_on_any_process_count():
    one = _take_steps([_loader(1, 0, batch_size=8)], steps=6)
    two = _take_steps([_loader(2, 0), _loader(2, 1)], steps=6)
    assert sorted(one) == sorted(two) and len(set(one)) == 96  # 100 // 16 = 6 steps; the rest is dropped


@pytest.mark.parametrize(("before", "after"), [(2, 2), (2, 1), (1, 2)])
def test_resume_continues_at_the_exact_next_sample_on_the_same_or_another_process_count(before, after):
    """Per-rank batch fixed (4 x 2 micro-steps): the global batch changes with the process count."""
    first = [_loader(before, rank) for rank in range(before)]
    seen = _take_steps(first, steps=3)
    state = first[0].state_dict()
    assert state == {"epoch": 0, "samples_into_epoch": 3 * 8 * before, "seed": 7, "resumable": True}
    resumed = [_loader(after, rank) for rank in range(after)]
    for loader in resumed:
        loader.load_state_dict(state)
    rest = [int(sample) for sample in _drain(resumed)]
    order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(7 * 1_000_003)).tolist()
    global_batch = 8 * after
    expected_rest = order[len(seen):][: (SAMPLES - len(seen)) // global_batch * global_batch]
    assert sorted(seen + rest) == sorted(order[: len(seen) + len(expected_rest)])
    assert sorted(rest) == sorted(expected_rest)  # nothing seen twice, nothing skipped


def _drain(loaders) -> list[int]:
    iterators = [iter(loader) for loader in loaders]
    out = []
    while True:
        try:
            for iterator in iterators:
                for _ in range(2):
                    out += next(iterator)[0].tolist()
        except StopIteration:
            return out


def test_the_last_step_of_an_epoch_saves_the_next_epoch():
    loader = _loader(1, 0)
    for _ in loader:
        pass
    assert loader.epoch == 1
    # 12 steps of 8 take 96 of 100 samples: no full step is left, so a resume starts epoch 1.
    again = _loader(1, 0)
    iterator = iter(again)
    for _ in range(12 * 2):
        next(iterator)
    assert again.state_dict()["epoch"] == 1 and again.state_dict()["samples_into_epoch"] == 0


def test_a_users_distributed_sampler_is_replaced_by_the_global_order():
    dataset = TensorDataset(torch.arange(SAMPLES))
    context = DistributedContext(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"), backend=None)
    loader = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset, num_replicas=2, rank=1))
    prepared = prepare_loader(loader, _Runtime(1), context, seed=0)
    assert prepared.resumable and prepared.sampler.rank == 1 and prepared.sampler.shuffle


def test_a_loader_that_cannot_be_resampled_is_said_to_restart_its_epoch(caplog):
    dataset = TensorDataset(torch.arange(SAMPLES))
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    loader = DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]])
    prepared = prepare_loader(loader, _Runtime(1), context, seed=0)
    assert not prepared.resumable
    prepared.load_state_dict({"epoch": 3, "resumable": False})
    assert prepared.epoch == 3 and "starts the epoch from its beginning" in caplog.text
