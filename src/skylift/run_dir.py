"""The run folder: one place for everything a run writes.

Layout::

    RUN_DIR/
      config.yaml          the resolved configuration, every field written out
      metrics.jsonl        one JSON object a line, each with a "kind" (train, eval, ...)
      tensorboard/         TensorBoard event files
      summary.json         final figures of the last run in this folder
      model.safetensors    the trained weights (checkpoint.save_final_model)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunDirectory"]


@dataclass(frozen=True)
class RunDirectory:
    root: Path

    @property
    def config_path(self) -> Path:
        return self.root / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        return self.root / "tensorboard"

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    @property
    def model_path(self) -> Path:
        return self.root / "model.safetensors"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def write_text_atomic(self, path: Path, text: str) -> None:
        """Write via a temporary file and rename, so readers never see half a file."""
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_text(text)
        os.replace(temporary, path)

    def write_json(self, path: Path, payload: dict[str, Any]) -> None:
        self.write_text_atomic(path, json.dumps(payload, indent=2, sort_keys=True) + "\n")
