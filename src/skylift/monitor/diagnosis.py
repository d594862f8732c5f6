"""What limits a run, in plain words with numbers, and the change that would help.

Reads the records of the newest attempt in a metrics file: the sampled step-time
breakdowns say where time goes; MFU, the data-loader sweep (``data.num_workers:
auto``), memory and configuration figures from ``run_start`` and ``system`` records
turn that into advice. The same function runs at the end of a run and on demand
(``skylift report``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from skylift.monitor.schema import BREAKDOWN_PHASES

__all__ = ["diagnose", "newest_attempt"]

INPUT_BOUND_SHARE = 0.10
"""Data wait above this share of step time is worth fixing: a faster loader buys it back."""
COMMUNICATION_BOUND_SHARE = 0.15
CHECKPOINT_BOUND_SHARE = 0.05


def newest_attempt(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records from the last ``run_start`` on (all of them when there is none)."""
    starts = [index for index, record in enumerate(records) if record.get("kind") == "run_start"]
    return list(records[starts[-1]:]) if starts else list(records)


def diagnose(records: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """A ``diagnosis`` record for the newest attempt, or ``None`` without measured steps."""
    attempt = newest_attempt(records)
    start = next((r for r in attempt if r.get("kind") == "run_start"), {})
    train = [r for r in attempt if r.get("kind") == "train"]
    sampled = [r["breakdown_s"] for r in train if r.get("breakdown_s")]
    if len(sampled) >= 3:
        sampled = sampled[1:]  # the first measured step still pays for warm-up
    if not sampled:
        return None
    totals = {phase: sum(b.get(phase, 0.0) for b in sampled) for phase in BREAKDOWN_PHASES}
    step_s = sum(totals.values()) or 1e-12
    shares = {phase: round(totals[phase] / step_s, 4) for phase in BREAKDOWN_PHASES}
    groups = _groups(shares)
    bound = _bound(groups)
    context = _Context(attempt, start, train, step_s / len(sampled))
    findings = [
        *_input_findings(groups["input"], shares, context),
        *_compute_findings(groups["compute"], bound, context),
        *_communication_findings(groups["communication"], context),
        *_checkpoint_findings(groups["checkpoint"], context),
        *_memory_findings(context),
    ]
    return {
        "kind": "diagnosis",
        "step": train[-1]["step"] if train else 0,
        "bound": bound,
        "shares": shares,
        "findings": findings,
        "time": time.time(),
    }


class _Context:
    def __init__(self, attempt: list[dict[str, Any]], start: dict[str, Any], train: list[dict[str, Any]],
                 step_s: float) -> None:
        self.start = start
        self.system = [r for r in attempt if r.get("kind") == "system"]
        self.step_s = step_s
        mfus = [r["mfu"] for r in train if r.get("mfu") is not None]
        self.mfu = mfus[-1] if mfus else None
        rates = [r["samples_per_s"] for r in train if r.get("samples_per_s")]
        self.samples_per_s = rates[-1] if rates else None
        self.autotune = next((r for r in reversed(attempt) if r.get("kind") == "autotune"), None)


def _groups(shares: dict[str, float]) -> dict[str, float]:
    return {
        "input": shares["data_wait"] + shares["host_to_device"],
        "compute": shares["forward_backward"] + shares["optimizer"],
        "communication": shares["communication"],
        "checkpoint": shares["checkpoint"],
    }


def _bound(groups: dict[str, float]) -> str:
    over = {
        "input": groups["input"] - INPUT_BOUND_SHARE,
        "communication": groups["communication"] - COMMUNICATION_BOUND_SHARE,
        "checkpoint": groups["checkpoint"] - CHECKPOINT_BOUND_SHARE,
    }
    worst = max(over, key=lambda name: (groups[name] if over[name] > 0 else -1.0))
    return worst if over[worst] > 0 else "compute"


def _percent(share: float) -> str:
    return f"{share * 100:.0f}%"


def _finding(kind: str, severity: str, message: str, advice: str | None) -> dict[str, Any]:
    return {"kind": kind, "severity": severity, "message": message, "advice": advice}


def _input_findings(share: float, shares: dict[str, float], context: _Context) -> list[dict[str, Any]]:
    if share < INPUT_BOUND_SHARE:
        return []
    wait_s = share * context.step_s
    message = f"data wait {_percent(share)} of step time ({wait_s * 1e3:.1f} ms of {context.step_s * 1e3:.1f} ms)"
    if shares["host_to_device"] > shares["data_wait"]:
        return [_finding("input", "warn", message + ", mostly host-to-device copies",
                         "set data.pin_memory: true and keep batches in uint8 until they reach the GPU")]
    return [_finding("input", "warn", message, _loader_advice(context))]


def _loader_advice(context: _Context) -> str:
    sweep = context.autotune
    workers = context.start.get("data_num_workers")
    cpus = context.start.get("cpu_count")
    if sweep and sweep.get("results"):
        results = {int(k): v for k, v in sweep["results"].items()}
        best = max(results, key=lambda workers_tried: results[workers_tried])
        chosen = sweep.get("chosen", workers)
        if best != chosen and chosen in results:
            gain = results[best] / results[chosen] - 1
            return f"data.num_workers {chosen} → {best} measured {gain:+.0%} samples/s"
        return (f"the loader is already at its measured best (num_workers {chosen}); decoding needs more CPU: "
                "store pre-decoded or smaller samples (skylift shard), or pick an instance with more vCPUs per GPU")
    if workers == "auto":  # the tuner had not finished its sweep when the run ended
        return "data.num_workers: auto had not finished measuring when the run ended: run longer, or set a count"
    if workers is not None and cpus and workers < cpus:
        return f"set data.num_workers: auto (now {workers}, {cpus} CPUs) to measure and pick the fastest loader"
    return ("the loader uses every CPU: store pre-decoded or smaller samples, "
            "or pick an instance with more vCPUs per GPU")


def _compute_findings(share: float, bound: str, context: _Context) -> list[dict[str, Any]]:
    if bound != "compute":
        return []
    mfu = f"; MFU {context.mfu * 100:.1f}%" if context.mfu is not None else ""
    message = f"compute-bound: {_percent(share)} of step time in forward, backward and optimizer{mfu}"
    advice = None
    start = context.start
    if start.get("device") == "cpu":
        advice = ("the CPU's arithmetic is the limit: a GPU instance is the change that pays "
                  "(on this CPU, a larger data.global_batch_size raises MFU a little)")
    elif start.get("device") == "cuda" and start.get("precision") in ("fp32", "tf32"):
        advice = "set precision: auto (bf16 or fp16 tensor cores) for up to several times the throughput"
    elif not start.get("compile_enabled", True):
        advice = "try compile.enabled: true (fuses kernels; pays off on GPUs for runs longer than a few minutes)"
    return [_finding("compute", "info", message, advice)]


def _communication_findings(share: float, context: _Context) -> list[dict[str, Any]]:
    if share < COMMUNICATION_BOUND_SHARE:
        return []
    return [_finding(
        "communication", "warn",
        f"gradient communication not hidden by backward: {_percent(share)} of step time",
        "raise accumulation.steps (all-reduce once per several micro-batches) or distributed.bucket_cap_mib, "
        "or use nodes with a faster interconnect",
    )]


def _checkpoint_findings(share: float, context: _Context) -> list[dict[str, Any]]:
    if share < CHECKPOINT_BOUND_SHARE:
        return []
    advice = ("set checkpoint.async_save: true" if context.start.get("checkpoint_async") is False
              else "raise checkpoint.every_steps or checkpoint.every_minutes")
    return [_finding("checkpoint", "warn", f"checkpoint stalls take {_percent(share)} of step time", advice)]


def _memory_findings(context: _Context) -> list[dict[str, Any]]:
    peaks: dict[int, tuple[float, float]] = {}
    for record in context.system:
        for gpu in record.get("gpus", []):
            used, total = gpu.get("memory_used_gib"), gpu.get("memory_total_gib")
            if used is not None and total:
                peaks[gpu["index"]] = (max(used, peaks.get(gpu["index"], (0.0, total))[0]), total)
    if not peaks:
        return _host_memory_findings(context)
    used, total = max(peaks.values(), key=lambda pair: pair[0] / pair[1])
    share = used / total
    if share > 0.95:
        return [_finding("memory", "warn", f"GPU memory peak {used:.1f} of {total:.0f} GiB ({_percent(share)})",
                         "enable activation_checkpointing or lower the micro-batch (raise accumulation.steps)")]
    advice = "room for a larger data.global_batch_size" if share < 0.5 else None
    return [_finding("memory", "info", f"GPU memory peak {used:.1f} of {total:.0f} GiB ({_percent(share)})", advice)]


def _host_memory_findings(context: _Context) -> list[dict[str, Any]]:
    used = [r["host"]["memory_used_gib"] for r in context.system if r.get("host")]
    if not used:
        return []
    total = context.system[-1]["host"]["memory_total_gib"]
    return [_finding("memory", "info", f"no GPU; host memory peak {max(used):.1f} of {total:.0f} GiB", None)]
