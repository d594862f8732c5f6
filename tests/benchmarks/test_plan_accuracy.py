"""The local accuracy table's bookkeeping: which rows re-use a probed point, and medians
with their range, predicted and measured alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.plan_accuracy import TARGET_ERROR, compute_source, load_note, render, row

# What the probe of a 2-thread bench at micro-batch 64 timed (skylift.plan.probe): 32 and 64
# samples on its 2 threads, and 64 samples on 1 thread.
CURVE = {"micro_batch_sizes": [32, 64], "threads": 2, "thread_seconds": {"2": 0.97, "1": 1.85}}


def _bench(samples_per_s: float, *, world_size: int = 1) -> SimpleNamespace:
    return SimpleNamespace(forward_backward_curve=CURVE, threads_per_process=2, micro_batch_size=64,
                           samples_per_s=samples_per_s, world_size=world_size, other_load_share=0.01)  # fmt: skip


@pytest.mark.parametrize(("micro_batch", "threads", "expected"), [
    (64, 2, "probed"), (32, 2, "probed"), (64, 1, "probed"),
    (32, 1, "probed curves"),  # each timed, not together: 1 -> 2 processes at half the batch each
    (128, 2, "extrapolation"), (16, 2, "extrapolation"), (64, 4, "extrapolation"),
])  # fmt: skip
def test_rows_say_whether_the_probe_timed_their_point(micro_batch, threads, expected):
    assert compute_source(_bench(100.0), micro_batch, threads) == expected


def test_a_row_is_medians_of_repeats_with_their_range():
    sources = [_bench(100.0), _bench(120.0), _bench(90.0)]
    measured = [_bench(50.0, world_size=2), _bench(40.0, world_size=2), _bench(60.0, world_size=2)]

    def predict(source):  # a planner that halves what it is given
        return SimpleNamespace(samples_per_s=source.samples_per_s / 2)

    result = row("w", "1 -> 2 processes", sources, predict, measured, target=(32, 1))
    assert result["predicted_samples_per_s"] == {"median": 50.0, "min": 45.0, "max": 60.0, "values": [50.0, 60.0, 45.0]}
    assert result["measured_samples_per_s"]["median"] == 50.0
    assert result["error"] == 0.0 and result["within_target"]
    assert result["error_range"] == [45.0 / 60.0 - 1, 60.0 / 40.0 - 1]
    assert result["compute_source"] == "probed curves + all-reduce and contention extrapolated"
    shown = render([result])
    assert "| w | 1 -> 2 processes | probed curves + all-reduce" in shown and "+0.0% (-25% to +50%)" in shown
    same_processes = [_bench(run.samples_per_s) for run in measured]
    far = row("w", "x", sources, lambda s: SimpleNamespace(samples_per_s=s.samples_per_s), same_processes,
              target=(64, 2))  # fmt: skip
    assert far["error"] == 1.0 > TARGET_ERROR and not far["within_target"] and far["compute_source"] == "probed"
    assert "(miss)" in render([far])


def test_the_load_note_warns_when_others_held_the_cpus():
    quiet = [{"others_cpu_share": {"source": [0.01, 0.0], "measured": [0.05, None]}}]
    assert load_note(quiet) == "other processes took 0%-5% of the CPUs during the benches of this run"
    busy = [{"others_cpu_share": {"source": [0.56], "measured": [0.91]}}]
    assert load_note(busy).startswith("other processes took 56%-91% of the CPUs")
    assert "rerun on a quiet machine" in load_note(busy)


def _predicted(result: dict, rows: list) -> dict[str, float]:
    return {row.row_id: (1 + result[row.row_id]["error"]) * row.samples_per_gpu for row in rows}


def test_leave_one_workload_out_never_fits_on_the_held_out_workload():
    from benchmarks.plan_published import cross_validate
    from skylift.plan.published import load_published

    rows = list(load_published())
    by_workload = cross_validate(rows, "workload")
    workload_of = {row.row_id: row.workload for row in rows}
    assert set(by_workload) == set(workload_of)  # every row, reference ones too
    for row_id, item in by_workload.items():
        assert item["held_out"] == workload_of[row_id] and item["fitted_on"]
        assert not [seen for seen in item["fitted_on"] if workload_of[seen] == workload_of[row_id]]
    # The published figures of the held-out workload change tenfold: its predictions must not move,
    # while the leave-one-GPU-out fit (which does see them) moves, so a leak would show.
    squad = "bert_large_squad_384"
    tampered = [row.model_copy(update={"throughput": 10 * row.throughput}) if row.workload == squad else row
                for row in rows]  # fmt: skip
    kept = [row for row in rows if row.workload == squad]
    tampered_kept = [row for row in tampered if row.workload == squad]
    before, after = _predicted(by_workload, kept), _predicted(cross_validate(tampered, "workload"), tampered_kept)
    assert before == pytest.approx(after, rel=1e-9)
    by_gpu_before = _predicted(cross_validate(rows, "gpu"), kept)
    by_gpu_after = _predicted(cross_validate(tampered, "gpu"), tampered_kept)
    assert by_gpu_after["dle-bertq-2111-a100-80-1x-amp"] > 1.5 * by_gpu_before["dle-bertq-2111-a100-80-1x-amp"]


def test_leave_one_gpu_out_never_fits_on_the_held_out_gpu():
    from benchmarks.plan_published import cross_validate
    from skylift.plan.published import load_published

    rows = list(load_published())
    gpu_of = {row.row_id: row.gpu for row in rows}
    for row_id, item in cross_validate(rows, "gpu").items():
        assert item["held_out"] == gpu_of[row_id]
        assert not [seen for seen in item["fitted_on"] if gpu_of[seen] == gpu_of[row_id]]
