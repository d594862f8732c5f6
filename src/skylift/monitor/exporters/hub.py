"""The background thread between the metrics logger and the exporters.

Delivery is at least once across restarts: the hub writes how many records of
``metrics.jsonl`` its exporters have taken (``RUN_DIR/exporters.json``,
``exported_records``), and a resumed run first sends the records an attempt killed
before its next export (a SIGKILL leaves them in the file, not in MLflow or W&B).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from pathlib import Path
from typing import Any

from skylift.monitor.exporters import Exporter, RunInfo

__all__ = ["ExportHub"]

log = logging.getLogger("skylift")


class ExportHub:
    """Takes every record the run writes; hands batches to each exporter off the training thread.

    Args:
        exporters: the sinks, opened on the hub's thread.
        run: what they are told about the run.
        max_queued: records held at most; past it the oldest are dropped (and counted).
        interval_s: how often the thread sends what has queued up.
    """

    def __init__(self, exporters: list[Exporter], run: RunInfo, *, max_queued: int = 10_000,
                 interval_s: float = 2.0) -> None:
        from skylift.monitor.schema import read_records

        self.exporters = exporters
        run_dir = Path(str(run.run_dir))
        self._state_path = run_dir / "exporters.json"
        metrics_path = run_dir / "metrics.jsonl"
        earlier = list(read_records(metrics_path)) if metrics_path.exists() else []
        self._exported = min(_state(self._state_path).get("exported_records", 0), len(earlier))
        self._backlog = earlier[self._exported:]
        """Records earlier attempts wrote but did not export (killed between two sends)."""
        self.dropped = 0
        """Records dropped because the queue was full (a sink slower than the run)."""
        self.failures: dict[str, int] = collections.Counter()
        self._run = run
        self._queue: collections.deque[dict[str, Any]] = collections.deque()
        self._max_queued = max_queued
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="skylift-exporters", daemon=True)
        self._thread.start()

    def observe(self, record: dict[str, Any]) -> None:
        """Queue a record (called on the writer's thread: no I/O here)."""
        with self._lock:
            if len(self._queue) >= self._max_queued:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(record)

    def close(self, timeout_s: float = 60.0) -> None:
        """Send what is queued, close every exporter, stop the thread."""
        self._closing = True
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("exporters did not finish within %.0f s; %d records not sent", timeout_s, len(self._queue))

    def _loop(self) -> None:
        opened = [exporter for exporter in self.exporters if self._call(exporter, "open", self._run)]
        batch, self._backlog = self._backlog, []
        while True:
            if batch:
                sent = [self._call(exporter, "export", batch) for exporter in opened]
                self._exported += len(batch)
                if all(sent) and all(getattr(exporter, "durable", True) for exporter in opened):
                    _save_state(self._state_path, exported_records=self._exported)
            if self._closing and not self._queue:
                break
            self._wake.wait(self._interval_s)
            self._wake.clear()
            batch = self._take()
        if self.dropped:
            log.warning("exporters: %d records dropped (the queue of %d was full)", self.dropped, self._max_queued)
        closed = [self._call(exporter, "close") for exporter in opened]  # every one, even after a failure
        if all(closed):
            _save_state(self._state_path, exported_records=self._exported)

    def _take(self) -> list[dict[str, Any]]:
        with self._lock:
            batch = list(self._queue)
            self._queue.clear()
        return batch

    def _call(self, exporter: Exporter, method: str, *args: Any) -> bool:
        try:
            getattr(exporter, method)(*args)
            return True
        except Exception as error:  # noqa: BLE001 - an exporter's failure must not end the training run
            self.failures[exporter.name] += 1
            if self.failures[exporter.name] <= 3:
                log.warning("exporter %s: %s failed: %s: %s", exporter.name, method, type(error).__name__, error)
            return False


def _state(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save_state(path: Path, **values: Any) -> None:
    """Merge ``values`` into the run folder's exporter state (written whole, then renamed)."""
    state = {**_state(path), **values}
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(state, indent=2) + "\n")
    temporary.replace(path)
