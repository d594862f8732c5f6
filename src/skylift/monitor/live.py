"""``skylift monitor``: a live terminal view of a run, from its ``metrics.jsonl``.

It only reads the file, so it runs on any node that sees the run folder (shared disk,
or a copy), from any process, while the run is going or after. The file may grow, end
in a half-written line (read again once the line is complete), be replaced, or gain a
new attempt when a preempted run resumes.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from skylift.monitor.attempts import AttemptSplitter, usd

__all__ = ["LiveState", "MetricsTail", "render", "watch"]

QUIET_S = 300.0
"""Silence after which the view stops calling a run without ``run_end`` running."""
WINDOW_RECORDS = 50
"""Train records kept for rates, ETA and shares: recent enough to follow changes."""


class MetricsTail:
    """Returns the complete records appended to a metrics file since the last call."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self._identity: tuple[int, int] | None = None

    def read(self) -> tuple[list[dict[str, Any]], bool]:
        """(new records, whether the file was replaced or truncated since the last call)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return [], False
        identity = (stat.st_dev, stat.st_ino)
        restarted = self._identity is not None and (identity != self._identity or stat.st_size < self._offset)
        if restarted or self._identity is None:
            self._offset, self._partial, self._identity = 0, b"", identity
        with self.path.open("rb") as file:
            file.seek(self._offset)
            data = file.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()  # no newline yet: a line still being written
        return [record for line in lines if (record := parse_line(line)) is not None], restarted


def parse_line(line: bytes) -> dict[str, Any] | None:
    """A record, or ``None`` for a blank or damaged line.

    A writer killed mid-line leaves a torn fragment that the next attempt's first record
    is appended to; that record is recovered from the last ``{"kind"`` on the line.
    """
    text = line.decode("utf-8", errors="replace").strip()
    for start in (0, text.rfind('{"kind"')):
        if start < 0 or not text:
            continue
        try:
            record = json.loads(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            return record
    return None


class LiveState:
    """What the view shows, updated record by record (bounded memory on long runs)."""

    def __init__(self) -> None:
        self.splitter = AttemptSplitter()
        self.start: dict[str, Any] | None = None
        self.train: deque[dict[str, Any]] = deque(maxlen=WINDOW_RECORDS)
        self.last_breakdown: dict[str, float] | None = None
        self.latest: dict[str, dict[str, Any]] = {}  # kind -> last record (eval, cost, diagnosis, run_end)
        self.system: dict[int, dict[str, Any]] = {}  # node rank -> last system record
        self.last_commit: dict[str, Any] | None = None
        self.failed_saves = 0
        self.preemptions: list[dict[str, Any]] = []
        self.last_record_time_s: float | None = None
        self.records = 0

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("kind")
        self.records += 1
        if isinstance(record.get("time"), (int, float)):
            self.last_record_time_s = record["time"]
        if self.splitter.starts_attempt(record):
            # A new attempt: rates and per-attempt figures start again; history stays.
            self.train.clear()
            self.start = record if kind == "run_start" else None
            self.latest.pop("run_end", None)
        if kind == "train":
            self.train.append(record)
            self.last_breakdown = record.get("breakdown_s") or self.last_breakdown
        elif kind == "system":
            self.system[record.get("node_rank", 0)] = record
        elif kind == "checkpoint":
            if record.get("committed"):
                self.last_commit = record
            else:
                self.failed_saves += 1
        elif kind == "preemption":
            self.preemptions.append(record)
        elif isinstance(kind, str):
            self.latest[kind] = record

    @property
    def attempt(self) -> int:
        return self.splitter.attempts

    @property
    def total_steps(self) -> int | None:
        return self.start.get("total_steps") if self.start else None

    def steps_per_s(self) -> float | None:
        timed = [r for r in self.train if isinstance(r.get("time"), (int, float))]
        if len(timed) < 2 or timed[-1]["time"] <= timed[0]["time"]:
            return None
        return (timed[-1]["step"] - timed[0]["step"]) / (timed[-1]["time"] - timed[0]["time"])

    def data_wait_share(self) -> float | None:
        step_s = sum(r.get("step_time_s", 0.0) for r in self.train)
        return sum(r.get("data_wait_s", 0.0) for r in self.train) / step_s if step_s > 0 else None


def follow(tail: MetricsTail, state: LiveState) -> LiveState:
    """Feed the new records to ``state``; a replaced file starts a fresh state."""
    records, restarted = tail.read()
    if restarted:
        state = LiveState()
    for record in records:
        state.add(record)
    return state


# -- rendering -----------------------------------------------------------------------


def render(state: LiveState, run_dir: Path, now_s: float | None = None) -> Group:
    """One frame: header, progress, then a panel per figure group."""
    now_s = time.time() if now_s is None else now_s
    panels = [_progress_panel(state, run_dir, now_s), _training_panel(state), _breakdown_panel(state),
              _system_panel(state), _cost_panel(state), _events_panel(state, now_s)]
    diagnosis = state.latest.get("diagnosis")
    if diagnosis is not None:
        panels.append(_diagnosis_panel(diagnosis))
    return Group(*panels)


def _grid(title: str, rows: list[tuple[str, str]]) -> Panel:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", min_width=18)
    table.add_column()
    for name, value in rows:
        table.add_row(Text(name, style="bold"), Text(value))  # Text: a "[...]" in a path or reason is not markup
    return Panel(table, title=title, title_align="left", border_style="blue")


def _progress_panel(state: LiveState, run_dir: Path, now_s: float) -> Panel:
    last = state.train[-1] if state.train else None
    step = last["step"] if last else (state.start or {}).get("step", 0)
    total = state.total_steps
    status = _status(state, now_s)
    rows = [("run", f"{run_dir} · attempt {state.attempt} · {status}")]
    if total:
        done = min(1.0, step / total)
        bar = "█" * int(30 * done) + "░" * (30 - int(30 * done))
        rows.append(("step", f"{step:,} / {total:,}  {bar} {100 * done:.0f} %  ETA {_eta(state, step, total)}"))
    else:
        rows.append(("step", f"{step:,} (total unknown: no run_start record)"))
    if state.last_record_time_s is not None:
        rows.append(("last record", f"{_duration(max(0.0, now_s - state.last_record_time_s))} ago"))
    return _grid("skylift monitor", rows)


def _status(state: LiveState, now_s: float) -> str:
    if state.preemptions and state.train and state.preemptions[-1]["step"] >= state.train[-1]["step"]:
        return "preempted (waiting for a resume)"
    end = state.latest.get("run_end")
    if end is not None:
        return "finished" if not end.get("stopped_early") else f"stopped: {end['stopped_early']}"
    if not state.records:
        return "no records yet"
    quiet_s = now_s - (state.last_record_time_s or now_s)
    # A live run writes at least a system record every few seconds; this long a silence is news.
    return f"no record for {_duration(quiet_s)}: stopped, stalled or killed?" if quiet_s > QUIET_S else "running"


def _eta(state: LiveState, step: int, total: int) -> str:
    if "run_end" in state.latest or step >= total or _status(state, time.time()).startswith("preempted"):
        return "-"
    rate = state.steps_per_s()
    return _duration((total - step) / rate) if rate else "unknown"


def _training_panel(state: LiveState) -> Panel:
    last = state.train[-1] if state.train else {}
    rows = [("loss", f"{last['loss']:.4f}" if "loss" in last else "-")]
    evaluation = state.latest.get("eval")
    if evaluation is not None:
        metrics = {k: v for k, v in evaluation.items() if k not in ("kind", "step", "epoch", "time")}
        shown = ", ".join(f"{k} {100 * v:.2f} %" if k == "accuracy" else f"{k} {v:.4f}" for k, v in metrics.items()
                          if isinstance(v, (int, float)))
        rows.append(("validation", f"{shown} (step {evaluation.get('step', '?')})"))
    rows.append(("samples/s", f"{last['samples_per_s']:,.0f}" if "samples_per_s" in last else "-"))
    if last.get("tokens_per_s") is not None:
        rows.append(("tokens/s", f"{last['tokens_per_s']:,.0f}"))
    rows.append(("MFU", f"{100 * last['mfu']:.1f} %" if last.get("mfu") is not None else "- (peak FLOP/s unknown)"))
    share = state.data_wait_share()
    rows.append(("data wait", f"{100 * share:.1f} % of step time" if share is not None else "-"))
    return _grid("training", rows)


def _breakdown_panel(state: LiveState) -> Panel:
    if state.last_breakdown:
        phases, source = state.last_breakdown, "last sampled step"
    elif state.train:
        wait = sum(r.get("data_wait_s", 0.0) for r in state.train) / len(state.train)
        step = sum(r.get("step_time_s", 0.0) for r in state.train) / len(state.train)
        phases = {"data_wait": wait, "rest of step": max(0.0, step - wait)}
        source = "no breakdown_s: mean of recent steps"
    else:
        return _grid("step time", [("-", "no train records yet")])
    whole = sum(phases.values()) or 1.0
    rows = []
    for name, seconds in phases.items():
        share = seconds / whole
        rows.append((name, f"{'█' * round(24 * share):<24} {1000 * seconds:8.2f} ms  {100 * share:5.1f} %"))
    return _grid(f"step time ({source})", rows)


def _system_panel(state: LiveState) -> Panel:
    if not state.system:
        return _grid("system", [("-", "no system records (the sampler writes one every monitor.system_interval_s)")])
    rows = []
    for node, record in sorted(state.system.items()):
        host = record.get("host", {})
        prefix = f"node {node} " if len(state.system) > 1 else ""
        memory = f"RAM {host.get('memory_used_gib', 0):.1f} / {host.get('memory_total_gib', 0):.1f} GiB"
        rows.append((f"{prefix}CPU", f"{host.get('cpu_percent', 0):.0f} %  {memory}"))
        for gpu in record.get("gpus", []):
            rows.append((f"{prefix}GPU {gpu.get('index')}", _gpu_line(gpu)))
        if not record.get("gpus"):
            rows.append((f"{prefix}GPU", "none on this run"))
    return _grid("system", rows)


def _gpu_line(gpu: dict[str, Any]) -> str:
    parts = []
    if gpu.get("utilization_percent") is not None:
        parts.append(f"{gpu['utilization_percent']:.0f} %")
    if gpu.get("memory_used_gib") is not None:
        parts.append(f"mem {gpu['memory_used_gib']:.1f} / {gpu.get('memory_total_gib') or 0:.1f} GiB")
    if gpu.get("power_w") is not None:
        parts.append(f"{gpu['power_w']:.0f} W")
    if gpu.get("temperature_c") is not None:
        parts.append(f"{gpu['temperature_c']:.0f} °C")
    return "  ".join(parts) or "-"


def _cost_panel(state: LiveState) -> Panel:
    cost = state.latest.get("cost")
    if cost is None:
        return _grid("cost", [("-", "no cost records: set monitor.usd_per_hour")])
    rows = [("spent", f"{usd(cost['usd_spent'])} at {usd(cost['usd_per_hour'])}/h")]
    if cost.get("projected_usd_total") is not None:
        left = cost.get("projected_s_left")
        rows.append(("projected", f"{usd(cost['projected_usd_total'])} in total"
                     + (f", {_duration(left)} left" if left is not None else "")))
    if cost.get("savings_usd") is not None:
        rows.append(("saved vs on-demand", usd(cost["savings_usd"])))
    return _grid("cost", rows)


def _events_panel(state: LiveState, now_s: float) -> Panel:
    commit = state.last_commit
    if commit is None:
        rows = [("last checkpoint", "none committed yet")]
    else:
        age = f", {_duration(max(0.0, now_s - commit['time']))} ago" if "time" in commit else ""
        rows = [("last checkpoint", f"step {commit['step']:,}{age} (stall {1000 * commit.get('stall_s', 0):.0f} ms)")]
    if state.failed_saves:
        rows.append(("failed saves", str(state.failed_saves)))
    for record in state.preemptions[-3:]:
        saved = f"saved step {record['checkpoint_step']}" if record.get("saved") else "not saved"
        rows.append(("preemption", f"at step {record['step']:,}: {record.get('reason', '?')} ({saved})"))
    if not state.preemptions:
        rows.append(("preemptions", "none"))
    return _grid("checkpoints and preemptions", rows)


def _diagnosis_panel(diagnosis: dict[str, Any]) -> Panel:
    from skylift.monitor.report import diagnosis_lines

    return Panel(Text("\n".join(diagnosis_lines(diagnosis, ""))), title="diagnosis", title_align="left",
                 border_style="yellow")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds >= 2 * 86400:
        return f"{seconds // 86400}d"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


# -- the loop ------------------------------------------------------------------------


def watch(run_dir: Path, *, interval_s: float = 2.0, once: bool = False, console: Any = None) -> None:
    """Show the view; ``once`` prints one frame and returns, else refresh until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    console = console or Console()
    tail, state = MetricsTail(run_dir / "metrics.jsonl"), LiveState()
    state = follow(tail, state)
    if once:
        console.print(render(state, run_dir))
        return
    stop = _stop_on_ctrl_c()
    with Live(render(state, run_dir), console=console, refresh_per_second=4, screen=False) as live:
        while not stop.wait(interval_s):
            state = follow(tail, state)
            live.update(render(state, run_dir))


def _stop_on_ctrl_c() -> threading.Event:
    """Ctrl-C sets an event the loop checks between frames. A KeyboardInterrupt raised
    wherever the main thread happens to be could land inside rich while it holds its
    console lock, and the exit would then wait forever for the refresh thread."""
    stop = threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop
