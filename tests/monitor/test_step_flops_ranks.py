"""Per-step FLOPs (token budgets) across ranks: two real gloo processes whose micro-batches
differ, and rank 0's train records carry the mean over ranks of each step's FLOPs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.gloo_group import join, spawn_ranks

# Each rank's FLOPs of each step: integers, as a FLOP count is.
FLOPS = {0: [3_000_000_007.0, 5_000_000_011.0, 7_000_000_001.0], 1: [1_000_000_003.0, 9_000_000_001.0, 1_000_000_013.0]}
PEAK_FLOPS_PER_S = 1e9


def _worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from skylift.loop.events import TrainState
    from skylift.monitor.metrics import MetricsLogger
    from skylift.run_dir import RunDirectory

    join(rank, world_size, port)
    try:
        run_dir = RunDirectory(Path(folder) / f"rank{rank}")
        run_dir.create()
        metrics = MetricsLogger(run_dir, log_every_steps=2, tensorboard=False, is_writer=rank == 0)
        metrics.count_flops_by_step(PEAK_FLOPS_PER_S, world_size)
        state = TrainState(total_steps=3, steps_per_epoch=3, global_batch_size=8)
        metrics.on_fit_start(state)
        for step, flops in enumerate(FLOPS[rank], start=1):
            metrics.add_flops(flops / 2)  # two micro-batches a step
            metrics.add_flops(flops / 2)
            state.step, state.samples_seen, state.loss = step, 8 * step, torch.tensor(1.0)
            metrics.on_step_end(state)
        metrics.on_fit_end(state)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two spawned processes importing torch: 15 s on the loaded 2-core machine
@pytest.mark.multiprocess
def test_each_step_carries_the_mean_over_ranks_of_its_flops(tmp_path):
    spawn_ranks(_worker, 2, str(tmp_path))
    records = [json.loads(line) for line in (tmp_path / "rank0" / "metrics.jsonl").read_text().splitlines()]
    train = [record for record in records if record["kind"] == "train"]
    # Halves of odd integers and their sums are exact in float64 (all below 2**53): equal exactly.
    assert [r["flops_per_step"] for r in train] == [(a + b) / 2 for a, b in zip(FLOPS[0], FLOPS[1], strict=True)]
    # MFU is over the logging interval (steps 1-2, then 3): one figure per interval; its
    # elapsed time is the loop's, so only its presence and sharing are checked here.
    assert train[0]["mfu"] == train[1]["mfu"] > 0 and train[2]["mfu"] > 0
    assert not (tmp_path / "rank1" / "metrics.jsonl").exists() or not (tmp_path / "rank1" / "metrics.jsonl").read_text()
