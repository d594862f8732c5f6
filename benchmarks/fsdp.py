"""FSDP against DDP: memory per rank, step time and the sharded checkpoint's save, side by side.

Two processes over gloo on this CPU each train a Llama-architecture causal LM built from
its config class (62 M parameters, 238 MiB of fp32 weights; ``--quick``: 3.5 M) with
AdamW, once under ``distributed.strategy: ddp`` and once under ``fsdp``, through
skylift's own :class:`~skylift.train.runtime.Runtime` (the path ``skylift run`` and a
hand-written loop take: ``fully_shard`` per decoder layer then the root, the sharded
checkpoint through DCP). Per rank:

* ``state_bytes``: weights, gradients and optimizer state (after a backward), summed over
  the tensors this rank holds (its local shards under FSDP), and what
  :func:`skylift.machine.memory.training_memory` predicts for them;
* ``tracked_peak_bytes``: the peak of every tensor alive during one step (forward,
  backward, optimizer), as PyTorch's memory tracker sees them
  (``torch.distributed._tools.mem_tracker``; its FSDP flavour under FSDP). DDP's gradient
  buckets, allocated when DDP wraps the model, are outside its view: DDP's real peak is
  that much higher, so the ratio errs in DDP's favour;
* ``peak_rss_bytes``: the process's peak resident memory during the timed steps
  (``VmHWM``, reset first, after glibc's ``malloc_trim`` hands back what was freed), above
  its resident memory before the model was built, under a fixed glibc mmap threshold
  (``MALLOC_MMAP_THRESHOLD_``, see :func:`run_strategy`);
* ``step_s``: median optimizer step of the timed steps (warm-up left out), the slower
  rank's; ``step_cpu_s``: the CPU seconds a rank's threads spent in it (a shared machine's
  other processes lengthen the first, not the second);
* the checkpoint the Runtime saves on its cadence: ``stall_s`` (what the training thread
  paid) and ``write_s`` (the background write and commit), from ``metrics.jsonl``.

Target (issue 25): FSDP's tracked peak <= 0.6x DDP's at 2 ranks.

    python -m benchmarks.fsdp [--quick]    # writes benchmarks/results/fsdp.json

``--device cuda`` answers a GPU question instead (``benchmarks/gpu.sh`` runs it): the
largest model of a Llama-3-8B-shaped family (4096 wide, 32 heads, more or fewer layers)
that one GPU fine-tunes with FSDP and with FSDP + ``cpu_offload``, one process each,
bf16 with activation checkpointing, 2,048 tokens a step; each size in its own process so
an out-of-memory stops only that try. Tokens/s and MFU for the largest that trains.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).parent / "results"
TARGET_PEAK_RATIO = 0.6
WORLD_SIZE = 2
SEED = 0


@dataclass(frozen=True)
class Workload:
    """The model and the steps one run takes: warm-up, one step under the memory tracker,
    the timed steps, then one step whose end saves the checkpoint."""

    llama: dict[str, Any]
    micro_batch: int
    sequence: int
    warmup_steps: int
    timed_steps: int

    @property
    def tracked_step(self) -> int:
        return self.warmup_steps + 1

    @property
    def save_step(self) -> int:
        """After the timed steps, so no timed step pays for the save or the tracker."""
        return self.tracked_step + self.timed_steps + 1


FULL = Workload(llama={"vocab_size": 16000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 6,
                       "num_attention_heads": 12, "num_key_value_heads": 4, "tie_word_embeddings": False},
                micro_batch=2, sequence=128, warmup_steps=2, timed_steps=4)  # fmt: skip
QUICK = Workload(llama={"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False},
                 micro_batch=2, sequence=32, warmup_steps=1, timed_steps=2)  # fmt: skip


def build_model(llama: dict[str, Any]) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    return LlamaForCausalLM(LlamaConfig(**llama)).train()


def _status_bytes(name: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{name}:\s+(\d+) kB", text, re.MULTILINE).group(1)) * 1024


def _local_bytes(tensors: Any) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


def _state_bytes(model: Any, optimizer: Any) -> dict[str, int]:
    parameters = list(model.parameters())
    moments = [value for state in optimizer.state.values() for value in state.values() if value.dim() > 0]
    return {"parameters": _local_bytes(parameters), "gradients": _local_bytes(p.grad for p in parameters
                                                                             if p.grad is not None),
            "optimizer": _local_bytes(moments)}  # fmt: skip


def _tracker(strategy: str, model: Any, optimizer: Any) -> Any:
    if strategy == "fsdp":
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        return FSDPMemTracker(model, optimizer)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    return tracker


def _predicted_state_bytes(llama: dict[str, Any], strategy: str) -> int:
    from skylift.config.load import load_config
    from skylift.machine.memory import ModelMemory, Sharding, training_memory

    model = build_model(llama)
    memory = ModelMemory.of(model, load_config(None, []).optim)
    sharding = Sharding(shard_count=WORLD_SIZE) if strategy == "fsdp" else None
    breakdown = training_memory(memory, 0, half_precision=False, world_size=WORLD_SIZE, sharding=sharding)
    return breakdown.parameter_bytes + breakdown.gradient_bytes + breakdown.optimizer_state_bytes


def _overrides(strategy: str, folder: Path, workload: Workload) -> list[str]:
    return [f"run_dir={folder}", f"checkpoint.root={folder / 'checkpoints'}", "device=cpu", "precision=fp32",
            f"distributed.strategy={strategy}", f"checkpoint.every_steps={workload.save_step}",
            "checkpoint.every_minutes=null", "checkpoint.save_at_end=false", "checkpoint.save_final_model=false",
            "preemption.cloud=off", "monitor.report=false", "monitor.tensorboard=false", "monitor.mfu=false",
            "monitor.progress_bar=off", f"data.global_batch_size={workload.micro_batch * WORLD_SIZE}"]  # fmt: skip


def worker(rank: int, port: int, strategy: str, workload: Workload, folder: str) -> None:
    """One rank of one run: the Runtime, the steps, the measurements (to ``rank<R>.json``)."""
    import torch

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD_SIZE))  # one core each, none oversubscribed
    import transformers.models.llama.modeling_llama  # noqa: F401 - its import is not the model's memory

    from skylift.config.load import load_config
    from skylift.train.runtime import Runtime

    runtime = Runtime.from_config(load_config(None, _overrides(strategy, Path(folder), workload)))
    baseline_rss = _status_bytes("VmRSS")
    model = build_model(workload.llama)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = runtime.prepare(model, optimizer)
    runtime.resume()
    generator = torch.Generator().manual_seed(SEED + rank)
    shape = (workload.micro_batch, workload.sequence)
    report: dict[str, Any] = {"rank": rank, "step_s": []}

    def train_step(step: int) -> None:
        ids = torch.randint(0, workload.llama["vocab_size"], shape, generator=generator)
        with runtime.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        runtime.backward(loss)
        if step == workload.tracked_step:
            report["state_bytes"] = _state_bytes(model, optimizer)
        runtime.optimizer_step()
        runtime.step_end(step, samples=workload.micro_batch * WORLD_SIZE)

    for step in range(1, workload.tracked_step):
        train_step(step)
    tracker = _tracker(strategy, model, optimizer)
    with tracker:
        train_step(workload.tracked_step)
    report["tracked_peak_bytes"] = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    # glibc keeps freed memory mapped (the unsharded model sharding replaced, the tracked
    # step's buffers): hand it back, so the peak below is what the steps themselves hold.
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # the peak resident set (VmHWM) counts from here
    report["step_cpu_s"] = []
    for step in range(workload.tracked_step + 1, workload.save_step):
        started, started_cpu = time.perf_counter(), time.process_time()
        train_step(step)
        report["step_s"].append(time.perf_counter() - started)
        report["step_cpu_s"].append(time.process_time() - started_cpu)
    report["peak_rss_bytes"] = _status_bytes("VmHWM") - baseline_rss
    train_step(workload.save_step)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(report))
    runtime.close()  # waits for the background write's commit, then ends the process (exit 0)


def run_strategy(strategy: str, workload: Workload) -> dict[str, Any]:
    """Both ranks of one run, then its figures: the worst rank's memory, the slower rank's steps."""
    import torch.multiprocessing as mp

    # glibc raises its mmap threshold as large blocks are freed, then serves the next ones
    # from a heap it does not shrink: FSDP's per-block gather buffers would stay resident
    # after they are freed. A fixed threshold maps and unmaps them, so the resident set
    # follows the tensors (the children read it at start-up).
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    with tempfile.TemporaryDirectory(prefix=f"skylift-fsdp-{strategy}-") as folder:
        started = time.perf_counter()
        mp.start_processes(worker, args=(_free_port(), strategy, workload, folder), nprocs=WORLD_SIZE, join=True,
                           start_method="spawn")  # fmt: skip
        wall_s = time.perf_counter() - started
        ranks = [json.loads(Path(folder, f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]
        saves = [json.loads(line) for line in Path(folder, "metrics.jsonl").read_text().splitlines()
                 if json.loads(line).get("kind") == "checkpoint"]  # fmt: skip
        layout = _manifest_layout(Path(folder, "checkpoints"), workload.save_step)
    steps = [max(per_rank) for per_rank in zip(*(rank["step_s"] for rank in ranks), strict=True)]
    state = max(ranks, key=lambda rank: sum(rank["state_bytes"].values()))["state_bytes"]
    return {
        "state_bytes": state, "state_total_bytes": sum(state.values()),
        "predicted_state_bytes": _predicted_state_bytes(workload.llama, strategy),
        "tracked_peak_bytes": max(rank["tracked_peak_bytes"] for rank in ranks),
        "peak_rss_bytes": max(rank["peak_rss_bytes"] for rank in ranks),
        "step_s": round(statistics.median(steps), 4), "all_step_s": [round(value, 4) for value in steps],
        # CPU seconds of a step (all of a rank's threads, the collectives' included): what
        # the step costs, less the time other processes on this machine took the cores.
        "step_cpu_s": round(statistics.median(cpu for rank in ranks for cpu in rank["step_cpu_s"]), 4),
        "checkpoint": [{"step": save["step"], "committed": save["committed"], "stall_s": round(save["stall_s"], 4),
                        "write_s": round(save["write_s"], 4)} for save in saves],
        "checkpoint_layout": layout, "malloc_mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"],
        "wall_s": round(wall_s, 1),
    }


def _manifest_layout(root: Path, step: int) -> str | None:
    """The committed checkpoint's layout (``sharded`` or ``replicated``), from its manifest."""
    manifest = root / f"step-{step}" / "manifest.json"
    return json.loads(manifest.read_text()).get("layout", "replicated") if manifest.exists() else None


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def compare(workload: Workload) -> dict[str, Any]:
    runs = {}
    for strategy in ("ddp", "fsdp"):
        print(f"{strategy}: 2 processes over gloo ...", flush=True)
        runs[strategy] = run_strategy(strategy, workload)
    ddp, fsdp = runs["ddp"], runs["fsdp"]
    ratios = {
        "state_bytes": round(fsdp["state_total_bytes"] / ddp["state_total_bytes"], 4),
        "tracked_peak_bytes": round(fsdp["tracked_peak_bytes"] / ddp["tracked_peak_bytes"], 4),
        "peak_rss_bytes": round(fsdp["peak_rss_bytes"] / ddp["peak_rss_bytes"], 4),
        "step_s": round(fsdp["step_s"] / ddp["step_s"], 4),
        "step_cpu_s": round(fsdp["step_cpu_s"] / ddp["step_cpu_s"], 4),
    }
    return {"runs": runs, "fsdp_over_ddp": ratios,
            "target": {"tracked_peak_ratio_max": TARGET_PEAK_RATIO,
                       "met": ratios["tracked_peak_bytes"] <= TARGET_PEAK_RATIO}}  # fmt: skip


def print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"FSDP vs DDP, {WORLD_SIZE} CPU processes over gloo, per rank")
    for column in ("strategy", "weights+grads+optimizer MiB", "predicted MiB", "tracked peak MiB", "peak RSS MiB",
                   "step s", "step CPU s", "checkpoint stall s", "checkpoint write s"):  # fmt: skip
        table.add_column(column, justify="left" if column == "strategy" else "right")
    for strategy, run in results["runs"].items():
        save = run["checkpoint"][0] if run["checkpoint"] else None
        table.add_row(strategy, f"{run['state_total_bytes'] / 2**20:.1f}",
                      f"{run['predicted_state_bytes'] / 2**20:.1f}",
                      f"{run['tracked_peak_bytes'] / 2**20:.1f}", f"{run['peak_rss_bytes'] / 2**20:.1f}",
                      f"{run['step_s']:.3f}", f"{run['step_cpu_s']:.3f}", f"{save['stall_s']:.3f}" if save else "-",
                      f"{save['write_s']:.3f}" if save else "-")  # fmt: skip
    ratios = results["fsdp_over_ddp"]
    table.add_row("fsdp / ddp", f"{ratios['state_bytes']:.3f}", "", f"{ratios['tracked_peak_bytes']:.3f}",
                  f"{ratios['peak_rss_bytes']:.3f}", f"{ratios['step_s']:.3f}", f"{ratios['step_cpu_s']:.3f}", "",
                  "")  # fmt: skip
    Console(width=140).print(table)
    met = results["target"]["met"]
    print(f"target: tracked peak FSDP <= {TARGET_PEAK_RATIO}x DDP: {'met' if met else 'NOT met'}")


GPU_LLAMA = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
             "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip
"""Llama 3 8B's shapes; the layer count is what the search varies (32: the 8 B model)."""
GPU_LAYERS = (16, 24, 32, 40, 48, 64)
GPU_SEQUENCE = 2048
GPU_TRY_TIMEOUT_S = 600


def largest_models(on_try: Callable[[dict[str, Any]], None] = lambda found: None) -> dict[str, Any]:
    """For FSDP and FSDP + cpu_offload: the most layers that train (each try its own process).

    ``on_try`` gets the figures so far after each try: gpu.sh caps this section's time, and
    the tries finished before the cap are results too."""
    found: dict[str, Any] = {}
    for offload in (False, True):
        tries = []
        for layers in GPU_LAYERS:
            command = [sys.executable, "-m", "benchmarks.fsdp", "--gpu-try", str(layers)] + (["--offload"] if offload
                                                                                              else [])  # fmt: skip
            print(f"cuda: {layers} layers, cpu_offload={offload} ...", flush=True)
            try:
                done = subprocess.run(command, capture_output=True, text=True, timeout=GPU_TRY_TIMEOUT_S, check=False)
                lines = done.stdout.splitlines() if done.returncode == 0 else []
                line = next((text for text in reversed(lines) if text.startswith("{")), "")  # after it: the summary
                result = json.loads(line) if line.startswith("{") else {"layers": layers, "trained": False,
                                                                       "error": done.stderr[-600:]}  # fmt: skip
            except subprocess.TimeoutExpired:
                result = {"layers": layers, "trained": False, "error": f"timed out after {GPU_TRY_TIMEOUT_S} s"}
            tries.append(result)
            print(json.dumps(result), flush=True)
            trained = [entry for entry in tries if entry["trained"]]
            on_try({**found, "fsdp_cpu_offload" if offload else "fsdp": {
                "largest": trained[-1] if trained else None, "tries": tries, "search_finished": False}})
            if not result["trained"]:
                break
        trained = [entry for entry in tries if entry["trained"]]
        found["fsdp_cpu_offload" if offload else "fsdp"] = {"largest": trained[-1] if trained else None,
                                                             "tries": tries, "search_finished": True}  # fmt: skip
    return found


def gpu_try(layers: int, offload: bool) -> None:
    """One process: the model of ``layers`` layers, 3 steps on cuda (1 warm-up); prints
    tokens/s and MFU as a JSON line, then ends (the Runtime's close exits)."""
    import torch

    from skylift.config.load import load_config
    from skylift.machine.gpus import gpu_spec
    from skylift.train.runtime import Runtime

    folder = Path(tempfile.mkdtemp(prefix="skylift-fsdp-gpu-"))
    overrides = [f"run_dir={folder}", "device=cuda", "precision=bf16", "distributed.strategy=fsdp",
                 f"distributed.fsdp.cpu_offload={str(offload).lower()}", "activation_checkpointing.enabled=true",
                 "checkpoint.enabled=false", "preemption.cloud=off", "monitor.report=false",
                 "monitor.tensorboard=false", "monitor.mfu=false", "monitor.progress_bar=off",
                 "data.global_batch_size=1"]  # fmt: skip
    runtime = Runtime.from_config(load_config(None, overrides))
    with torch.device("cuda"):  # initialised on the GPU: seconds, where the host takes minutes for billions
        model = build_model({**GPU_LLAMA, "num_hidden_layers": layers})
    parameters = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, optimizer = runtime.prepare(model, optimizer)
    ids = torch.randint(0, GPU_LLAMA["vocab_size"], (1, GPU_SEQUENCE), device="cuda")
    times = []
    for step in range(1, 4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        with runtime.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        runtime.backward(loss)
        runtime.optimizer_step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        runtime.step_end(step, samples=1)
    tokens_per_s = GPU_SEQUENCE / statistics.median(times[1:])
    spec = gpu_spec(torch.cuda.get_device_name())
    # 6 FLOPs per parameter per token (forward 2, backward 4), attention's own left out.
    mfu = 6 * parameters * tokens_per_s / spec.peak_flops_per_s("bf16") if spec else None
    result = {"layers": layers, "parameters": parameters, "trained": True, "tokens_per_s": round(tokens_per_s, 1),
              "mfu": None if mfu is None else round(mfu, 4), "step_s": [round(t, 3) for t in times],
              "peak_device_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
              "device": torch.cuda.get_device_name()}  # fmt: skip
    print(json.dumps(result), flush=True)  # read by largest_models
    runtime.close()  # ends the process


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the 3.5 M-parameter model, fewer steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: the largest model one GPU fine-tunes with FSDP, with and without cpu_offload")
    parser.add_argument("--output", type=Path, default=None, help="JSON file (default benchmarks/results/fsdp*.json)")
    parser.add_argument("--gpu-try", type=int, default=None, help=argparse.SUPPRESS)  # one try of --device cuda
    parser.add_argument("--offload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpu_try is not None:
        gpu_try(args.gpu_try, args.offload)
        return 0
    from benchmarks.common import environment

    if args.device == "cuda":
        output = args.output or RESULTS_DIR / "fsdp_cuda.json"
        output.parent.mkdir(parents=True, exist_ok=True)
        results = {"environment": environment(1, ("torch", "transformers")), "sequence": GPU_SEQUENCE,
                   "llama": GPU_LLAMA}  # fmt: skip

        def write_partial(found: dict[str, Any]) -> None:
            output.write_text(json.dumps({**results, "largest": found}, indent=2) + "\n")

        results["largest"] = largest_models(write_partial)
    else:
        workload = QUICK if args.quick else FULL
        parameters = sum(p.numel() for p in build_model(workload.llama).parameters())
        started = time.perf_counter()
        results = {"environment": environment(int(os.environ.get("OMP_NUM_THREADS", "1")), ("torch", "transformers")),
                   "workload": {"llama": workload.llama, "parameters": parameters,
                                "weights_mib": round(parameters * 4 / 2**20, 1), "micro_batch": workload.micro_batch,
                                "sequence": workload.sequence, "warmup_steps": workload.warmup_steps,
                                "timed_steps": workload.timed_steps, "world_size": WORLD_SIZE, "precision": "fp32",
                                "optimizer": "AdamW", "path": "skylift Runtime (distributed.strategy)"},
                   **compare(workload)}  # fmt: skip
        results["wall_s"] = round(time.perf_counter() - started, 1)
        print_table(results)
        output = args.output or RESULTS_DIR / ("fsdp_quick.json" if args.quick else "fsdp.json")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
