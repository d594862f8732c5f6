from __future__ import annotations

import pytest

from skylift.data.sampler import GlobalBatchSampler, ShardedEvalSampler


def _global_steps(num_samples, batch, accumulation, world_size, epoch=0, start_step=0):
    """The samples of each optimizer step, gathered over all ranks."""
    per_rank = []
    for rank in range(world_size):
        sampler = GlobalBatchSampler(num_samples, batch, accumulation, rank=rank, world_size=world_size, seed=7)
        sampler.set_epoch(epoch, start_step)
        micro = list(sampler)
        assert len(micro) == len(sampler)
        per_rank.append([sum(micro[i : i + accumulation], []) for i in range(0, len(micro), accumulation)])
    return [sorted(sum((ranks[step] for ranks in per_rank), [])) for step in range(len(per_rank[0]))]


@pytest.mark.parametrize(("world_size", "accumulation"), [(2, 1), (4, 2), (1, 8)])
def test_global_order_does_not_depend_on_process_count(world_size, accumulation):
    assert _global_steps(103, 16, accumulation, world_size) == _global_steps(103, 16, 1, 1)


def test_every_sample_at_most_once_per_epoch_and_epochs_differ():
    steps = _global_steps(100, 10, 1, 2)
    flat = sum(steps, [])
    assert sorted(flat) == list(range(100))
    assert _global_steps(100, 10, 1, 2, epoch=1) != steps


def test_resume_mid_epoch_continues_the_same_order():
    full = _global_steps(96, 8, 2, 2)
    assert _global_steps(96, 8, 2, 2, start_step=5) == full[5:]


def test_state_dict_round_trip():
    sampler = GlobalBatchSampler(64, 8, 1, rank=0, world_size=1, seed=3)
    sampler.set_epoch(2, start_step=3)
    other = GlobalBatchSampler(64, 8, 1, rank=0, world_size=1, seed=0)
    other.load_state_dict(sampler.state_dict())
    assert list(other) == list(sampler)


def test_dataset_smaller_than_a_batch_names_the_field():
    with pytest.raises(ValueError, match="data.global_batch_size"):
        GlobalBatchSampler(10, 16, 1, rank=0, world_size=1, seed=0)


def test_eval_shards_cover_every_sample_once():
    seen = []
    for rank in range(3):
        for batch in ShardedEvalSampler(10, 3, rank=rank, world_size=3):
            seen += batch
    assert sorted(seen) == list(range(10))
