"""``skylift bench``: a short real run of the user's config here, summarised as a :class:`Measurement`.

The run is ``skylift run`` in a child process (so thread settings and peak memory are
the run's own), shaped by overrides: a few warm-up steps plus the measured ones, every
step's time broken down, no periodic checkpoints, and one synchronous checkpoint at the
end whose write time is the measured save time. Two machine figures the planner needs
for CPU targets are measured next to it: memory copy bandwidth, and the bandwidth of a
2-process all-reduce of the model's size.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from skylift.errors import SkyliftConfigError
from skylift.plan.measurement import BENCH_DIR, Measurement, config_fingerprint, measurement_from_run_dir

__all__ = ["BenchRequest", "measure_allreduce_bytes_per_s", "measure_memory_bandwidth_bytes_per_s", "run_bench"]

WARMUP_STEPS = 3
"""Steps run before measuring: allocator warm-up, kernel selection, first-step FLOP count."""


@dataclass(kw_only=True)
class BenchRequest:
    """What to measure."""

    config_path: str
    overrides: list[str] = field(default_factory=list)
    steps: int = 20
    """Measured optimizer steps (warm-up excluded)."""
    nproc: int = 1
    """With N > 1, also run N processes and record the 1 → N scaling efficiency."""
    threads_per_process: int | None = None
    """``OMP_NUM_THREADS`` of each process; ``None``: the CPUs divided by the processes."""
    measure_save: bool = True
    """Write one checkpoint at the end and time it."""
    output_dir: Path = BENCH_DIR


def run_bench(request: BenchRequest) -> tuple[Measurement, Path]:
    """Measure ``request.config_path`` here; returns the measurement and the JSON path it was saved to.

    Raises:
        SkyliftConfigError: the config is invalid, or the bench run failed (its output tail is shown).
    """
    from skylift.config.load import load_config

    if request.steps < 2 or request.nproc < 1:
        raise SkyliftConfigError("--steps must be at least 2 and --nproc at least 1", "try: skylift bench CONFIG")
    resolved = load_config(request.config_path, request.overrides).model_dump(mode="json")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    name = f"{Path(request.config_path).stem}-{stamp}"
    measurement = _measure(request, resolved, request.output_dir / f"{name}-np1", nproc=1)
    if request.nproc > 1:
        scaled = _measure(request, resolved, request.output_dir / f"{name}-np{request.nproc}", nproc=request.nproc)
        measurement.scaling = {
            "nproc": request.nproc,
            "samples_per_s_1": measurement.samples_per_s,
            "samples_per_s_n": scaled.samples_per_s,
            "efficiency": scaled.samples_per_s / (request.nproc * measurement.samples_per_s),
            "measurement_n": scaled.model_dump(mode="json"),
        }
    path = measurement.save(request.output_dir / f"{name}.json")
    return measurement, path


def _measure(request: BenchRequest, resolved: dict, run_dir: Path, *, nproc: int) -> Measurement:
    cpu_count = os.cpu_count() or 1
    threads = request.threads_per_process or max(1, cpu_count // nproc)
    command = [sys.executable, "-m", "skylift", "run", request.config_path, "--no-doctor", "--json"]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    for override in [*request.overrides, *_bench_overrides(request, resolved, run_dir)]:
        command += ["--set", override]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    load_before = _cpu_seconds()
    peak_rss = _run_watching_memory(command, env)
    extra = {
        "threads_per_process": threads,
        "other_load_share": _other_load_share(load_before, _cpu_seconds(), cpu_count),
        "peak_host_memory_bytes": peak_rss,
        "baseline_host_memory_bytes": _baseline_rss(env),
    }
    measurement = measurement_from_run_dir(run_dir, config_path=request.config_path, warmup_steps=WARMUP_STEPS, **extra)
    measurement.config_fingerprint = config_fingerprint(resolved)
    if measurement.device == "cpu":
        measurement.host_memory_bandwidth_bytes_per_s = measure_memory_bandwidth_bytes_per_s()
        if measurement.model_bytes:
            measurement.allreduce_bytes_per_s = measure_allreduce_bytes_per_s(measurement.model_bytes)
    _add_traffic(measurement, resolved)
    if nproc == 1:
        _add_curve(measurement, resolved)
        _add_input_cpu(measurement, resolved)
    return measurement


INPUT_CPU_BUDGET_S = 0.5
"""CPU seconds the input probe times at most (at least one batch timed)."""
INPUT_WARMUP = 3
"""Untimed micro-batches first: in a fresh process the first pass measured 2x the later ones."""
INPUT_BATCHES = 64
"""Micro-batches the input probe times at most; it keeps the best. Measured here on batches
of 4 synthetic 224 px images: 0.075-0.092 ms a sample alone, 0.078-0.098 ms beside 3
spinning processes on the 2 cores (the probe's wall time 4-20x longer)."""


def _add_input_cpu(measurement: Measurement, resolved: dict) -> None:
    """CPU seconds per sample of the job's input pipeline, from the loader at 0 workers in
    this thread at one torch thread, as a loader worker runs it: ``time.thread_time`` counts
    only this thread's CPU, so a busy neighbour does not inflate it the way it inflates the
    run's wall-clock ``data_wait`` (nor do idle OpenMP threads spinning, which
    ``process_time`` would count)."""
    import torch

    from skylift.config.schema import RunConfig
    from skylift.data.loaders import build_loaders
    from skylift.loop.distributed import DistributedContext
    from skylift.recipes import build_recipe

    config = RunConfig.model_validate(resolved)
    config.data.num_workers = 0
    try:
        config = config.with_micro_batch(measurement.micro_batch_size, 1)
        recipe = build_recipe(config)
        one_process = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
        loaders = build_loaders(config, recipe, one_process, pin_memory=False)
        loaders.order.set_epoch(0)
        previous = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            per_sample_s = _time_batches(iter(loaders.train), recipe)
        finally:
            torch.set_num_threads(previous)
    except (ValueError, RuntimeError, OSError) as error:
        measurement.notes.append(f"input pipeline CPU time: not measured ({error})")
        return
    if per_sample_s is None:
        measurement.notes.append(f"input pipeline CPU time: not measured (the epoch has at most {INPUT_WARMUP} "
                                 "micro-batches: raise recipe.num_samples)")  # fmt: skip
        return
    measurement.input_cpu_s_per_sample = per_sample_s


def _time_batches(batches, recipe) -> float | None:
    """CPU seconds of this thread per sample, the best of up to ``INPUT_BATCHES`` batches after
    ``INPUT_WARMUP`` untimed ones; ``None`` when the epoch has none left to time."""
    for _ in range(INPUT_WARMUP):  # opening files, caches, first-call paths: not per sample
        if next(batches, None) is None:
            return None
    per_sample_s: list[float] = []
    for _ in range(INPUT_BATCHES):
        started = time.thread_time()
        batch = next(batches, None)
        if batch is None:
            break
        per_sample_s.append((time.thread_time() - started) / recipe.batch_size(batch))
        if sum(per_sample_s) * recipe.batch_size(batch) >= INPUT_CPU_BUDGET_S:
            break
    # The best batch: contention for caches and cores (and a VM's stolen time, which the
    # guest may book to the running thread) only adds, as in the bandwidth measurement.
    return min(per_sample_s) if per_sample_s else None


def _add_curve(measurement: Measurement, resolved: dict) -> None:
    """Forward/backward at half the micro-batch and at another thread count (:mod:`skylift.plan.probe`)."""
    from skylift.config.schema import RunConfig
    from skylift.plan.probe import probe_forward_backward

    threads = measurement.threads_per_process
    other = 1 if threads > 1 else (2 if measurement.cpu_count >= 2 and measurement.device == "cpu" else None)
    try:
        measurement.forward_backward_curve = probe_forward_backward(
            RunConfig.model_validate(resolved), measurement.micro_batch_size, threads,
            other if measurement.device == "cpu" else None)
    except (ValueError, RuntimeError) as error:
        measurement.notes.append(f"forward/backward curve: not probed ({error})")


def _add_traffic(measurement: Measurement, resolved: dict) -> None:
    """Memory traffic per sample from a meta trace of the job's model at its micro-batch."""
    from skylift.config.schema import RunConfig
    from skylift.machine.gpus import precision_class
    from skylift.plan.traffic import trace_step_traffic

    half = precision_class(measurement.precision) == "half"
    try:
        traffic = trace_step_traffic(RunConfig.model_validate(resolved), measurement.micro_batch_size, half=half)
    except ValueError as error:
        measurement.notes.append(f"memory traffic per sample: not traced ({error})")
        return
    measurement.memory_bytes_per_sample = traffic.bytes_per_sample
    measurement.memory_op_bytes_per_sample = traffic.memory_op_bytes_per_sample
    measurement.traffic_half = half
    measurement.conv_flops_per_sample = traffic.conv_flops_per_sample
    measurement.intensity_bins = list(traffic.intensity_bins)
    measurement.traced_ops_per_micro_step = traffic.ops


def _bench_overrides(request: BenchRequest, resolved: dict, run_dir: Path) -> list[str]:
    total_steps = WARMUP_STEPS + request.steps
    warmup = min(int(resolved["schedule"]["warmup_steps"]), total_steps)
    save = "true" if request.measure_save else "false"
    return [
        f"run_dir={run_dir}",
        f"schedule.max_steps={total_steps}",
        f"schedule.warmup_steps={warmup}",
        f"checkpoint.enabled={save}",
        "checkpoint.every_minutes=null",
        "checkpoint.every_steps=null",
        "checkpoint.async_save=false",  # the write time is then the whole save
        f"checkpoint.save_at_end={save}",
        "checkpoint.resume=never",
        "checkpoint.save_final_model=true",  # its header gives the model's bytes
        "monitor.breakdown_every_steps=1",
        "monitor.report=false",
        "monitor.tensorboard=false",
        "monitor.progress_bar=false",
        "monitor.diagnose=false",
    ]


def _run_watching_memory(command: list[str], env: dict[str, str]) -> int | None:
    """Run ``command``; return the largest resident set of any process in its tree."""
    import psutil

    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        root = psutil.Process(process.pid)
        while not done.wait(0.2):
            try:
                tree = [root, *root.children(recursive=True)]
                peak[0] = max([peak[0], *(member.memory_info().rss for member in tree)])
            except psutil.Error:
                continue

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    output, _ = process.communicate()
    done.set()
    watcher.join(1.0)
    if process.returncode != 0:
        tail = "\n".join(output.splitlines()[-15:])
        raise SkyliftConfigError(f"the bench run failed (exit {process.returncode}):\n{tail}",
                                 f"run it yourself to see why: {' '.join(command[2:])}")  # fmt: skip
    return peak[0] or None


def _cpu_seconds() -> tuple[float, float, float]:
    """(wall s, busy CPU s of the whole machine, CPU s of this process and its waited-for children)."""
    import psutil

    machine = psutil.cpu_times()
    busy_s = sum(getattr(machine, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq", "steal"))
    own = os.times()
    return time.monotonic(), busy_s, own.user + own.system + own.children_user + own.children_system


def _other_load_share(before: tuple[float, float, float], after: tuple[float, float, float], cpus: int) -> float:
    """Share of the machine's CPUs other processes used during the bench run (0: it ran alone)."""
    wall_s = after[0] - before[0]
    others_s = (after[1] - before[1]) - (after[2] - before[2])
    return max(0.0, others_s) / (wall_s * cpus) if wall_s > 0 else 0.0


def _baseline_rss(env: dict[str, str]) -> int | None:
    code = "import resource, torch, skylift.train.trainer; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    return int(result.stdout.strip()) * 1024 if result.returncode == 0 else None  # ru_maxrss is KiB on Linux


def measure_memory_bandwidth_bytes_per_s(size_bytes: int = 1 << 28, repeats: int = 5) -> float:
    """Best copy rate of a ``size_bytes`` buffer (read + write counted), bytes/s."""
    import torch

    source = torch.ones(size_bytes // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch pays for page faults
    best_s = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        best_s = min(best_s, time.perf_counter() - started)
    return 2 * size_bytes / best_s


def measure_allreduce_bytes_per_s(num_bytes: int, repeats: int = 5) -> float | None:
    """Bus bandwidth of a 2-process gloo all-reduce of ``num_bytes`` here, bytes/s.

    Bus bandwidth is the ring's convention: ``2 (n - 1) / n * bytes / seconds``, which for
    two processes is ``bytes / seconds``; the planner divides the same way. The two
    processes start from a fresh interpreter, so any caller (a script on stdin too) works.
    """
    code = f"from skylift.plan.bench import _allreduce_seconds; print(_allreduce_seconds({num_bytes}, {repeats}))"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    try:
        seconds = float(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return None
    return num_bytes / seconds if seconds > 0 else None


def _allreduce_seconds(num_bytes: int, repeats: int) -> float:
    from torch import multiprocessing

    with tempfile.TemporaryDirectory() as folder:
        results = multiprocessing.get_context("spawn").Manager().dict()
        multiprocessing.spawn(_allreduce_worker, args=(folder, num_bytes, repeats, results), nprocs=2, join=True)
        return float(results.get(0, 0.0))


def _allreduce_worker(rank: int, folder: str, num_bytes: int, repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    tensor = torch.ones(max(1, num_bytes // 4))
    dist.all_reduce(tensor)  # connection set-up
    best_s = float("inf")
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        best_s = min(best_s, time.perf_counter() - started)
    results[rank] = best_s
    dist.destroy_process_group()
