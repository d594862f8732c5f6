"""Diagnosis: real runs that are input-bound and compute-bound, and the rules on records."""

from __future__ import annotations

import dataclasses
import time

from torch.utils.data import Dataset

from skylift.monitor.diagnosis import diagnose
from skylift.monitor.schema import BREAKDOWN_PHASES, read_records, validate_record
from skylift.recipes.image_classification import ImageClassification
from skylift.train.trainer import Trainer
from tests.monitor.test_schema import monitored_config


class _SlowSamples(Dataset):
    """A loader that sleeps per sample, as one reading small objects from far away would."""

    def __init__(self, inner: Dataset, delay_s: float) -> None:
        self.inner, self.delay_s = inner, delay_s

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        time.sleep(self.delay_s)
        return self.inner[index]


class _SlowRecipe(ImageClassification):
    def build_datasets(self):
        split = super().build_datasets()
        # 5 ms a sample, 320 ms a step of 64: far above the step's compute (~15 ms on 2 cores),
        # so the run stays input-bound when other processes slow the compute several times.
        return dataclasses.replace(split, train=_SlowSamples(split.train, delay_s=0.005))


def _diagnosis(run_dir):
    records = list(read_records(run_dir / "metrics.jsonl"))
    found = [r for r in records if r["kind"] == "diagnosis"]
    assert len(found) == 1
    validate_record(found[0])
    return found[0]


def test_slow_loader_is_input_bound_with_loader_advice(tmp_path):
    config = monitored_config(tmp_path, "schedule.max_steps=8", "precision=fp32")
    Trainer(config, recipe=_SlowRecipe(config)).fit()
    diagnosis = _diagnosis(tmp_path)
    assert diagnosis["bound"] == "input"
    assert diagnosis["shares"]["data_wait"] > 0.25
    finding = next(f for f in diagnosis["findings"] if f["kind"] == "input")
    assert "data wait" in finding["message"] and "%" in finding["message"]
    assert "data.num_workers" in finding["advice"]


def test_heavy_model_is_compute_bound(tmp_path):
    config = monitored_config(tmp_path, "schedule.max_steps=12", "precision=fp32", "recipe.width=96")
    Trainer(config).fit()
    diagnosis = _diagnosis(tmp_path)
    assert diagnosis["bound"] == "compute"
    assert diagnosis["shares"]["forward_backward"] > 0.6
    finding = next(f for f in diagnosis["findings"] if f["kind"] == "compute")
    assert "MFU" in finding["message"]


def _records(breakdown, **start):
    start_record = {"kind": "run_start", "time": 0.0, "device": "cuda", "precision": "bf16", **start}
    train = [{"kind": "train", "step": step, "mfu": 0.3, "samples_per_s": 100.0, "breakdown_s": breakdown}
             for step in range(1, 6)]
    return [start_record, *train]


def _breakdown(**seconds):
    return {phase: seconds.get(phase, 0.0) for phase in BREAKDOWN_PHASES}


def test_exposed_communication_is_named():
    result = diagnose(_records(_breakdown(forward_backward=0.6, communication=0.3, optimizer=0.1)))
    assert result["bound"] == "communication"
    assert "accumulation.steps" in result["findings"][0]["advice"]


def test_checkpoint_stall_advice_depends_on_async():
    result = diagnose(_records(_breakdown(forward_backward=0.8, checkpoint=0.2), checkpoint_async=False))
    assert result["bound"] == "checkpoint"
    assert "checkpoint.async_save: true" in result["findings"][0]["advice"]


def test_measured_sweep_becomes_the_advice():
    tuned = {"kind": "autotune", "time": 1.0, "step": 9, "setting": "data.num_workers", "chosen": 2,
             "results": {"0": 100.0, "2": 200.0, "6": 276.0}}
    result = diagnose([*_records(_breakdown(data_wait=0.43, forward_backward=0.57)), tuned])
    assert result["findings"][0]["advice"] == "data.num_workers 2 → 6 measured +38% samples/s"


def test_only_the_newest_attempt_counts():
    old = _records(_breakdown(data_wait=0.9, forward_backward=0.1))
    new = _records(_breakdown(forward_backward=0.9, optimizer=0.1))
    assert diagnose(old + new)["bound"] == "compute"


def test_no_measured_steps_no_diagnosis():
    assert diagnose([{"kind": "run_start", "time": 0.0}]) is None
