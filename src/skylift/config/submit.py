"""``SubmitConfig``: where and how ``skylift submit`` sends a run.

The ``submit:`` section of the run config (``--set submit.KEY=VALUE`` like any other);
``skylift submit``'s flags override it. It sits with the config, below the platform
modules of :mod:`skylift.submit` that read it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from skylift.cloud.vendors import kubernetes_flavours

__all__ = [
    "KubernetesOptions",
    "PaiOptions",
    "SageMakerOptions",
    "SkyPilotOptions",
    "SubmitConfig",
    "TioneOptions",
]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)  # as every other section (skylift.config.section)


class SageMakerOptions(_Section):
    role_arn: str | None = None
    """IAM role the training job runs as (``arn:aws:iam::<account>:role/<name>``); it
    needs read access to the data and read/write access to the checkpoint bucket."""

    output_path: str | None = None
    """``OutputDataConfig.S3OutputPath``; ``null``: ``s3://<checkpoint bucket>/skylift-output/``."""

    volume_size_gib: int = Field(default=100, ge=1)
    """EBS volume per instance (``ResourceConfig.VolumeSizeInGB``)."""

    retry_attempts: int = Field(default=3, ge=1, le=30)
    """``RetryStrategy.MaximumRetryAttempts``: SageMaker restarts the job after an internal
    error this many times (spot interruptions are resumed by managed spot itself)."""

    endpoint_url: str | None = None
    """SageMaker API endpoint (a VPC endpoint); ``null``: boto3's default for the region."""


class PaiOptions(_Section):
    workspace_id: str | None = None
    """PAI workspace the DLC job belongs to; ``null``: the account's default workspace."""

    resource_id: str | None = None
    """Resource quota ID (``ResourceId``); ``null``: public resources, billed per
    ``EcsSpec``."""

    spot_discount_limit: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Highest spot price as a share of the on-demand price (0.8 = 80 %). Give this or
    ``spot_price_limit_cny_per_minute``, not both; neither: 0.9."""

    spot_price_limit_cny_per_minute: float | None = Field(default=None, gt=0.0)
    """Highest spot price in CNY per minute per instance."""

    endpoint: str | None = None
    """DLC API host (``pai-dlc.<region>.aliyuncs.com``); ``null``: the SDK's endpoint rules."""

    @model_validator(mode="after")
    def _one_spot_limit(self) -> PaiOptions:
        if self.spot_discount_limit is not None and self.spot_price_limit_cny_per_minute is not None:
            raise ValueError(
                "give submit.pai.spot_discount_limit or submit.pai.spot_price_limit_cny_per_minute, not both "
                "(PAI-DLC SpotSpec takes one)"
            )
        return self


class TioneOptions(_Section):
    project_id: str | None = None
    """``TiProjectId`` the task is filed under; ``null``: none."""

    charge_type: Literal["POSTPAID_BY_HOUR", "PREPAID"] = "POSTPAID_BY_HOUR"
    """``POSTPAID_BY_HOUR`` (pay as you go, ``instance_type`` is a billing spec such as
    ``TI.GN7.2XLARGE32.POST``) or ``PREPAID`` (a resource group: ``resource_group_id``)."""

    resource_group_id: str | None = None
    """Resource group of a ``PREPAID`` task."""

    image_type: Literal["CUSTOM", "TCR", "CCR"] = "CUSTOM"
    """``ImageInfo.ImageType`` of ``image``: ``CCR``/``TCR`` for Tencent's registries."""

    cos_keys_from: Literal["image"] | None = None
    """Where ``skylift run`` inside the task gets the keys for the COS checkpoint root
    (it signs with boto3's credential chain). TI-ONE documents none for a training
    container (``CreateTrainingTask`` has no role field) and skylift puts no key in the
    request, so say it: ``image``: the image supplies them (an AWS config whose
    ``credential_process`` prints temporary keys, or ``AWS_CONFIG_FILE`` in
    ``submit.envs`` naming a file on a mounted volume). ``null``: submit refuses."""

    endpoint: str | None = None
    """TI-ONE API host; ``null``: ``tione.tencentcloudapi.com``."""


class KubernetesOptions(_Section):
    namespace: str = "default"
    """Namespace of the job."""

    api: Literal["trainjob", "pytorchjob"] = "trainjob"
    """``trainjob``: Kubeflow Trainer v2 (``trainer.kubeflow.org/v1alpha1``) with a skylift
    ``ClusterTrainingRuntime``; ``pytorchjob``: Training Operator v1 (``kubeflow.org/v1``)."""

    cloud: str = "none"
    """Managed cluster flavour, for spot node selectors, tolerations and the notice
    window: a registered cloud's (``eks``, ``gke``, ``aks``, ``ack``, ``tke``: the
    ``kubernetes`` field of :mod:`skylift.cloud.vendors`); ``none``: no spot scheduling
    constraints."""

    @field_validator("cloud")
    @classmethod
    def _a_registered_flavour(cls, value: str) -> str:
        flavours = kubernetes_flavours()
        if value != "none" and value not in flavours:
            raise ValueError(f"{value!r} is not a managed Kubernetes skylift knows; use one of: "
                             f"{', '.join(sorted(flavours))} or none")
        return value

    runtime_name: str = "skylift-torch"
    """Name of the ``ClusterTrainingRuntime`` skylift creates (or updates) for TrainJobs."""

    max_restarts: int = Field(default=10, ge=0)
    """Restarts of the whole job after a preemption (JobSet ``failurePolicy.maxRestarts``
    or PyTorchJob ``runPolicy.backoffLimit``)."""

    context: str | None = None
    """kube context to send to; ``null``: the current context."""


# SkyPilot 0.14.1's own rule for resources.infra (sky/utils/schemas.py, the resources
# schema): CLOUD[/REGION[/ZONE]], */REGION[/ZONE] or k8s[/CONTEXT]. Checked here so a
# typo fails in --dry-run, not at `sky jobs launch` time.
_SKYPILOT_INFRA = re.compile(
    r"^(?:(?i:(aws|azure|gcp|ibm|lambda|scp|oci|runpod|vast|vsphere|cudo|fluidstack|paperspace|primeintellect|do"
    r"|nebius|ssh|slurm|hyperbolic|seeweb|shadeform|yotta|mithril|verda))(?:/[^/]+(?:/[^/]+)?)?"
    r"|\*(?:/[^/]+(?:/[^/]+)?)?|(?i:kubernetes|k8s)(?:/.+)?)$"
)


class SkyPilotOptions(_Section):
    infra: str | None = None
    """Where SkyPilot may launch: ``aws``, ``gcp/us-central1``, ``k8s/<context>``...;
    ``null``: any enabled cloud."""

    @field_validator("infra")
    @classmethod
    def _infra_as_skypilot_reads_it(cls, value: str | None) -> str | None:
        if value is not None and not _SKYPILOT_INFRA.match(value):
            raise ValueError(f"{value!r} is not a SkyPilot infra: write CLOUD[/REGION[/ZONE]] (aws, gcp, azure, "
                             "lambda, runpod, nebius...), */REGION or k8s[/CONTEXT], e.g. aws/us-east-1")
        return value

    disk_size_gib: int | None = Field(default=None, ge=1)
    """Disk per node; ``null``: SkyPilot's default."""

    max_restarts_on_errors: int = Field(default=0, ge=0)
    """``job_recovery.max_restarts_on_errors``: relaunches after a non-preemption failure."""


class SubmitConfig(_Section):
    image: str | None = None
    """Container image that has skylift and the project (built from ``skylift dockerfile``)."""

    instance_type: str | None = None
    """Machine per node, in the platform's own names: ``ml.p4d.24xlarge`` (SageMaker),
    ``ecs.gn7i-c8g1.2xlarge`` (PAI-DLC), ``TI.GN7.2XLARGE32.POST`` (TI-ONE), a node
    instance type (Kubernetes) or ``A100:8`` / ``p4d.24xlarge`` (SkyPilot)."""

    instance_count: int = Field(default=1, ge=1)
    """Nodes."""

    gpus_per_node: int | None = Field(default=None, ge=0)
    """GPUs (and worker processes) per node; needed by Kubernetes (``nvidia.com/gpu``);
    other platforms tell the job themselves."""

    spot: bool = False
    """Run on spot / preemptible capacity; the job resumes from its last checkpoint."""

    region: str | None = None
    """Cloud region; ``null``: the vendor's configured default."""

    name: str | None = None
    """Job name prefix; ``null``: ``skylift-<run_dir name>``. A UTC time is appended."""

    max_runtime_s: int = Field(default=86_400, ge=60)
    """Longest the job may run (SageMaker ``MaxRuntimeInSeconds``, DLC
    ``JobMaxRunningTimeMinutes``, Kubernetes ``activeDeadlineSeconds``)."""

    max_wait_s: int | None = Field(default=None, ge=60)
    """SageMaker spot: running plus waiting for capacity (``MaxWaitTimeInSeconds``, at
    least ``max_runtime_s``); ``null``: twice ``max_runtime_s``."""

    max_resubmits: int = Field(default=3, ge=0)
    """``skylift submit --watch`` and ``skylift jobs watch``: new jobs submitted after a
    spot reclaim that the platform does not relaunch itself (PAI-DLC general compute,
    TI-ONE), counted across both commands through the job's local record."""

    poll_interval_s: float = Field(default=30.0, gt=0.0)
    """``--watch`` and ``jobs watch``: seconds between status checks."""

    envs: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the job; every value is redacted in every output.
    A secret-looking name (``HF_TOKEN``, ``WANDB_API_KEY``) with a literal value is refused
    where the request would carry it in clear text (SageMaker, PAI-DLC, TI-ONE); on
    Kubernetes ``secret:NAME/KEY`` reads key ``KEY`` of the Secret ``NAME`` instead."""

    inputs: dict[str, str] = Field(default_factory=dict)
    """A script job's data (``--input NAME=URL``): the platform mounts ``URL`` and the job
    reads the folder from ``SKYLIFT_INPUT_<NAME>``. A config job reads ``data.url``."""

    @field_validator("inputs")
    @classmethod
    def _input_names(cls, value: dict[str, str]) -> dict[str, str]:
        # Part of a variable's name, a SageMaker channel name and a folder name.
        for name in value:
            if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,62}", name):
                raise ValueError(f"input name {name!r} must be a letter, then letters, digits or '_' (at most 63), "
                                 "e.g. --input train=s3://bucket/prefix")
        return value

    sagemaker: SageMakerOptions = Field(default_factory=SageMakerOptions)
    """AWS SageMaker ``CreateTrainingJob``."""

    pai: PaiOptions = Field(default_factory=PaiOptions)
    """Alibaba Cloud PAI-DLC ``CreateJob``."""

    tione: TioneOptions = Field(default_factory=TioneOptions)
    """Tencent Cloud TI-ONE ``CreateTrainingTask``."""

    kubernetes: KubernetesOptions = Field(default_factory=KubernetesOptions)
    """Kubeflow Trainer TrainJob or Training Operator PyTorchJob."""

    skypilot: SkyPilotOptions = Field(default_factory=SkyPilotOptions)
    """SkyPilot managed job."""

    @field_validator("envs", mode="before")
    @classmethod
    def _scalars_as_text(cls, value: object) -> object:
        # YAML and --set read `STEPS: 3` as a number; an environment holds text.
        if isinstance(value, dict):
            return {key: str(item).lower() if isinstance(item, bool) else
                    str(item) if isinstance(item, (int, float)) else item for key, item in value.items()}
        return value

    @model_validator(mode="after")
    def _wait_covers_runtime(self) -> SubmitConfig:
        if self.max_wait_s is not None and self.max_wait_s < self.max_runtime_s:
            raise ValueError(
                f"submit.max_wait_s ({self.max_wait_s}) must be >= submit.max_runtime_s ({self.max_runtime_s}): "
                "it counts the running time plus the wait for spot capacity"
            )
        return self
