"""The variables through which a script job learns where it runs.

``skylift launch`` (and ``skylift submit -- python train.py`` on every platform) sets
them; :meth:`skylift.train.runtime.Runtime.from_config` and the framework integrations
(``skylift.integrations``) read them, so one script runs unchanged on a laptop and on
each platform. Unset variables leave the script's own settings alone.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["CHECKPOINT_ROOT_VARIABLE", "PLATFORM_VARIABLE", "RUN_DIR_VARIABLE", "ScriptEnvironment"]

RUN_DIR_VARIABLE = "SKYLIFT_RUN_DIR"
"""The run folder: metrics, report, summary and the final model."""

CHECKPOINT_ROOT_VARIABLE = "SKYLIFT_CHECKPOINT_ROOT"
"""Where checkpoints go: a folder, or s3://, oss://, cos:// (the platform's durable store)."""

PLATFORM_VARIABLE = "SKYLIFT_PLATFORM"
"""The platform that started the job (sagemaker, pai, tione, k8s, skypilot); unset on a laptop."""


@dataclass(frozen=True)
class ScriptEnvironment:
    """What the launcher told this process; ``None`` where it said nothing."""

    run_dir: str | None = None
    checkpoint_root: str | None = None
    platform: str | None = None

    @classmethod
    def read(cls, environ: Mapping[str, str] | None = None) -> ScriptEnvironment:
        environ = os.environ if environ is None else environ
        return cls(
            run_dir=environ.get(RUN_DIR_VARIABLE) or None,
            checkpoint_root=environ.get(CHECKPOINT_ROOT_VARIABLE) or None,
            platform=environ.get(PLATFORM_VARIABLE) or None,
        )

    def as_environment(self) -> dict[str, str]:
        """The variables to set for a child process (only those known)."""
        pairs = {RUN_DIR_VARIABLE: self.run_dir, CHECKPOINT_ROOT_VARIABLE: self.checkpoint_root,
                 PLATFORM_VARIABLE: self.platform}
        return {name: value for name, value in pairs.items() if value}
