"""AWS SageMaker: ``CreateTrainingJob`` through boto3 (extra ``sagemaker``).

The image runs ``skylift run`` as its entrypoint (a bring-your-own container gets no
``SM_*`` variables; ``skylift run`` reads ``resourceconfig.json`` itself). On one
instance checkpoints go to ``/opt/ml/checkpoints``, which SageMaker syncs to
``CheckpointConfig.S3Uri`` and restores there when a managed-spot job restarts after
an interruption; on several, straight to the S3 root (see :func:`_checkpointing`).
Data channels are mounted lazily (``FastFile``) under ``/opt/ml/input/data/<channel>``.
SageMaker stops a job with SIGTERM and SIGKILL 120 s later (``docker stop -t120``).
"""

from __future__ import annotations

import json
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
    import_sdk,
    vendor_errors,
)
from skylift.submit.checks import Problem, request_problems, require
from skylift.submit.environment import optional_integer
from skylift.submit.inputs import Mount, input_notes, input_problems, input_variable, secret_env_problems
from skylift.submit.spec import SHUTDOWN_MARGIN_S, JobSpec, parse_store_url

__all__ = [
    "CHECKPOINT_LOCAL_PATH",
    "MASTER_PORT",
    "OBJECT_STORES",
    "PLATFORM",
    "RESOURCE_CONFIG",
    "STOP_GRACE_S",
    "build",
    "logs",
    "problems",
    "send",
    "status",
    "stop",
]

NAME = "sagemaker"
CHECKPOINT_LOCAL_PATH = "/opt/ml/checkpoints"
MODEL_LOCAL_PATH = "/opt/ml/model"
"""What SageMaker uploads as ``model.tar.gz`` under ``OutputDataConfig.S3OutputPath`` when
the job ends (its documented model directory): the job's run folder."""
STOP_GRACE_S = 120.0
"""``StopTrainingJob`` and spot interruptions: SIGTERM, then SIGKILL this much later
(``docker stop -t120``); the workers save within it, less torchrun's shutdown margin."""
RESOURCE_CONFIG = Path("opt/ml/input/config/resourceconfig.json")
"""Where SageMaker tells each node ``hosts`` and ``current_host`` (under the filesystem root);
a custom image gets no ``SM_*`` variables."""
MASTER_PORT = 7777
"""The port the SageMaker training toolkit uses when ``MASTER_PORT`` is unset."""
_CHANNEL_ROOT = "/opt/ml/input/data"
"""Where SageMaker puts each input channel: ``<root>/<ChannelName>`` (the documented container contract)."""
_MAX_CHANNELS = 20  # InputDataConfig holds 1-20 channels (the service model)
SECRET_FIX = ("SageMaker's Environment has no secret reference: drop it, give the job's IAM role "
              "(submit.sagemaker.role_arn) the access instead, or read the secret inside the job from AWS Secrets "
              "Manager with that role (boto3.client('secretsmanager').get_secret_value)")
_LOG_GROUP = "/aws/sagemaker/TrainingJobs"
_CREDENTIALS_HINT = (
    "Set AWS credentials the AWS way: `aws configure` (or AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
    "AWS_SECRET_ACCESS_KEY), then check them with: aws sts get-caller-identity"
)
_STATES: dict[str, JobState] = {
    "InProgress": "running", "Completed": "succeeded", "Failed": "failed", "Stopping": "running",
    "Stopped": "stopped",
}


OBJECT_STORES = ("s3",)
"""Where SageMaker reads the checkpoint root and the data from."""


def problems(options: SubmitConfig, checkpoint_root: str | None) -> list[Problem]:
    """What SageMaker needs beyond the common checks (:mod:`skylift.submit.checks`)."""
    found = []
    if not options.sagemaker.role_arn:
        found.append(Problem("submit.sagemaker.role_arn", "SageMaker needs the IAM role the job runs as (list "
                             "roles with: aws iam list-roles --query 'Roles[].Arn')",
                             ("--set", "submit.sagemaker.role_arn=arn:aws:iam::<account>:role/<role>")))
    if not options.instance_type:
        found.append(Problem("--instance (submit.instance_type)", "SageMaker needs an instance type, e.g. "
                             "ml.p4d.24xlarge", ("--instance", "<instance-type>")))
    found += input_problems(options.inputs, OBJECT_STORES, "SageMaker", "an S3 input channel")
    if len(options.inputs) > _MAX_CHANNELS - 2:  # train and validation of a config job take two
        found.append(Problem("--input", f"SageMaker takes at most {_MAX_CHANNELS - 2} inputs (20 input channels, "
                             "2 kept for a config job's data); one prefix holding several folders is one input", ()))
    found += secret_env_problems(options.envs, "SageMaker", SECRET_FIX)
    return found


def build(job: JobSpec) -> SubmitRequest:
    options = job.options
    require([*request_problems("sagemaker", options, checkpoint_root=job.checkpoint_root, data_urls=job.data_urls),
             *elastic.problems(job)])
    role_arn = options.sagemaker.role_arn
    checkpoint_uri = job.checkpoint_root
    _, bucket, _ = parse_store_url(checkpoint_uri)
    channels, data_overrides = _channels(job)
    checkpoint_config, checkpoint_overrides = _checkpointing(job, checkpoint_uri)
    # The run folder (metrics, report, final model) where SageMaker uploads it when the job
    # ends: the request's ContainerEntrypoint replaces the image's, which would have set it.
    command = job.command({"run_dir": MODEL_LOCAL_PATH, **checkpoint_overrides, **data_overrides})
    body: dict[str, Any] = {
        "TrainingJobName": job.name,
        "RoleArn": role_arn,
        "AlgorithmSpecification": {
            "TrainingImage": options.image,
            "TrainingInputMode": "FastFile",
            "ContainerEntrypoint": command[:1],
            "ContainerArguments": command[1:],
        },
        "ResourceConfig": {
            "InstanceType": options.instance_type,
            "InstanceCount": options.instance_count,
            "VolumeSizeInGB": options.sagemaker.volume_size_gib,
        },
        "OutputDataConfig": {"S3OutputPath": options.sagemaker.output_path or f"s3://{bucket}/skylift-output/"},
        "StoppingCondition": _stopping_condition(job),
        "EnableManagedSpotTraining": options.spot,
        "Environment": {PLATFORM_VARIABLE: NAME, **_input_variables(job), **job.envs},
        "RetryStrategy": {"MaximumRetryAttempts": options.sagemaker.retry_attempts},
        "Tags": [{"Key": "skylift:attempt", "Value": str(job.attempt)}],
    }
    if checkpoint_config:
        body["CheckpointConfig"] = checkpoint_config
    if channels:
        body["InputDataConfig"] = channels
    target = options.sagemaker.endpoint_url or f"sagemaker {options.region or '(default region)'}"
    notes = [*elastic.notes("sagemaker", job), *input_notes(_mounts(job))]
    return SubmitRequest("sagemaker", "CreateTrainingJob", target, body, notes=notes, secret_envs=job.envs)


def _checkpointing(job: JobSpec, checkpoint_uri: str) -> tuple[dict[str, str] | None, dict[str, str]]:
    """``CheckpointConfig`` and the job's checkpoint overrides.

    One instance: SageMaker's own sync of ``/opt/ml/checkpoints`` to the S3 root,
    restored there when managed spot restarts the job. Several: every rank writes its
    files into one shared ``step-N/`` that rank 0 commits, which per-instance folders
    synced on their own cannot give (and only rank 0 would prune old steps), so the
    ranks write to the S3 root directly, with the job role's credentials.
    """
    if job.options.instance_count > 1:
        return None, {"checkpoint.root": checkpoint_uri}
    synced = {"S3Uri": checkpoint_uri + "/", "LocalPath": CHECKPOINT_LOCAL_PATH}
    return synced, {"checkpoint.root": CHECKPOINT_LOCAL_PATH}


def _stopping_condition(job: JobSpec) -> dict[str, int]:
    runtime_s = job.options.max_runtime_s
    condition = {"MaxRuntimeInSeconds": runtime_s}
    if job.options.spot:
        # Spot: the wait for capacity counts too, so it must cover the runtime.
        condition["MaxWaitTimeInSeconds"] = job.options.max_wait_s or 2 * runtime_s
    return condition


def _channels(job: JobSpec) -> tuple[list[dict[str, Any]], dict[str, str]]:
    channels, overrides = [], {}
    for channel, field_name, url in (("train", "data.url", job.data_url), ("validation", "data.val_url", job.val_url)):
        if url is None:
            continue
        channels.append({
            "ChannelName": channel,
            "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": url, "S3DataDistributionType": "FullyReplicated",
            }},
            "InputMode": "FastFile",
        })
        overrides[field_name] = f"{_CHANNEL_ROOT}/{channel}"
    for mount in _mounts(job):  # a script job's --input: one channel each, read lazily as the data
        channels.append({
            "ChannelName": mount.name,
            "DataSource": {"S3DataSource": {
                "S3DataType": "S3Prefix", "S3Uri": mount.url, "S3DataDistributionType": "FullyReplicated",
            }},
            "InputMode": "FastFile",
        })
    return channels, overrides


def _mounts(job: JobSpec) -> list[Mount]:
    return [Mount(name, url, f"{_CHANNEL_ROOT}/{name}") for name, url in job.inputs.items()]


def _input_variables(job: JobSpec) -> dict[str, str]:
    """``SKYLIFT_INPUT_<NAME>`` and ``SM_CHANNEL_<NAME>`` per input: the training toolkit sets
    the second inside SageMaker's framework images only, so a custom image gets both here."""
    return {variable: mount.path for mount in _mounts(job)
            for variable in (input_variable(mount.name), f"SM_CHANNEL_{mount.name.upper()}")}


def client(region: str | None, endpoint_url: str | None = None) -> Any:
    boto3 = import_sdk("boto3", "sagemaker", "boto3")
    from botocore.exceptions import NoRegionError

    try:
        # A session of its own: the process-wide default one caches the credentials it first found.
        return boto3.session.Session().client("sagemaker", region_name=region, endpoint_url=endpoint_url)
    except NoRegionError:
        raise SkyliftConfigError(
            "no AWS region: give --region (or set AWS_DEFAULT_REGION)", hint="Example: --region us-east-1"
        ) from None


def _call(operation: Any, **kwargs: Any) -> Any:
    from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError

    with vendor_errors("sagemaker", ClientError, BotoCoreError):
        try:
            return operation(**kwargs)
        except (NoCredentialsError, PartialCredentialsError):
            raise credentials_error("sagemaker", _CREDENTIALS_HINT) from None


def send(request: SubmitRequest, options: SubmitConfig) -> JobRef:
    sagemaker = client(options.region, options.sagemaker.endpoint_url)
    _call(sagemaker.create_training_job, **request.body)
    return JobRef("sagemaker", sagemaker.meta.region_name, request.body["TrainingJobName"])


def status(ref: JobRef, endpoint_url: str | None = None) -> JobStatus:
    job = _call(client(ref.location, endpoint_url).describe_training_job, TrainingJobName=ref.job_id)
    detail = f"{job['TrainingJobStatus']} ({job.get('SecondaryStatus', '')})"
    if job.get("FailureReason"):
        detail += f": {job['FailureReason']}"
    return JobStatus(ref, _STATES.get(job["TrainingJobStatus"], "pending"), detail)


def stop(ref: JobRef, endpoint_url: str | None = None) -> None:
    _call(client(ref.location, endpoint_url).stop_training_job, TrainingJobName=ref.job_id)


def logs(ref: JobRef, endpoint_url: str | None = None, max_lines: int = 200) -> list[str]:
    """The last ``max_lines`` lines of each host's CloudWatch stream (``<job>/algo-N-...``).

    ``endpoint_url`` is SageMaker's; CloudWatch Logs takes boto3's own (``AWS_ENDPOINT_URL_CLOUDWATCH_LOGS``).
    """
    boto3 = import_sdk("boto3", "sagemaker", "boto3")
    from botocore.exceptions import BotoCoreError, ClientError

    logs_client = boto3.session.Session().client("logs", region_name=ref.location)
    with vendor_errors("sagemaker", ClientError, BotoCoreError):
        try:
            streams = logs_client.describe_log_streams(logGroupName=_LOG_GROUP, logStreamNamePrefix=ref.job_id + "/")
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") == "ResourceNotFoundException":
                return []  # no training job in this region has logged yet
            raise
    lines = []
    for stream in streams.get("logStreams", []):
        events = _call(logs_client.get_log_events, logGroupName=_LOG_GROUP, logStreamName=stream["logStreamName"],
                       limit=max_lines, startFromHead=False)
        host = stream["logStreamName"].removeprefix(ref.job_id + "/")
        lines += [f"[{host}] {event['message']}" for event in events.get("events", [])]
    return lines


def _detect_topology(environ: Mapping[str, str], root: Path) -> PlatformTopology | None:
    """Rank is the host's index in the sorted ``hosts``, the master ``hosts[0]``; port
    ``MASTER_PORT`` if set, else 7777; one process per visible GPU."""
    path = root / RESOURCE_CONFIG
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
        hosts, current = sorted(config["hosts"]), config["current_host"]
        rank = hosts.index(current)
    except (OSError, ValueError, KeyError) as error:
        raise SkyliftConfigError(
            f"{path} is not a SageMaker resource config with hosts and current_host: {error}") from None
    nnodes = len(hosts)
    port = optional_integer(environ, "MASTER_PORT") or MASTER_PORT
    return PlatformTopology("SageMaker", str(path), nnodes, rank, hosts[0] if nnodes > 1 else "127.0.0.1",
                            port if nnodes > 1 else None, grace_s=STOP_GRACE_S - SHUTDOWN_MARGIN_S)


def _elastic_note(nodes: ElasticNodes, count: int, options: SubmitConfig) -> str:
    return elastic.whole_job(NAME, (
        "a SageMaker training job has a fixed ResourceConfig.InstanceCount, and a managed-spot interruption stops "
        "every instance; SageMaker starts the {count} again and the job resumes from CheckpointConfig (SageMaker "
        "HyperPod's elastic training is another service, not this API)"))(nodes, count, options)


PLATFORM = Platform(
    name=NAME,
    title="AWS SageMaker",
    module=__name__,
    elastic_note=_elastic_note,
    detect_topology=_detect_topology,
    detect_order=90,  # a file, no variable: looked for after every platform's variables
    endpoint=lambda options: options.sagemaker.endpoint_url,
    stop_grace_s=STOP_GRACE_S,
)
