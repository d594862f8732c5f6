"""Alibaba Cloud PAI-DLC: ``CreateJob`` (``JobType: PyTorchJob``) through the official
``alibabacloud-pai-dlc20201203`` SDK (extra ``pai``).

The checkpoint root and the data are OSS prefixes mounted into every pod
(``DataSources``), so the job needs no OSS credentials of its own. DLC sets
``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes), ``RANK`` (node index) and
``NPROC_PER_NODE`` on each pod; ``skylift run`` reads them.

A general-compute spot job whose instances are reclaimed ends as ``Failed`` and is not
restarted by DLC (https://www.alibabacloud.com/help/ja/doc-detail/2785448.html):
``skylift submit --watch`` submits it again and it resumes from the OSS checkpoint.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from skylift.config.distributed import ElasticNodes
from skylift.config.script_environment import PLATFORM_VARIABLE
from skylift.config.submit import SubmitConfig
from skylift.errors import SkyliftConfigError
from skylift.submit import elastic
from skylift.submit.base import (
    JobRef,
    JobState,
    JobStatus,
    Platform,
    PlatformTopology,
    SubmitRequest,
    credentials_error,
    guarded,
    import_sdk,
)
from skylift.submit.checks import Problem, request_problems, require
from skylift.submit.environment import has_node_level, node_level
from skylift.submit.inputs import Mount, input_notes, input_problems, input_variable, secret_env_problems
from skylift.submit.spec import JobSpec

__all__ = [
    "CHECKPOINT_MOUNT",
    "DEFAULT_SPOT_DISCOUNT_LIMIT",
    "OBJECT_STORES",
    "build",
    "logs",
    "problems",
    "send",
    "status",
    "stop",
]

CHECKPOINT_MOUNT = "/mnt/skylift/checkpoints"
NAME = "pai"
DATA_MOUNT = "/mnt/skylift/data"
INPUT_MOUNT = "/mnt/skylift/inputs"
"""A script job's ``--input NAME=oss://...`` is mounted read-only at ``<this>/NAME`` (``DataSources``)."""
SECRET_FIX = ("PAI-DLC's Envs has no secret reference: drop it and read the secret inside the job, e.g. from "
              "Alibaba Cloud KMS Secrets Manager with the job's RAM role (CreateJob CredentialConfig)")
DEFAULT_SPOT_DISCOUNT_LIMIT = 0.9
RECLAIM_GRACE_S = 300
"""ECS releases a reclaimed spot instance about five minutes after the notice."""
_RECLAIM_WORDS = re.compile(r"spot|reclaim|preempt|evict|release", re.IGNORECASE)
_STATES: dict[str, JobState] = {
    "Creating": "pending", "Queuing": "pending", "Dequeued": "pending", "EnvPreparing": "pending",
    "Running": "running", "Restarting": "running", "Stopping": "running", "Succeeded": "succeeded",
    "Failed": "failed", "Stopped": "stopped",
}
_CREDENTIALS_HINT = (
    "Set Alibaba Cloud credentials the Alibaba Cloud way: `aliyun configure` (~/.aliyun/config.json) or "
    "ALIBABA_CLOUD_ACCESS_KEY_ID and ALIBABA_CLOUD_ACCESS_KEY_SECRET, then retry"
)


OBJECT_STORES = ("oss",)
"""Where PAI-DLC mounts the checkpoint root and the data from."""


def problems(options: SubmitConfig, checkpoint_root: str | None) -> list[Problem]:
    """What PAI-DLC needs beyond the common checks (:mod:`skylift.submit.checks`)."""
    found = []
    if not options.instance_type:
        found.append(Problem("--instance (submit.instance_type)", "PAI-DLC needs an EcsSpec, e.g. "
                             "ecs.gn7i-c8g1.2xlarge", ("--instance", "<ecs-spec>")))
    if not options.region:
        found.append(Problem("--region (submit.region)", "PAI-DLC needs the region the job runs in, e.g. "
                             "cn-hangzhou", ("--region", "<region>")))
    found += input_problems(options.inputs, OBJECT_STORES, "PAI-DLC", "an OSS DataSources mount")
    found += secret_env_problems(options.envs, "PAI-DLC", SECRET_FIX)
    return found


def build(job: JobSpec) -> SubmitRequest:
    options = job.options
    require([*request_problems("pai", options, checkpoint_root=job.checkpoint_root, data_urls=job.data_urls),
             *elastic.problems(job)])
    checkpoint_uri = job.checkpoint_root
    sources = [{"Uri": checkpoint_uri + "/", "MountPath": CHECKPOINT_MOUNT, "MountAccess": "RW"}]
    overrides = {"checkpoint.root": CHECKPOINT_MOUNT, **job.grace_overrides(RECLAIM_GRACE_S)}
    for channel, field_name, url in (("train", "data.url", job.data_url), ("validation", "data.val_url", job.val_url)):
        if url is not None:
            sources.append({"Uri": url.rstrip("/") + "/", "MountPath": f"{DATA_MOUNT}/{channel}", "MountAccess": "RO"})
            overrides[field_name] = f"{DATA_MOUNT}/{channel}"
    mounts = [Mount(name, url, f"{INPUT_MOUNT}/{name}") for name, url in job.inputs.items()]
    sources += [{"Uri": mount.url.rstrip("/") + "/", "MountPath": mount.path, "MountAccess": "RO"} for mount in mounts]
    spec: dict[str, Any] = {
        "Type": "Worker",
        "Image": options.image,
        "EcsSpec": options.instance_type,
        "PodCount": options.instance_count,
        "UseSpotInstance": options.spot,
    }
    if options.spot:
        spec["SpotSpec"] = _spot_spec(options)
    body: dict[str, Any] = {
        "DisplayName": job.name,
        "JobType": "PyTorchJob",
        "JobSpecs": [spec],
        "UserCommand": job.shell_command(overrides),
        "DataSources": sources,
        "Envs": {PLATFORM_VARIABLE: NAME, **{input_variable(mount.name): mount.path for mount in mounts}, **job.envs},
        "JobMaxRunningTimeMinutes": math.ceil(options.max_runtime_s / 60),
        "Settings": {"TerminationGracePeriodSeconds": RECLAIM_GRACE_S},
    }
    if options.pai.workspace_id:
        body["WorkspaceId"] = options.pai.workspace_id
    if options.pai.resource_id:
        body["ResourceId"] = options.pai.resource_id
    target = options.pai.endpoint or f"pai-dlc {options.region or '(region?)'}"
    return SubmitRequest("pai", "CreateJob", target, body, notes=[*elastic.notes("pai", job), *input_notes(mounts)],
                         secret_envs=job.envs)


def _spot_spec(options: SubmitConfig) -> dict[str, Any]:
    # SpotSpec takes one limit: a share of the on-demand price or a price per minute.
    if options.pai.spot_price_limit_cny_per_minute is not None:
        return {"SpotStrategy": "SpotWithPriceLimit", "SpotPriceLimit": options.pai.spot_price_limit_cny_per_minute}
    discount = options.pai.spot_discount_limit or DEFAULT_SPOT_DISCOUNT_LIMIT
    return {"SpotStrategy": "SpotWithPriceLimit", "SpotDiscountLimit": discount}


def _models() -> Any:
    return import_sdk("alibabacloud_pai_dlc20201203.models", "pai", "alibabacloud-pai-dlc20201203")


def client(region: str | None, endpoint: str | None = None) -> Any:
    sdk = import_sdk("alibabacloud_pai_dlc20201203.client", "pai", "alibabacloud-pai-dlc20201203")
    from alibabacloud_tea_openapi.utils_models import Config

    if not region:
        raise SkyliftConfigError("PAI-DLC needs --region, e.g. --region cn-hangzhou")
    credential = _credential()
    config = Config(credential=credential, region_id=region)
    if endpoint:
        host, scheme = _split_endpoint(endpoint)
        config.endpoint, config.protocol = host, scheme
    from darabonba.exceptions import DaraException, RetryError, UnretryableException

    return guarded(sdk.Client(config), "pai", DaraException, RetryError, UnretryableException)


def _credential() -> Any:
    from alibabacloud_credentials.client import Client as CredentialClient

    try:
        credential = CredentialClient()  # the vendor's default chain: env, config file, RAM role...
        credential.get_credential()
    except Exception as error:  # the chain raises several unrelated types
        raise credentials_error("pai", _CREDENTIALS_HINT) from error
    return credential


def _split_endpoint(endpoint: str) -> tuple[str, str]:
    scheme, sep, host = endpoint.partition("://")
    return (host, scheme) if sep else (endpoint, "https")


def send(request: SubmitRequest, options: SubmitConfig) -> JobRef:
    models = _models()
    dlc = client(options.region, options.pai.endpoint)
    response = dlc.create_job(models.CreateJobRequest().from_map(request.body))
    return JobRef("pai", options.region or "", response.body.job_id)


def status(ref: JobRef, endpoint: str | None = None) -> JobStatus:
    models = _models()
    job = client(ref.location, endpoint).get_job(ref.job_id, models.GetJobRequest()).body
    reason = " ".join(part for part in (job.reason_code, job.reason_message) if part)
    state = _STATES.get(job.status or "", "pending")
    spot = any(spec.use_spot_instance for spec in job.job_specs or [])
    preempted = state == "failed" and spot and bool(_RECLAIM_WORDS.search(reason))
    return JobStatus(ref, state, f"{job.status}: {reason}" if reason else str(job.status), preempted)


def stop(ref: JobRef, endpoint: str | None = None) -> None:
    client(ref.location, endpoint).stop_job(ref.job_id)


def logs(ref: JobRef, endpoint: str | None = None, max_lines: int = 200) -> list[str]:
    models = _models()
    dlc = client(ref.location, endpoint)
    job = dlc.get_job(ref.job_id, models.GetJobRequest()).body
    lines = []
    for pod in job.pods or []:
        answer = dlc.get_pod_logs(ref.job_id, pod.pod_id, models.GetPodLogsRequest(max_lines=max_lines)).body
        lines += [f"[{pod.pod_id}] {line}" for line in answer.logs or []]
    return lines


def _detect_topology(environ: Mapping[str, str], root: Path) -> PlatformTopology | None:
    """DLC sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes), ``RANK`` (node index)
    and ``NPROC_PER_NODE``; so may any launcher that exports node-level ranks, hence last."""
    if not has_node_level(environ) or ("NPROC_PER_NODE" not in environ and environ.get(PLATFORM_VARIABLE) != NAME):
        return None
    return node_level(environ, "PAI-DLC", "NPROC_PER_NODE")


def _elastic_note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
    return elastic.whole_job(NAME, "skylift asks PAI-DLC for a fixed PodCount ({count}) and nothing elastic; a lost "
                             "node ends or restarts the whole job, which resumes from the checkpoint")(nodes, count,
                                                                                                      options)


PLATFORM = Platform(
    name=NAME,
    title="Alibaba Cloud PAI-DLC",
    module=__name__,
    elastic_note=_elastic_note,
    detect_topology=_detect_topology,
    detect_order=80,  # MASTER_ADDR/RANK with NPROC_PER_NODE: the most generic contract
    endpoint=lambda options: options.pai.endpoint,
)
