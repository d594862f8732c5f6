"""``data.num_workers: auto``: the measured sweep picks workers when they pay, none when not."""

from __future__ import annotations

import time

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from skylift.data.autotune import LoaderTuner, default_candidates
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


def _tune(dataset, candidates):
    """Drive the tuner over real DataLoaders, as the Trainer does: a new loader on each switch."""
    tuner = LoaderTuner(candidates, budget_s=0.3, warmup_steps=3)
    workers = tuner.current
    while not tuner.done:
        switch = None
        for batch in DataLoader(dataset, batch_size=16, num_workers=workers):
            switch = tuner.after_step(samples=int(batch[0].shape[0]))
            if switch is not None or tuner.done:
                break
        workers = switch if switch is not None else workers
    return tuner


def test_workers_chosen_when_loading_waits():
    tuner = _tune(_WaitingSamples(), [0, 1, 2])
    assert set(tuner.results) == {0, 1, 2}
    assert tuner.chosen == 2
    assert tuner.results[2] > 1.2 * tuner.results[0]


def test_no_workers_for_an_in_memory_dataset():
    data = TensorDataset(torch.randn(8192, 64), torch.zeros(8192))
    assert _tune(data, [0, 2]).chosen == 0


def test_candidates_follow_the_cpus():
    assert default_candidates(1) == [0, 1]
    assert default_candidates(2) == [0, 1, 2]
    assert default_candidates(64)[-1] == 16


def test_tuner_tries_each_candidate_then_keeps_the_fastest():
    tuner = LoaderTuner([0, 1, 2], budget_s=0.0, warmup_steps=1, min_steps=2)
    switches = []
    for delay_s in [0.0, 0.02, 0.02, 0.0, 0.005, 0.005, 0.0, 0.01, 0.01]:  # candidate 1 is fastest
        time.sleep(delay_s)
        switches.append(tuner.after_step(samples=8))
    assert switches == [None, None, 1, None, None, 2, None, None, 1]
    assert tuner.done and tuner.chosen == 1 and set(tuner.results) == {0, 1, 2}


def test_trainer_tunes_while_training_without_changing_the_run(tmp_path):
    # No HTML report: nothing here reads it, and its PNGs cost more than these 24 steps. A budget
    # far under a step's time, so each candidate is timed for the tuner's minimum of steps (one
    # warm-up and three timed: 12 steps for three candidates on any machine). A budget in seconds
    # takes more steps on a faster machine: 0.05 s was 8 steps a candidate at 8 ms a step here,
    # all 24 for three, and the tuner had not decided when the run ended.
    common = ["schedule.max_steps=24", "precision=fp32", "data.autotune_s_per_setting=0.001", "monitor.report=false"]
    Trainer(monitored_config(tmp_path / "auto", *common, "data.num_workers=auto")).fit()
    Trainer(monitored_config(tmp_path / "fixed", *common, "data.num_workers=0")).fit()
    auto = list(read_records(tmp_path / "auto" / "metrics.jsonl"))
    tuned = next(r for r in auto if r["kind"] == "autotune")
    assert set(tuned["results"]) == {str(n) for n in default_candidates()}
    assert tuned["chosen"] in default_candidates()

    def losses(records):
        return [r["loss"] for r in records if r["kind"] == "train"]

    # Switching loaders mid-epoch changes neither the batches nor their order.
    assert losses(auto) == losses(read_records(tmp_path / "fixed" / "metrics.jsonl"))
