"""Reading what a framework run wrote: its metrics records and its losses."""

from __future__ import annotations

import json
from pathlib import Path

from skylift.monitor.schema import validate_record


def records(run_dir: Path, kind: str | None = None) -> list[dict]:
    """Every record of ``RUN_DIR/metrics.jsonl`` (of one ``kind``), each checked against the schema."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    found = []
    for line in lines:
        record = json.loads(line)
        validate_record(record)
        if kind is None or record["kind"] == kind:
            found.append(record)
    return found


def losses_by_step(run_dir: Path) -> dict[int, float]:
    """The last loss written for each step."""
    return {record["step"]: record["loss"] for record in records(run_dir, "train")}
