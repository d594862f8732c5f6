"""Script jobs: ``skylift submit --platform P [--config RUN.yaml] -- python train.py ARGS``.

The image (``skylift dockerfile -- python train.py``) holds the project, so the script
is named by its path in the project, as a config job names its config. Inside the job
``skylift launch`` starts it with the topology the platform announces
(:mod:`skylift.submit.environment`), and passes the platform's checkpoint root, the run
folder and the save window on as ``SKYLIFT_CHECKPOINT_ROOT``, ``SKYLIFT_RUN_DIR`` and
``--grace-s`` (:mod:`skylift.config.script_environment`).

What submit needs comes from ``--config`` (the config the script loads: its
``checkpoint``, ``run_dir``, ``preemption`` and ``submit`` sections), else from the
flags and ``--set`` of those keys. No other config key reaches a script, which takes
its own arguments after ``--``, so submit refuses one rather than drop it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from skylift.errors import SkyliftConfigError
from skylift.submit.checks import request_problems, require
from skylift.submit.spec import JobSpec, job_spec_from, with_flags

__all__ = ["SCRIPT_KEYS", "script_job_from_inputs"]

SCRIPT_KEYS = ("checkpoint.root", "checkpoint.enabled", "run_dir", "preemption.grace_s")
"""The ``--set`` keys a script job reads besides ``submit.*``."""

# A flag whose name ends in a credential's word (--hub_token, --api-key), not one that
# merely holds it (--max_new_tokens, --tokenizer_name).
_SECRET_FLAG = re.compile(r"^--?[\w-]*?(token|secret|password|passwd|credentials?|(private|access|api|secret)[_-]?key)"
                          r"(=|$)", re.IGNORECASE)


def script_job_from_inputs(script: Sequence[str], config_path: str | None, overrides: Sequence[str],
                           flags: dict[str, Any], *, platform: str | None = None,
                           command: Sequence[str] | None = None, check_script: bool = True,
                           project: Path | None = None, now: datetime | None = None) -> JobSpec:
    """The job ``skylift submit FLAGS [--config RUN.yaml] -- SCRIPT ARGS`` makes.

    ``script`` is what followed ``--``; with ``check_script`` it must be a file in
    ``project`` (default: this folder, which the image holds as its working folder).
    With ``platform``, everything that platform needs is checked at once and
    ``command`` (the argv that was run) ends the error as the command that would pass.

    Raises:
        SkyliftConfigError: no script, one outside the project, a secret among its
            arguments, a ``--set`` key no script job reads, or what the platform lacks.
    """
    from skylift.config.load import load_config
    from skylift.launch.launcher import image_script_command

    in_image = image_script_command(list(script), project or Path.cwd(), check_file=check_script)
    _refuse_secrets(in_image)
    _refuse_unread_keys(overrides)
    named = config_path is not None or any(_key(item) == "run_dir" for item in overrides)
    # Without one, the run folder is the script's own choice; the job is named after the script.
    naming = [] if named else [f"run_dir=runs/{_stem(in_image)}"]
    config = load_config(config_path, [*naming, *overrides])
    options = with_flags(config.submit, **flags)
    if platform is not None:
        require(request_problems(platform, options, checkpoint_enabled=config.checkpoint.enabled,
                                 checkpoint_root=config.checkpoint.root, data_urls={}), command)
    job = job_spec_from(config, options, config_path or "", [], now=now)
    return replace(job, data_url=None, val_url=None, script=in_image, run_dir=str(config.run_dir) if named else None)


def _key(override: str) -> str:
    return override.partition("=")[0].strip()


def _stem(in_image: tuple[str, ...]) -> str:
    """``train`` for ``python train.py``, ``sft`` for ``python -m trl.scripts.sft``."""
    if in_image[1] == "-m":
        return in_image[2].rpartition(".")[2]
    return Path(in_image[1]).stem


def _refuse_unread_keys(overrides: Sequence[str]) -> None:
    unread = [key for key in map(_key, overrides) if key not in SCRIPT_KEYS and not key.startswith("submit.")]
    if unread:
        raise SkyliftConfigError(
            [f"--set {key}: a script job does not read it; the script takes its own arguments after --"
             for key in unread],
            hint=f"Give the script its settings after --; --set takes {', '.join(SCRIPT_KEYS)} and submit.*",
        )


def _refuse_secrets(in_image: tuple[str, ...]) -> None:
    """A secret in the command would sit in clear text in the request, the platform's
    console and the job record; an environment variable of ``submit.envs`` is redacted."""
    from skylift.cloud.redact import redact

    flagged = [part.partition("=")[0] for part in in_image if _SECRET_FLAG.match(part)]
    pasted = [f"argument {index}" for index, part in enumerate(in_image) if redact(part) != part]
    if flagged or pasted:
        raise SkyliftConfigError(
            [f"script {what}: looks like a credential, which the request would carry in clear text"
             for what in [*flagged, *pasted]],
            hint="Pass it as an environment variable the script reads (os.environ['HF_TOKEN']): on Kubernetes "
                 "--set submit.envs.HF_TOKEN=secret:NAME/KEY (a Secret's key), on SkyPilot --set "
                 "submit.envs.HF_TOKEN=... (its secrets:); SageMaker, PAI-DLC and TI-ONE carry no secret in a "
                 "request: read it in the job from the cloud's secrets manager",
        )
