"""A synthetic run folder with every record kind: two GPUs, prices, a preemption and a resume.

For what a CPU test run cannot write (GPU figures, cost). Every record validates
against :mod:`skylift.monitor.schema`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T0_S = 1_700_000_000.0
STEP_S = 0.5
PREEMPTED_AT = 37
TOTAL_STEPS = 80
DOWNTIME_S = 60.0
USD_PER_HOUR = 7.2


def _run_start(time_s: float, attempt: int, step: int) -> dict[str, Any]:
    return {"kind": "run_start", "time": time_s, "attempt": attempt, "resumed_from_step": step or None, "step": step,
            "total_steps": TOTAL_STEPS, "world_size": 2, "num_nodes": 1, "device": "cuda",
            "device_name": "NVIDIA H100 80GB HBM3", "precision": "bf16", "peak_flops_per_s": 989e12,
            "peak_flops_source": "gpu table", "flops_per_step": 2.4e14, "usd_per_hour": USD_PER_HOUR,
            "on_demand_usd_per_hour": 19.6}


def _train(time_s: float, step: int) -> dict[str, Any]:
    record = {"kind": "train", "time": time_s, "step": step, "epoch": step // 40, "loss": 2.3 / (1 + step / 20),
              "lr": 3e-4, "step_time_s": STEP_S, "data_wait_s": 0.1, "samples_seen": 64 * step,
              "samples_per_s": 128.0 + step % 7, "mfu": 0.41 + 0.01 * (step % 3), "grad_norm": 1.0}
    if step % 5 == 0:
        record["breakdown_s"] = {"data_wait": 0.1, "host_to_device": 0.02, "forward_backward": 0.3,
                                 "communication": 0.05, "optimizer": 0.02, "checkpoint": 0.0, "other": 0.01}
    return record


def _system(time_s: float, step: int, spent_s: float) -> dict[str, Any]:
    gpus = [{"index": i, "name": "NVIDIA H100 80GB HBM3", "utilization_percent": 85.0 + 5 * i - step % 4,
             "memory_used_gib": 41.0 + 3 * i, "memory_total_gib": 79.6, "power_w": 520.0, "temperature_c": 61.0}
            for i in range(2)]
    return {"kind": "system", "time": time_s, "node_rank": 0, "step": step, "gpus": gpus,
            "host": {"cpu_percent": 35.0 + step % 10, "memory_used_gib": 60.0 + spent_s / 100, "memory_total_gib": 251.0}}


def _cost(time_s: float, step: int, spent_usd: float) -> dict[str, Any]:
    left_s = (TOTAL_STEPS - step) * STEP_S
    return {"kind": "cost", "time": time_s, "step": step, "usd_per_hour": USD_PER_HOUR, "usd_spent": spent_usd,
            "usd_per_epoch": 0.04, "projected_usd_total": spent_usd + left_s * USD_PER_HOUR / 3600,
            "projected_s_left": left_s, "on_demand_usd_per_hour": 19.6, "savings_usd": spent_usd * 1.7}


def _attempt(first_step: int, last_step: int, start_s: float, spent_usd: float, out: list[dict]) -> float:
    """Train steps first..last from start_s; returns the dollars spent at the end."""
    for step in range(first_step, last_step + 1):
        now = start_s + (step - first_step + 1) * STEP_S
        spent_usd += STEP_S * USD_PER_HOUR / 3600
        out.append(_train(now, step))
        if step % 5 == 0:
            out.append(_system(now, step, now - T0_S))
        if step % 10 == 0:
            out.append(_cost(now, step, spent_usd))
            out.append({"kind": "checkpoint", "time": now + 0.1, "step": step, "committed": True, "stall_s": 0.03,
                        "write_s": 1.2, "error": None})
        if step % 40 == 0:
            out.append({"kind": "eval", "time": now, "step": step, "epoch": step // 40, "loss": 1.0, "accuracy": 0.9})
    return spent_usd


def synthetic_records() -> list[dict[str, Any]]:
    records = [_run_start(T0_S, 1, 0)]
    spent = _attempt(1, PREEMPTED_AT, T0_S, 0.0, records)
    stop_s = T0_S + PREEMPTED_AT * STEP_S
    records.append({"kind": "checkpoint", "time": stop_s + 2, "step": PREEMPTED_AT, "committed": True,
                    "stall_s": 1.5, "write_s": 1.5, "error": None})
    records.append({"kind": "preemption", "time": stop_s + 2, "step": PREEMPTED_AT, "reason": "aws: spot-termination",
                    "seconds_left_at_notice": 118.0, "saved": True, "checkpoint_step": PREEMPTED_AT,
                    "notice_to_commit_s": 2.1})
    resume_s = stop_s + DOWNTIME_S
    records.append(_run_start(resume_s, 2, PREEMPTED_AT))
    _attempt(PREEMPTED_AT + 1, TOTAL_STEPS, resume_s, spent, records)
    end_s = resume_s + (TOTAL_STEPS - PREEMPTED_AT) * STEP_S
    records.append({"kind": "diagnosis", "time": end_s, "step": TOTAL_STEPS, "bound": "compute",
                    "shares": {"data_wait": 0.2, "forward_backward": 0.6, "communication": 0.1, "other": 0.1},
                    "findings": [{"kind": "input", "severity": "warn", "message": "data wait is 20% of step time",
                                  "advice": "set data.num_workers: 8"}]})
    records.append({"kind": "run_end", "time": end_s, "step": TOTAL_STEPS, "samples_per_s": 130.0,
                    "train_time_s": 21.5, "stopped_early": None})
    return records


def write_run(run_dir: Path, records: list[dict[str, Any]] | None = None) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps(r) + "\n" for r in (records if records is not None else synthetic_records()))
    (run_dir / "metrics.jsonl").write_text(lines)
    return run_dir


def noop_rerun_records() -> list[dict[str, Any]]:
    """:func:`synthetic_records`, then the same command run again after the run finished:
    it resumes at the last step, trains nothing, and its ``run_end`` says 0 samples/s."""
    end_s = synthetic_records()[-1]["time"]
    rerun = {**_run_start(end_s + 600, 3, TOTAL_STEPS), "time": end_s + 600}
    return [*synthetic_records(), rerun, {"kind": "run_end", "time": end_s + 601, "step": TOTAL_STEPS,
                                          "samples_per_s": 0.0, "train_time_s": 0.0, "stopped_early": None}]
