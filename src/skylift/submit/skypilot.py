"""SkyPilot: a task YAML launched as a managed job (``sky jobs launch``).

SkyPilot relaunches a managed job after a preemption (``job_recovery``), on the same
or another region, and the new nodes run ``skylift run --resume auto`` again, which
continues from the checkpoint root. SkyPilot sets ``SKYPILOT_NODE_IPS``,
``SKYPILOT_NODE_RANK``, ``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE``.
The ``sky`` command line is the interface (``pip install skypilot``); nothing here
imports SkyPilot, which is a large install.

The job's ``submit.envs`` go in the task's ``secrets:``, set in ``setup`` and ``run`` as
``envs:`` are; SkyPilot holds them as secret values and writes them as ``<redacted>`` in
the copy of the task it stores and shows (the managed jobs table, the dashboard).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from skylift.config.distributed import ElasticNodes
from skylift.config.script_environment import PLATFORM_VARIABLE
from skylift.config.submit import SubmitConfig
from skylift.errors import EXIT_REQUEUE, SkyliftConfigError
from skylift.submit import elastic
from skylift.submit.base import JobRef, JobState, JobStatus, Platform, PlatformError, PlatformTopology, SubmitRequest
from skylift.submit.checks import Problem, request_problems, require
from skylift.submit.environment import integer, optional_integer
from skylift.submit.inputs import Mount, input_notes, input_problems, input_variable, secret_env_problems
from skylift.submit.spec import JobSpec

__all__ = ["build", "logs", "problems", "send", "status", "stop", "task_yaml"]

NAME = "skypilot"
MASTER_PORT = 29500
"""torchrun's default port, used when ``MASTER_PORT`` is unset."""
_STATES: dict[str, JobState] = {
    "PENDING": "pending", "STARTING": "pending", "SUBMITTED": "pending", "RUNNING": "running",
    "RECOVERING": "running", "CANCELLING": "running", "SUCCEEDED": "succeeded", "CANCELLED": "stopped",
    "FAILED": "failed", "FAILED_SETUP": "failed", "FAILED_PRECHECKS": "failed", "FAILED_NO_RESOURCE": "failed",
    "FAILED_CONTROLLER": "failed",
}
# The variable names SkyPilot's task schema accepts under ``envs:``; its ``secrets:`` checks
# none, and a name outside this would break the shell that sets it on each node.
_VARIABLE_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
INPUT_MOUNT = "/mnt/skylift/inputs"
"""A script job's ``--input NAME=URL`` is a ``file_mounts`` bucket mounted at ``<this>/NAME``."""
INPUT_STORES = ("s3", "gs", "r2")
"""Bucket URLs SkyPilot's ``file_mounts`` mount (S3, GCS, Cloudflare R2)."""


def problems(options: SubmitConfig, checkpoint_root: str | None) -> list[Problem]:
    """What SkyPilot needs beyond the common checks (:mod:`skylift.submit.checks`)."""
    found = []
    if options.region and not options.skypilot.infra:
        found.append(Problem("--region", "SkyPilot takes the region inside submit.skypilot.infra, not --region",
                             ("--set", f"submit.skypilot.infra=aws/{options.region}"), drop=("--region",)))
    for name in options.envs:
        if not _VARIABLE_NAME.fullmatch(name):
            found.append(Problem(f"submit.envs.{name}", "a SkyPilot environment variable's name is letters, "
                                 "digits and '_', not starting with a digit: rename the variable",
                                 ("--set", "submit.envs.<NAME>=...")))
    found += input_problems(options.inputs, INPUT_STORES, "SkyPilot", "a file_mounts bucket mount")
    # A literal goes in the task's secrets: (SkyPilot stores and shows it redacted); no Secret to refer to.
    found += secret_env_problems(options.envs, "SkyPilot", "give the value itself: it goes in the task's "
                                 "secrets:, which SkyPilot keeps redacted", literal_secrets_allowed=True)
    return found


def build(job: JobSpec) -> SubmitRequest:
    options = job.options
    require([*request_problems(NAME, options, checkpoint_root=job.checkpoint_root, data_urls=job.data_urls),
             *elastic.problems(job)])
    resources: dict[str, Any] = {
        "image_id": f"docker:{options.image}",
        "use_spot": options.spot,
        "job_recovery": {
            "strategy": "EAGER_NEXT_REGION",
            "max_restarts_on_errors": options.skypilot.max_restarts_on_errors,
            # 143: the job saved and exited after SIGTERM; relaunch it.
            "recover_on_exit_codes": [EXIT_REQUEUE],
        },
    }
    if options.instance_type:
        key = "accelerators" if _is_accelerator(options.instance_type) else "instance_type"
        resources[key] = options.instance_type
    if options.skypilot.infra:
        resources["infra"] = options.skypilot.infra
    if options.skypilot.disk_size_gib:
        resources["disk_size"] = options.skypilot.disk_size_gib
    mounts = [Mount(name, url, f"{INPUT_MOUNT}/{name}") for name, url in job.inputs.items()]
    envs = {} if PLATFORM_VARIABLE in job.envs else {PLATFORM_VARIABLE: NAME}
    envs.update({input_variable(mount.name): mount.path for mount in mounts
                 if input_variable(mount.name) not in job.envs})
    task = {
        "name": job.name,
        "num_nodes": options.instance_count,
        "resources": resources,
        # MOUNT, not the default COPY: a dataset is read as it streams, not copied to every node first.
        **({"file_mounts": {mount.path: {"source": mount.url, "mode": "MOUNT"} for mount in mounts}}
           if mounts else {}),
        "envs": envs,
        # Every submit.envs value is secret, whatever its name.
        **({"secrets": job.envs} if job.envs else {}),
        # The image holds everything; setup only proves it can start skylift.
        "setup": "skylift --version",
        "run": job.shell_command(),
    }
    return SubmitRequest(NAME, "sky jobs launch", "SkyPilot API server (sky jobs)", task,
                         notes=[*elastic.notes(NAME, job), *input_notes(mounts)], secret_envs=job.envs)


def _is_accelerator(name: str) -> bool:
    # "A100:8", "H100": accelerators; "p4d.24xlarge", "n1-standard-8": instance types.
    return ":" in name or not any(mark in name for mark in ".-_")


def task_yaml(request: SubmitRequest) -> str:
    return yaml.safe_dump(request.body, sort_keys=False)


def _sky() -> str:
    executable = shutil.which("sky")
    if executable is None:
        raise SkyliftConfigError(
            "the SkyPilot command line `sky` is not installed",
            hint="Install it with: pip install 'skypilot[aws]'   (or [gcp], [kubernetes]...), then: sky check",
        )
    return executable


def _run(*args: str) -> str:
    done = subprocess.run([_sky(), *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise PlatformError(
            f"SkyPilot: `sky {' '.join(args)}` failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}\n"
            "Check SkyPilot's setup with: sky check"
        )
    return done.stdout


def send(request: SubmitRequest, options: SubmitConfig) -> JobRef:
    with tempfile.TemporaryDirectory(prefix="skylift-sky-") as folder:
        path = Path(folder) / "task.yaml"
        path.write_text(task_yaml(request))
        _run("jobs", "launch", "--yes", "--detach-run", "--name", request.body["name"], str(path))
    return JobRef(NAME, "jobs", request.body["name"])


def status(ref: JobRef, endpoint: str | None = None) -> JobStatus:
    for line in _run("jobs", "queue").splitlines():
        words = line.split()
        if ref.job_id in words:
            known = [word for word in words if word in _STATES]
            if known:
                return JobStatus(ref, _STATES[known[-1]], known[-1])
    return JobStatus(ref, "pending", "not in `sky jobs queue` yet")


def stop(ref: JobRef, endpoint: str | None = None) -> None:
    _run("jobs", "cancel", "--yes", "--name", ref.job_id)


def logs(ref: JobRef, endpoint: str | None = None, max_lines: int = 200) -> list[str]:
    return _run("jobs", "logs", "--no-follow", "--name", ref.job_id).splitlines()[-max_lines:]


def _detect_topology(environ: Mapping[str, str], root: Path) -> PlatformTopology | None:
    """SkyPilot sets ``SKYPILOT_NODE_IPS`` (head first), ``SKYPILOT_NODE_RANK``,
    ``SKYPILOT_NUM_NODES`` and ``SKYPILOT_NUM_GPUS_PER_NODE``; port ``MASTER_PORT`` if set,
    else 29500."""
    if "SKYPILOT_NUM_NODES" not in environ:
        return None
    nnodes = integer(environ, "SKYPILOT_NUM_NODES")
    ips = environ.get("SKYPILOT_NODE_IPS", "").split()
    address = ips[0] if ips and nnodes > 1 else "127.0.0.1"
    port = optional_integer(environ, "MASTER_PORT") or MASTER_PORT
    return PlatformTopology("SkyPilot", "SKYPILOT_* variables", nnodes, integer(environ, "SKYPILOT_NODE_RANK"),
                            address, port if nnodes > 1 else None,
                            optional_integer(environ, "SKYPILOT_NUM_GPUS_PER_NODE") or None)


def _elastic_note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
    return elastic.whole_job(NAME, "a SkyPilot managed job relaunches the whole cluster after a preemption "
                             "(skypilot-org/skypilot#3907): its {count} nodes start again and resume from the "
                             "checkpoint root")(nodes, count, options)


PLATFORM = Platform(
    name=NAME,
    title="SkyPilot",
    module=__name__,
    elastic_note=_elastic_note,
    detect_topology=_detect_topology,
    detect_order=20,  # SKYPILOT_* variables are SkyPilot's alone
    request_format="yaml",
)
