"""FLOPs per sample and MFU of one attempt, from its records, in figures and in words.

The run summary, the report and its text output read the same figures, each derived
from the attempt's own records so a reader can redo the arithmetic:

- FLOPs per training sample: the ``flops`` record's count (fixed-size batches), or
  under a token budget the train records' per-step FLOPs over the samples they took;
- achieved FLOP/s per device: the train records' FLOPs of every step, all ranks
  (``flops_per_step`` x ranks), over the attempt's ``train_time_s`` (``run_end``) and ranks;
- MFU: achieved FLOP/s per device / the device's peak (``run_start``).

Where a figure is unknown it says why, in words: never a bare ``n/a``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from skylift.monitor.attempts import Attempt, split_attempts
from skylift.monitor.schema import read_records

__all__ = ["FlopFigures", "flop_figures", "run_dir_flop_figures"]


@dataclass(frozen=True)
class FlopFigures:
    flops_per_sample: float | None
    """Forward + backward FLOPs per training sample (mean over the attempt's samples)."""
    flops_counted: str
    """How the FLOPs were counted, or why they were not."""
    achieved_flops_per_s: float | None
    """Model FLOP/s per device over the attempt."""
    peak_flops_per_s: float | None
    peak_flops_source: str
    mfu: float | None
    mfu_basis: str
    """What the MFU is over (the whole attempt, or its last logging interval), or why there is none."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def rows(self) -> list[tuple[str, str]]:
        """("FLOPs/sample", ...) and ("MFU", ...), each with its source or its reason."""
        if self.flops_per_sample is None:
            flops = f"not counted: {self.flops_counted}"
        else:
            flops = f"{self.flops_per_sample:.4g} (forward + backward; {self.flops_counted})"
        if self.mfu is None:
            mfu = f"unknown: {self.mfu_basis}"
        else:
            mfu = (f"{100 * self.mfu:.1f} % = {self.achieved_flops_per_s:.4g} FLOP/s achieved / "
                   f"{self.peak_flops_per_s:.4g} peak per device ({self.peak_flops_source}; {self.mfu_basis})")
        return [("FLOPs/sample", flops), ("MFU", mfu)]


def run_dir_flop_figures(run_dir: str | Path) -> FlopFigures | None:
    """The figures of the last attempt recorded in ``run_dir`` (``None`` without records)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return None
    attempts = split_attempts(read_records(path))
    return flop_figures(attempts[-1]) if attempts else None


def flop_figures(attempt: Attempt) -> FlopFigures:
    """FLOPs per sample and MFU of ``attempt`` (see the module docstring for the arithmetic)."""
    start = attempt.start or {}
    peak = start.get("peak_flops_per_s")
    source = start.get("peak_flops_source", "unknown: no run_start record")
    world = int(start.get("world_size", 1))
    counted, per_sample = _counted(attempt, source)
    steps = [r for r in attempt.train if r.get("flops_per_step") is not None]
    flops_record = attempt.last("flops")  # there is one when per_sample was counted
    if per_sample is not None and flops_record is not None and flops_record.get("sequence_flops") and steps:
        per_sample = _token_budget_per_sample(steps, world, fresh=start.get("resumed_from_step") is None)
    achieved, basis = _achieved(attempt, steps, world, peak)
    if per_sample is None:
        basis = f"no FLOP count ({counted})"
    elif peak is None:
        basis = f"no peak FLOP/s for this device ({source})"
    mfu = achieved / peak if achieved is not None and peak else None
    return FlopFigures(per_sample, counted, achieved, peak, source, mfu, basis)


def _counted(attempt: Attempt, peak_source: str) -> tuple[str, float | None]:
    record = attempt.last("flops")
    if record is None:
        why = peak_source if "monitor.mfu" in peak_source else "no flops record in this attempt"
        return f"{why} (monitor.mfu counts them at the first step)", None
    return str(record.get("reason", "")), record.get("flops_per_sample")


def _token_budget_per_sample(steps: list[dict[str, Any]], world: int, *, fresh: bool) -> float | None:
    """Every step's own FLOPs (all ranks) over the samples they took. A resumed attempt's
    first step starts from a count this attempt did not see, so it is left out."""
    counted = steps if fresh else steps[1:]
    before = 0 if fresh else steps[0]["samples_seen"]
    samples = steps[-1]["samples_seen"] - before if counted else 0
    return sum(r["flops_per_step"] * world for r in counted) / samples if samples > 0 else None


def _achieved(attempt: Attempt, steps: list[dict[str, Any]], world: int,
              peak: float | None) -> tuple[float | None, str]:
    """(FLOP/s per device, what it is over)."""
    end = attempt.last("run_end")
    if steps and end is not None and end.get("train_time_s"):
        total = sum(r["flops_per_step"] * world for r in steps)
        over = f"whole attempt: {len(steps)} steps in {end['train_time_s']:.1f} s"
        return total / (end["train_time_s"] * world), over
    last = next((r for r in reversed(attempt.train) if r.get("mfu") is not None), None)
    if last is not None and peak:
        return last["mfu"] * peak, f"last logging interval, up to step {last['step']} (no run_end yet)"
    return None, "no train record carries flops_per_step"
