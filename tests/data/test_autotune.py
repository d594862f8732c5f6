"""``data.num_workers: auto``: the measured sweep picks workers when they pay, none when not."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from skylift.data.autotune import default_candidates, sweep_num_workers
from skylift.monitor.schema import read_records
from skylift.train.trainer import Trainer
from tests.monitor.test_schema import monitored_config


class _WaitingSamples(Dataset):
    """Each sample waits 4 ms, as a read from remote storage would (the GIL is free meanwhile)."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, index):
        time.sleep(0.004)
        return torch.zeros(4), index


def _batches(dataset):
    return lambda workers: DataLoader(dataset, batch_size=16, num_workers=workers)


def _batch_size(batch):
    return int(batch[0].shape[0])


def test_workers_chosen_when_loading_waits():
    sweep = sweep_num_workers(_batches(_WaitingSamples()), _batch_size, candidates=[0, 1, 2], budget_s=0.4)
    assert set(sweep.results) == {0, 1, 2}
    assert sweep.chosen == 2
    assert sweep.results[2] > 1.5 * sweep.results[0]


def test_no_workers_for_an_in_memory_dataset():
    data = TensorDataset(torch.randn(8192, 64), torch.zeros(8192))
    sweep = sweep_num_workers(_batches(data), _batch_size, candidates=[0, 2], budget_s=0.3)
    assert sweep.chosen == 0


def test_candidates_follow_the_cpus():
    assert default_candidates(1) == [0, 1]
    assert default_candidates(2) == [0, 1, 2]
    assert default_candidates(64)[-1] == 16


def test_trainer_records_the_sweep(tmp_path):
    config = monitored_config(tmp_path, "schedule.max_steps=4", "precision=fp32", "data.num_workers=auto",
                              "data.autotune_s_per_setting=0.2")
    Trainer(config).fit()
    start = next(r for r in read_records(tmp_path / "metrics.jsonl") if r["kind"] == "run_start")
    sweep = start["autotune"]
    assert sweep["chosen"] in {int(n) for n in sweep["results"]}
    assert set(sweep["results"]) >= {"0", "1"}
