"""Token-budget dynamic batching: within budget, little padding, DDP-even, resumable."""

from __future__ import annotations

import numpy as np
import pytest

from skylift.data.token_budget import TokenBudgetBatchSampler

MAX_TOKENS = 4096


@pytest.fixture(scope="module")
def long_tailed_lengths():
    """Lengths like real text: most short, a long tail up to 512 tokens."""
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(mean=4.2, sigma=0.8, size=5000), 8, 512).astype(int).tolist()


def test_no_batch_exceeds_the_budget(long_tailed_lengths):
    sampler = TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, seed=1)
    for batch in sampler:
        assert len(batch) * max(long_tailed_lengths[i] for i in batch) <= MAX_TOKENS


def test_padding_share_is_below_ten_percent_on_a_long_tail(long_tailed_lengths):
    sampler = TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, seed=1)
    assert sampler.padding_share() < 0.10
    # The same lengths in fixed-size random batches waste far more.
    rng = np.random.default_rng(1)
    order = rng.permutation(len(long_tailed_lengths))
    fixed = [order[i : i + 32] for i in range(0, len(order), 32)]
    padded = sum(len(batch) * max(long_tailed_lengths[i] for i in batch) for batch in fixed)
    assert 1 - sum(long_tailed_lengths) / padded > 0.5


def test_ranks_get_equal_counts_and_disjoint_samples(long_tailed_lengths):
    ranks = [TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, rank=r, world_size=3, seed=2) for r in range(3)]
    counts = {len(list(sampler)) for sampler in ranks}
    assert len(counts) == 1
    seen = [index for sampler in ranks for batch in sampler for index in batch]
    assert len(seen) == len(set(seen))
    assert len(seen) >= 0.95 * len(long_tailed_lengths)  # only a short tail of batches is dropped


def test_deterministic_per_epoch_and_epochs_differ(long_tailed_lengths):
    first = list(TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, seed=3))
    assert first == list(TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, seed=3))
    other = TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, seed=3)
    other.set_epoch(1)
    assert list(other) != first


def test_resume_continues_where_it_stopped(long_tailed_lengths):
    sampler = TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, rank=1, world_size=2, seed=4)
    sampler.set_epoch(2)
    full = list(sampler)
    sampler.set_epoch(2, start_batch=10)
    restored = TokenBudgetBatchSampler(long_tailed_lengths, MAX_TOKENS, rank=1, world_size=2, seed=0)
    restored.load_state_dict(sampler.state_dict())
    assert list(restored) == full[10:]
    assert len(restored) == len(full) - 10


def test_a_sample_over_budget_is_named():
    with pytest.raises(ValueError, match=r"sample 1 has 900 tokens, more than data.max_tokens \(512\)"):
        TokenBudgetBatchSampler([10, 900, 20], max_tokens=512)
