"""A recipe's training sums (DPO's rewards) are summed over the ranks before the division:
ranks holding different numbers of pairs weigh each pair once, not each rank once."""

from __future__ import annotations

import json

import pytest

from tests.gloo_group import join, spawn_ranks

pytestmark = [pytest.mark.multiprocess]

PAIRS_AND_REWARD_SUMS = {0: (3.0, 3.0), 1: (1.0, 5.0)}
"""Rank 0: three pairs of reward 1; rank 1: one pair of reward 5. Over the four pairs the
mean is 8 / 4 = 2 (a mean of the ranks' means would say 3). Small integers: exact in fp32."""


def _rank(rank: int, world_size: int, port: int, folder: str) -> None:
    import torch

    from skylift.train.trainer import _across_ranks, _step_scalars

    join(rank, world_size, port)
    pairs, reward_sum = PAIRS_AND_REWARD_SUMS[rank]
    sums = {"count": torch.tensor(pairs), "rewards/chosen_sum": torch.tensor(reward_sum)}
    scalars = _step_scalars(_across_ranks(sums, distributed=True))
    with open(f"{folder}/rank{rank}.json", "w", encoding="utf-8") as file:
        json.dump({name: float(value) for name, value in scalars.items()}, file)


def test_rewards_of_uneven_ranks_are_the_mean_over_all_pairs(tmp_path):
    spawn_ranks(_rank, 2, str(tmp_path))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"rewards/chosen": 2.0}


def test_one_process_keeps_its_own_sums():
    import torch

    from skylift.train.trainer import _across_ranks

    sums = {"count": torch.tensor(3.0)}
    assert _across_ranks(sums, distributed=False) is sums


def _evaluating_rank(rank: int, world_size: int, port: int, folder: str) -> None:
    import torch

    from skylift.train.trainer import _evaluation_totals

    join(rank, world_size, port, timeout_s=60)
    # Rank 1 held no evaluation batch (fewer row groups than ranks): it knows no names.
    totals = {"loss_sum": torch.tensor(6.0, dtype=torch.float64), "count": torch.tensor(3.0, dtype=torch.float64)}
    summed = _evaluation_totals(totals if rank == 0 else {}, distributed=True, device=torch.device("cpu"))
    with open(f"{folder}/rank{rank}.json", "w", encoding="utf-8") as file:
        json.dump(summed, file)


def test_a_rank_without_evaluation_batches_adds_zeros_instead_of_hanging(tmp_path):
    spawn_ranks(_evaluating_rank, 2, str(tmp_path))
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == {"count": 3.0, "loss_sum": 6.0}
