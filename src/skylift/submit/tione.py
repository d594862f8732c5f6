"""Tencent Cloud TI-ONE: ``CreateTrainingTask`` (``TrainingMode: DDP``) through the
official ``tencentcloud-sdk-python-tione`` SDK (extra ``tione``).

Data comes from COS through ``DataConfigs`` (mapped under ``/opt/ml/input/data``, by
TI-ONE's own service role); checkpoints go to the COS root itself through skylift's
S3-compatible store, which needs keys inside the container. TI-ONE documents no way a
training container gets them (the request has no role field, and an ``Envs`` value
marked ``IsPrivate`` is still a key sent in the request), and skylift puts no key in a
request, so ``submit.tione.cos_keys_from`` must name the source or submit refuses.

TI-ONE sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes), ``RANK`` and
``GPU_NUM_PER_NODE`` on each node (https://cloud.tencent.com/document/product/851/103087).
No public document says what a reclaimed ``SPOT`` task reports or that TI-ONE restarts
it: ``--watch`` resubmits a task that ended ``FAILED`` with a reclaim in its
``FailureReason``/``Message``, and only follows one that is still (or again) running.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from skylift.cloud.redact import is_secret_name
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
from skylift.submit.spec import JobSpec, parse_store_url

__all__ = ["OBJECT_STORES", "build", "logs", "problems", "send", "status", "stop"]

_DATA_ROOT = "/opt/ml/input/data"
_MAX_DATA_CONFIGS = 10  # CreateTrainingTask's DataConfigs holds at most 10
SECRET_FIX = ("TI-ONE's Envs has no secret reference (IsPrivate only hides a value that the request still "
              "carries): drop it and read the secret inside the task, e.g. from Tencent Cloud SSM (Secrets "
              "Manager) with keys the image supplies as for submit.tione.cos_keys_from")
_RECLAIM_WORDS = re.compile(r"spot|reclaim|preempt|竞价|回收", re.IGNORECASE)
_STATES: dict[str, JobState] = {
    "SUBMITTING": "pending", "STARTING": "pending", "RUNNING": "running", "STOPPING": "running",
    "STOPPED": "stopped", "FAILED": "failed", "SUCCEED": "succeeded", "SUBMIT_FAILED": "failed",
}
_CREDENTIALS_HINT = (
    "Set Tencent Cloud credentials the Tencent Cloud way: TENCENTCLOUD_SECRET_ID and TENCENTCLOUD_SECRET_KEY, "
    "or `tccli configure` (~/.tencentcloud/credentials), or a CVM/TKE role, then retry"
)


NAME = "tione"
OBJECT_STORES = ("cos",)
"""Where TI-ONE reads the data from (and skylift writes the checkpoints to)."""


def problems(options: SubmitConfig, checkpoint_root: str | None) -> list[Problem]:
    """What TI-ONE needs beyond the common checks (:mod:`skylift.submit.checks`)."""
    found = []
    if not options.instance_type and options.tione.charge_type == "POSTPAID_BY_HOUR":
        found.append(Problem("--instance (submit.instance_type)", "a POSTPAID_BY_HOUR TI-ONE task needs a billing "
                             "spec, e.g. TI.GN7.2XLARGE32.POST", ("--instance", "<billing-spec>")))
    if options.tione.charge_type == "PREPAID" and not options.tione.resource_group_id:
        found.append(Problem("submit.tione.resource_group_id", "a PREPAID TI-ONE task runs in a resource group",
                             ("--set", "submit.tione.resource_group_id=<resource-group-id>")))
    if not options.region:
        found.append(Problem("--region (submit.region)", "TI-ONE needs the region the task runs in, e.g. "
                             "ap-guangzhou", ("--region", "<region>")))
    if options.tione.cos_keys_from is None:
        found.append(Problem("submit.tione.cos_keys_from", f"is not set: inside the TI-ONE task skylift writes "
                             f"checkpoints to {checkpoint_root or 'checkpoint.root'} itself, with boto3's credential "
                             "chain, and TI-ONE gives a training container no documented COS keys "
                             "(CreateTrainingTask has no role field); skylift puts none in the request. Give the "
                             "image a source (an AWS config whose credential_process prints temporary keys, or "
                             "AWS_CONFIG_FILE in submit.envs naming a file on a mounted volume), then say so",
                             ("--set", "submit.tione.cos_keys_from=image")))
    found += input_problems(options.inputs, OBJECT_STORES, "TI-ONE", "a COS DataConfigs mapping")
    if len(options.inputs) > _MAX_DATA_CONFIGS:
        found.append(Problem("--input", f"TI-ONE takes at most {_MAX_DATA_CONFIGS} data configs; give fewer inputs "
                             "(one prefix holding several folders is one input)", ()))
    found += secret_env_problems(options.envs, "TI-ONE", SECRET_FIX)
    return found


def build(job: JobSpec) -> SubmitRequest:
    options = job.options
    require([*request_problems("tione", options, checkpoint_root=job.checkpoint_root, data_urls=job.data_urls),
             *elastic.problems(job)])
    checkpoint_uri = job.checkpoint_root
    data_configs, overrides = _data_configs(job)
    envs = {PLATFORM_VARIABLE: NAME, "SKYLIFT_COS_ENDPOINT_URL": f"https://cos.{options.region}.myqcloud.com",
            **{input_variable(mount.name): mount.path for mount in _mounts(job)}, **job.envs}
    _, bucket, key = parse_store_url(checkpoint_uri)
    body: dict[str, Any] = {
        "Name": job.name,
        "ChargeType": options.tione.charge_type,
        "ResourceConfigInfos": [{"Role": "WORKER", "InstanceType": options.instance_type,
                                 "InstanceNum": options.instance_count}],
        "ImageInfo": {"ImageType": options.tione.image_type, "ImageUrl": options.image},
        "StartCmdInfo": {"StartCmd": job.shell_command(overrides)},
        "TrainingMode": "DDP",
        "Output": {"Bucket": bucket, "Region": options.region, "Paths": [f"{key}-output/"]},
        # Every submit.envs value is secret, whatever its name: TI-ONE hides a private one.
        "Envs": [{"Name": name, "Value": value, "IsPrivate": name in job.envs or is_secret_name(name)}
                 for name, value in envs.items()],
        "LogEnable": True,
    }
    if data_configs:
        body["DataConfigs"] = data_configs
    if options.spot:
        body["ResourceSupplyAttribute"] = {"SupplyType": "SPOT"}
    if options.tione.project_id:
        body["TiProjectId"] = options.tione.project_id
    if options.tione.resource_group_id:
        body["ResourceGroupId"] = options.tione.resource_group_id
    target = options.tione.endpoint or f"tione.tencentcloudapi.com {options.region}"
    return SubmitRequest("tione", "CreateTrainingTask", target, body,
                         notes=[*elastic.notes("tione", job), *input_notes(_mounts(job))], secret_envs=job.envs)


def _data_configs(job: JobSpec) -> tuple[list[dict[str, Any]], dict[str, str]]:
    configs, overrides = [], {}
    for channel, field_name, url in (("train", "data.url", job.data_url), ("validation", "data.val_url", job.val_url)):
        if url is None:
            continue
        _, bucket, key = parse_store_url(url)
        configs.append({
            "MappingPath": f"{_DATA_ROOT}/{channel}",
            "DataSourceType": "COS",
            "COSSource": {"Bucket": bucket, "Region": job.options.region, "Paths": [key + "/"]},
        })
        overrides[field_name] = f"{_DATA_ROOT}/{channel}"
    for mount in _mounts(job):  # a script job's --input, mapped by TI-ONE's service role as the data is
        _, bucket, key = parse_store_url(mount.url)
        configs.append({"MappingPath": mount.path, "DataSourceType": "COS",
                        "COSSource": {"Bucket": bucket, "Region": job.options.region, "Paths": [key + "/"]}})
    return configs, overrides


def _mounts(job: JobSpec) -> list[Mount]:
    return [Mount(name, url, f"{_DATA_ROOT}/{name}") for name, url in job.inputs.items()]


def client(region: str | None, endpoint: str | None = None) -> Any:
    tione = import_sdk("tencentcloud.tione.v20211111.tione_client", "tione", "tencentcloud-sdk-python-tione")
    from tencentcloud.common.credential import DefaultCredentialProvider
    from tencentcloud.common.exception.tencent_cloud_sdk_exception import TencentCloudSDKException
    from tencentcloud.common.profile.client_profile import ClientProfile
    from tencentcloud.common.profile.http_profile import HttpProfile

    if not region:
        raise SkyliftConfigError("TI-ONE needs --region, e.g. --region ap-guangzhou")
    try:
        credential = DefaultCredentialProvider().get_credentials()  # env, profile file, role
    except TencentCloudSDKException:
        raise credentials_error("tione", _CREDENTIALS_HINT) from None
    http_profile = HttpProfile()
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        # The constructor, not attributes: it derives the scheme from the protocol once.
        http_profile = HttpProfile(protocol=scheme, endpoint=host) if sep else HttpProfile(endpoint=endpoint)
    client = tione.TioneClient(credential, region, ClientProfile(httpProfile=http_profile))
    return guarded(client, "tione", TencentCloudSDKException)


def _request(name: str, body: dict[str, Any]) -> Any:
    from tencentcloud.tione.v20211111 import models

    request = getattr(models, name)()
    request.from_json_string(json.dumps(body))
    return request


def send(request: SubmitRequest, options: SubmitConfig) -> JobRef:
    answer = client(options.region, options.tione.endpoint).CreateTrainingTask(
        _request("CreateTrainingTaskRequest", request.body))
    return JobRef("tione", options.region or "", answer.Id)


def status(ref: JobRef, endpoint: str | None = None) -> JobStatus:
    detail = client(ref.location, endpoint).DescribeTrainingTask(
        _request("DescribeTrainingTaskRequest", {"Id": ref.job_id})).TrainingTaskDetail
    reason = " ".join(part for part in (detail.FailureReason, detail.Message) if part)
    state = _STATES.get(detail.Status or "", "pending")
    preempted = state == "failed" and bool(_RECLAIM_WORDS.search(reason))
    text = f"{detail.Status}: {reason}" if reason else str(detail.Status)
    return JobStatus(ref, state, text, preempted)


def stop(ref: JobRef, endpoint: str | None = None) -> None:
    client(ref.location, endpoint).StopTrainingTask(_request("StopTrainingTaskRequest", {"Id": ref.job_id}))


def logs(ref: JobRef, endpoint: str | None = None, max_lines: int = 200) -> list[str]:
    end = datetime.now(timezone.utc)
    query = {"Service": "TRAIN", "ServiceId": ref.job_id, "Limit": max_lines,
             "StartTime": (end - timedelta(days=1)).isoformat(timespec="seconds"),
             "EndTime": end.isoformat(timespec="seconds")}
    answer = client(ref.location, endpoint).DescribeLogs(_request("DescribeLogsRequest", query))
    return [f"[{entry.PodName}] {entry.Message}" for entry in answer.Content or []]


def _detect_topology(environ: Mapping[str, str], root: Path) -> PlatformTopology | None:
    """TI-ONE sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE`` (nodes), ``RANK`` (node
    index), ``GPU_NUM_PER_NODE`` and ``NODE_LIST``."""
    marked = environ.get(PLATFORM_VARIABLE) == NAME or "GPU_NUM_PER_NODE" in environ or "NODE_LIST" in environ
    if not has_node_level(environ) or not marked:
        return None
    return node_level(environ, "TI-ONE", "GPU_NUM_PER_NODE")


def _elastic_note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
    return elastic.whole_job(NAME, "TI-ONE fails a DDP task when any instance exits non-zero, so a lost node ends "
                             "the task of {count}; the resubmitted task resumes from the checkpoint")(nodes, count,
                                                                                                     options)


PLATFORM = Platform(
    name=NAME,
    title="Tencent Cloud TI-ONE",
    module=__name__,
    elastic_note=_elastic_note,
    detect_topology=_detect_topology,
    detect_order=70,  # before PAI-DLC: the same variables, with TI-ONE's own beside them
    endpoint=lambda options: options.tione.endpoint,
)
