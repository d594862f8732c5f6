"""The platform-neutral job: what every platform's request is built from.

A :class:`JobSpec` is made once from the run config and the submit options; each
platform module turns it into its own request. Every platform runs the same command
in the image, ``skylift run CONFIG --resume auto`` plus ``--set`` overrides that point
the checkpoint root and the data at what that platform mounts or syncs, so a
preempted or restarted job resumes from its last checkpoint. A script job
(:mod:`skylift.submit.script`) runs ``skylift launch --checkpoint-root ... -- python
train.py ARGS`` instead: the same platform values, as the flags whose variables the
script reads.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from skylift.config.distributed import ElasticNodes
from skylift.config.submit import SubmitConfig
from skylift.errors import SkyliftConfigError
from skylift.submit.checks import common_problems, parse_store_url, request_problems, require

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = [
    "SHUTDOWN_MARGIN_S",
    "JobSpec",
    "endpoint_for",
    "job_from_inputs",
    "job_spec_from",
    "load_run_and_submit",
    "parse_store_url",
    "parse_submit",
    "with_flags",
]

SHUTDOWN_MARGIN_S = 10.0
"""Seconds left for torchrun to stop its workers after their save window, inside a platform's kill time."""


@dataclass(frozen=True)
class JobSpec:
    """One job to submit. ``run_overrides`` are the user's ``--set`` for ``skylift run``."""

    name: str
    config_path: str
    options: SubmitConfig
    checkpoint_root: str
    data_url: str | None = None
    val_url: str | None = None
    run_overrides: tuple[str, ...] = ()
    attempt: int = 0
    """0 for the first submission, then 1, 2... for each resubmission after a reclaim."""
    grace_s: float | None = None
    """The config's ``preemption.grace_s``; ``None`` lets the platform's window decide."""
    script: tuple[str, ...] = ()
    """A script job's command in the image (``python train.py ARGS``); empty for a config job."""
    run_dir: str | None = None
    """A script job's run folder, given to the script as ``SKYLIFT_RUN_DIR``."""
    nodes: ElasticNodes | None = None
    """The config's ``distributed.nodes`` (an elastic job); ``None``: a fixed node count."""

    @property
    def envs(self) -> dict[str, str]:
        return dict(self.options.envs)

    @property
    def inputs(self) -> dict[str, str]:
        """A script job's ``--input NAME=URL``."""
        return dict(self.options.inputs)

    @property
    def data_urls(self) -> dict[str, str | None]:
        """The data the job reads, by the config field that names it."""
        return {"data.url": self.data_url, "data.val_url": self.val_url}

    def command(self, overrides: dict[str, str] | None = None) -> list[str]:
        """``skylift run`` argv for inside the image; ``overrides`` are the platform's own."""
        # The root is always explicit: resuming depends on it, whatever the image's copy says.
        overrides = {"checkpoint.root": self.checkpoint_root, **(overrides or {})}
        if self.script:
            return self._launch_command(overrides)
        argv = ["skylift", "run", self.config_path, "--resume", "auto"]
        for item in self.run_overrides:
            if item.partition("=")[0].strip() not in overrides:  # the platform's value replaces it
                argv += ["--set", item]
        for key, value in overrides.items():
            argv += ["--set", f"{key}={value}"]
        return argv

    def _launch_command(self, overrides: dict[str, str]) -> list[str]:
        """``skylift launch`` argv of a script job: the platform's checkpoint root and save
        window as launch's flags (a script job mounts no data: the script reads its own)."""
        argv = ["skylift", "launch", "--checkpoint-root", overrides["checkpoint.root"]]
        run_dir = overrides.get("run_dir") or self.run_dir  # the platform's folder that persists wins
        if run_dir:
            argv += ["--run-dir", run_dir]
        grace_s = overrides.get("preemption.grace_s") or (f"{self.grace_s:g}" if self.grace_s is not None else None)
        if grace_s:
            argv += ["--grace-s", grace_s]
        return [*argv, "--", *self.script]

    def grace_overrides(self, kill_after_s: float) -> dict[str, str]:
        """Workers' save window inside a platform that kills ``kill_after_s`` after SIGTERM.

        Ten seconds stay for torchrun to stop; the config's own ``grace_s`` wins.
        """
        if self.grace_s is not None:
            return {}
        return {"preemption.grace_s": f"{max(5.0, kill_after_s - SHUTDOWN_MARGIN_S):g}"}

    def shell_command(self, overrides: dict[str, str] | None = None) -> str:
        return shlex.join(self.command(overrides))

    def resubmitted(self, attempt: int) -> JobSpec:
        """The same job under a new name (platforms keep names unique), same checkpoint root."""
        base = re.sub(r"-r\d+$", "", self.name)
        return replace(self, name=_clip(f"{base}-r{attempt}"), attempt=attempt)


def load_run_and_submit(path: str, overrides: list[str]) -> tuple[RunConfig, SubmitConfig]:
    """The run config and its ``submit`` section, from the YAML and ``--set`` overrides."""
    from skylift.config.load import load_config
    from skylift.recipes.settings import BUILTIN_SETTINGS, builtin_settings

    config = load_config(path, overrides)
    if config.recipe.name in BUILTIN_SETTINGS:  # a recipe of the user's is checked where it is imported
        builtin_settings(config)  # a bad built-in recipe setting fails before any job is sent
    return config, config.submit


def parse_submit(raw: dict[str, Any], source: str) -> SubmitConfig:
    try:
        return SubmitConfig.model_validate(raw)
    except ValidationError as error:
        problems = []
        for item in error.errors():
            dotted = ".".join(["submit", *(str(part) for part in item["loc"])])
            message = str(item["msg"]).removeprefix("Value error, ")
            problems.append(f"{dotted}: {message}" if item["loc"] else message)
        raise SkyliftConfigError(problems, hint=f"Fix {source} or the --set submit.* flags") from None


def with_flags(options: SubmitConfig, **flags: Any) -> SubmitConfig:
    """``options`` with each flag that was given (not ``None``) replacing its field, validated."""
    given = {name: value for name, value in flags.items() if value is not None}
    if "inputs" in given:  # --input adds to (or replaces one of) the config's submit.inputs
        given["inputs"] = {**options.inputs, **given["inputs"]}
    return parse_submit({**options.model_dump(exclude_unset=True), **given}, source="the command line")


def endpoint_for(options: SubmitConfig, platform: str) -> str | None:
    """The endpoint (Kubernetes: kube context) ``submit`` used, for the follow-up calls."""
    from skylift.submit.base import platform_info

    return platform_info(platform).endpoint(options)


def job_from_inputs(config_path: str, overrides: list[str] | tuple[str, ...], flags: dict[str, Any],
                    config_argument: str | None = None, *, platform: str | None = None,
                    command: list[str] | None = None) -> JobSpec:
    """The job ``skylift submit CONFIG --set ... FLAGS`` makes: the config at
    ``config_path`` with ``overrides``, then the flags (``with_flags`` names);
    ``config_argument`` is the path the command inside the image names (default
    ``config_path``). With ``platform``, everything that platform needs is checked at
    once; ``command`` (the argv that was run) then ends the error as the command that
    would pass."""
    config, options = load_run_and_submit(config_path, list(overrides))
    options = with_flags(options, **flags)
    if options.inputs:
        raise SkyliftConfigError(f"--input {next(iter(options.inputs))}: a config job reads its data from data.url "
                                 "and data.val_url, which submit mounts; --input is for a script job",
                                 hint="--set data.url=URL (and data.val_url=URL), or submit a script: "
                                 "skylift submit --platform P --input NAME=URL -- python train.py")
    if platform is not None:
        require(request_problems(platform, options, checkpoint_enabled=config.checkpoint.enabled,
                                 checkpoint_root=config.checkpoint.root, data_urls=_data_urls(config)), command)
    run_overrides = [item for item in overrides if not item.startswith("submit.")]
    return job_spec_from(config, options, config_argument or config_path, run_overrides)


def job_spec_from(config: Any, options: SubmitConfig, config_path: str, run_overrides: list[str],
                  now: datetime | None = None) -> JobSpec:
    """Check what every platform needs and make the job."""
    root = config.checkpoint.root
    require(common_problems(options.image, checkpoint_enabled=config.checkpoint.enabled, checkpoint_root=root,
                            data_urls=_data_urls(config)))
    prefix = options.name or f"skylift-{Path(str(config.run_dir)).name}"
    stamp = (now or datetime.now(timezone.utc)).strftime("%Y%m%d-%H%M%S")
    return JobSpec(
        name=_clip(f"{prefix}-{stamp}"),
        config_path=config_path,
        options=options,
        checkpoint_root=root.rstrip("/"),
        data_url=config.data.url,
        val_url=config.data.val_url,
        run_overrides=tuple(run_overrides),
        grace_s=config.preemption.grace_s,
        nodes=config.distributed.nodes,
    )


def _data_urls(config: Any) -> dict[str, str | None]:
    return {"data.url": config.data.url, "data.val_url": config.data.val_url}


def _clip(name: str) -> str:
    """A name every platform accepts: letters, digits and dashes, at most 63 characters."""
    cleaned = re.sub(r"[^a-zA-Z0-9-]+", "-", name).strip("-").lower()
    if len(cleaned) > 63:
        cleaned = cleaned[:47].rstrip("-") + "-" + cleaned[-15:]
    return cleaned
