"""Token-budget batches as optimizer steps: equal per rank, constant per epoch, exact counts."""

from __future__ import annotations

import numpy as np
import pytest

from skylift.data.token_steps import TokenBudgetSteps

MAX_TOKENS = 1024


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(mean=3.5, sigma=0.8, size=1500), 8, 256).astype(int).tolist()


def _ranks(lengths, world_size, accumulation_steps=1, epochs=3):
    return [
        TokenBudgetSteps(lengths, MAX_TOKENS, accumulation_steps, rank=rank, world_size=world_size, seed=5,
                         epochs=epochs)
        for rank in range(world_size)
    ]  # fmt: skip


@pytest.mark.parametrize(("world_size", "accumulation_steps"), [(1, 1), (2, 1), (2, 3)])
def test_every_rank_gets_the_same_number_of_batches_every_epoch(lengths, world_size, accumulation_steps):
    ranks = _ranks(lengths, world_size, accumulation_steps)
    steps_per_epoch = ranks[0].steps_per_epoch
    assert steps_per_epoch > 0 and {sampler.steps_per_epoch for sampler in ranks} == {steps_per_epoch}
    for epoch in range(3):
        seen = []
        for sampler in ranks:
            sampler.set_epoch(epoch)
            batches = list(sampler)
            assert len(batches) == len(sampler) == steps_per_epoch * accumulation_steps
            assert all(len(batch) * max(lengths[i] for i in batch) <= MAX_TOKENS for batch in batches)
            seen += [index for batch in batches for index in batch]
        assert len(seen) == len(set(seen)) >= 0.9 * len(lengths)


def test_samples_in_step_counts_every_rank_and_micro_batch(lengths):
    ranks = _ranks(lengths, world_size=2, accumulation_steps=2)
    steps_per_epoch = ranks[0].steps_per_epoch
    for epoch in (0, 1):
        per_rank = []
        for sampler in ranks:
            sampler.set_epoch(epoch)
            per_rank.append([len(batch) for batch in sampler])
        for step in range(steps_per_epoch):
            taken = sum(sum(sizes[2 * step : 2 * step + 2]) for sizes in per_rank)
            # Any rank answers for all, from its own copy of the plan.
            assert ranks[1].samples_in_step(epoch * steps_per_epoch + step) == taken


def test_resume_mid_epoch_yields_the_rest_of_the_epoch(lengths):
    sampler = _ranks(lengths, world_size=2, accumulation_steps=2)[1]
    sampler.set_epoch(1)
    full = list(sampler)
    restored = TokenBudgetSteps(lengths, MAX_TOKENS, 2, rank=1, world_size=2, seed=0, epochs=3)
    sampler.set_epoch(1, start_step=4)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == full[8:]
    assert len(restored) == len(full) - 8


def test_epoch_record_reports_low_padding(lengths):
    sampler = _ranks(lengths, world_size=1)[0]
    record = sampler.epoch_record()
    assert record["padding_share"] < 0.1
    assert record["padded_tokens"] > record["real_tokens"] > 0
    assert record["batches"] == sampler.steps_per_epoch


def test_too_few_batches_for_one_step_is_refused():
    with pytest.raises(ValueError, match="fewer token-budget batches than one optimizer step"):
        TokenBudgetSteps([10] * 4, 1024, 4, rank=0, world_size=2, seed=0, epochs=1)


def test_weighted_micro_batches_follow_the_mean_over_every_sample_of_the_step():
    """Token-budget micro-batches hold different numbers of samples; with the weights,
    accumulation (mean over A) and DDP (mean over W) give the full batch's gradient."""
    import torch
    from torch import nn

    from skylift.data.loaders import micro_batch_weight

    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    inputs, targets = torch.randn(8, 3), torch.randn(8, 1)
    nn.functional.mse_loss(model(inputs), targets).backward()
    full = model.weight.grad.clone()

    sizes_by_rank = [[3, 1], [2, 2]]  # W = 2 ranks, A = 2 micro-batches each
    per_rank, start = [], 0
    for sizes in sizes_by_rank:
        model.zero_grad()
        for size in sizes:
            batch = slice(start, start + size)
            loss = nn.functional.mse_loss(model(inputs[batch]), targets[batch])
            (loss * micro_batch_weight(size, 8, micro_batches=4) / len(sizes)).backward()
            start += size
        per_rank.append(model.weight.grad.clone())
    averaged = sum(per_rank) / len(per_rank)  # what DDP's all-reduce gives
    torch.testing.assert_close(averaged, full)
    assert micro_batch_weight(16, 64, micro_batches=4) == 1.0  # fixed batches: unchanged
