"""The variables through which a script job learns where it runs.

``skylift launch`` (and ``skylift submit -- python train.py`` on every platform) sets
them; :meth:`skylift.train.runtime.Runtime.from_config` and the framework integrations
(``skylift.integrations``) read them, so one script runs unchanged on a laptop and on
each platform. Unset variables leave the script's own settings alone.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["CHECKPOINT_ROOT_VARIABLE", "PLATFORM_VARIABLE", "RUN_DIR_VARIABLE", "ScriptEnvironment", "apply_to"]

_LOG = logging.getLogger(__name__)

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


def apply_to(config: RunConfig, environ: Mapping[str, str] | None = None) -> RunConfig:
    """``config`` with the run folder and checkpoint root the launcher set, each change logged.

    The variables win over the config's own values: they name where the platform keeps
    this job's files (a SageMaker job's synced checkpoint folder, a PAI-DLC mount), which
    the config written on a laptop cannot know. ``config`` itself is left as it was.

    Example:
        >>> from skylift.config.load import load_config
        >>> config = apply_to(load_config(None), {"SKYLIFT_CHECKPOINT_ROOT": "s3://bucket/run"})
        >>> config.checkpoint.root
        's3://bucket/run'
    """
    told = ScriptEnvironment.read(environ)
    updated = config.model_copy(deep=True)
    if told.run_dir is not None and Path(told.run_dir) != config.run_dir:
        _LOG.info("run_dir: %s from %s (the config says %s)", told.run_dir, RUN_DIR_VARIABLE, config.run_dir)
        updated.run_dir = Path(told.run_dir)
    if told.checkpoint_root is not None and told.checkpoint_root != config.checkpoint.root:
        _LOG.info("checkpoint.root: %s from %s (the config says %s)", told.checkpoint_root, CHECKPOINT_ROOT_VARIABLE,
                  config.checkpoint.root)
        updated.checkpoint.root = told.checkpoint_root
    return updated
