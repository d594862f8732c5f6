"""The ``monitor`` section: metrics, TensorBoard, the system sampler, cost, report,
guards and exporters."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from skylift.config.section import Section as _Section

__all__ = ["AliyunCmsConfig", "CloudWatchConfig", "GuardsConfig", "MlflowConfig", "MonitorConfig", "WandbConfig"]


class GuardsConfig(_Section):
    budget_usd: float | None = Field(default=None, gt=0.0)
    """Stop with a checkpoint (exit 3) when the dollars spent across restarts reach this, or
    the projection to the end passes it by more than ``budget_margin``; a resume of a run
    that already spent it is refused until it is raised. Needs ``monitor.usd_per_hour``."""

    budget_margin: float = Field(default=0.1, ge=0.0, le=10.0)
    """How far (a share of ``budget_usd``) the projected total may pass the budget before
    the run stops early, rather than at the budget itself."""

    idle_gpu_minutes: float | None = Field(default=None, gt=0.0)
    """Warn (``on_idle_gpu: stop``: checkpoint and exit 3) when every GPU stayed under
    ``idle_gpu_utilization_pct`` for this long; ``null``: off."""

    idle_gpu_utilization_pct: float = Field(default=5.0, ge=0.0, le=100.0)
    """Utilisation (NVML, percent) under which a GPU counts as idle."""

    on_idle_gpu: Literal["warn", "stop"] = "warn"
    """What an idle GPU does: a ``guard`` record and a warning, or also a checkpoint and stop."""

    stall_minutes: float | None = Field(default=None, gt=0.0)
    """When no optimizer step finished for this long, write every thread's stack to
    ``RUN_DIR/stall-rank<R>.txt`` and warn (``on_stall: stop``: exit 3); ``null``: off."""

    on_stall: Literal["warn", "stop"] = "warn"
    """What a stall does: the stacks and a warning, or also end the process (a stuck step
    reaches no boundary to save at; the last checkpoint stands)."""


class CloudWatchConfig(_Section):
    namespace: str = Field(default="skylift", min_length=1, max_length=255)
    """CloudWatch namespace of the metrics."""

    region: str | None = None
    """AWS region; ``null``: boto3's chain (``AWS_REGION``, the profile, the instance)."""

    endpoint_url: str | None = None
    """CloudWatch API endpoint (a VPC endpoint); ``null``: ``AWS_ENDPOINT_URL_CLOUDWATCH``, else
    the region's. Credentials always come from boto3's chain, never from the config."""

    high_resolution: bool = False
    """1-second storage resolution (high-resolution custom metrics cost more) instead of 60."""

    retry_deadline_s: float = Field(default=60.0, gt=0.0)
    """How long one batch is retried (throttling, 5xx) before it is dropped with a warning."""


_CMS_DIMENSION = re.compile(r"[A-Za-z0-9._/\\-]{1,64}")
"""What CloudMonitor takes in a dimension's key and value (it truncates past 64 characters)."""
_CMS_OWN_DIMENSIONS = ("Run", "InstanceType", "Node", "GPU")


class AliyunCmsConfig(_Section):
    group_id: int = Field(default=0, ge=0)
    """CloudMonitor application group the custom metrics belong to; 0: none (CloudMonitor's own
    value for metrics outside any group)."""

    region: str | None = None
    """Alibaba Cloud region (``cn-hangzhou``); ``null``: ``ALIBABA_CLOUD_REGION_ID``. Picks the
    endpoint ``metrics.<region>.aliyuncs.com`` when ``endpoint`` is not set."""

    endpoint: str | None = None
    """CloudMonitor API endpoint (a VPC endpoint, ``host`` or ``scheme://host:port``; HTTPS when no
    scheme is given); ``null``: the region's. Credentials always come from the Alibaba Cloud
    credential chain (``ALIBABA_CLOUD_ACCESS_KEY_ID``/``_SECRET``, ``~/.aliyun/config.json``,
    the ECS RAM role), never from the config."""

    dimensions: dict[str, str] = Field(default_factory=dict)
    """Extra dimensions on every metric (``{team: vision}``), after ``Run`` and ``InstanceType``;
    keys and values of 1-64 letters, digits and ``. _ - / \\``."""

    retry_deadline_s: float = Field(default=60.0, gt=0.0)
    """How long one batch is retried (throttling, 5xx, a dropped connection) before it is
    dropped with a warning."""

    @field_validator("dimensions")
    @classmethod
    def _cloudmonitor_takes_them(cls, dimensions: dict[str, str]) -> dict[str, str]:
        for key, value in dimensions.items():
            if key in _CMS_OWN_DIMENSIONS:
                raise ValueError(f"{key!r} is set by skylift itself; pick another name")
            for text in (key, value):
                if not _CMS_DIMENSION.fullmatch(text):
                    raise ValueError(f"{text!r}: CloudMonitor takes 1-64 letters, digits and . _ - / \\ in a dimension")
        return dimensions


class MlflowConfig(_Section):
    tracking_uri: str | None = None
    """MLflow tracking server or store (``http://host:5000``, ``sqlite:///mlflow.db``,
    ``databricks``); ``null``: ``MLFLOW_TRACKING_URI``, else ``sqlite:///RUN_DIR/mlflow.db``."""

    experiment: str = "skylift"
    """Experiment the run is logged under (created if missing)."""


class WandbConfig(_Section):
    project: str = "skylift"
    """Weights & Biases project."""

    entity: str | None = None
    """Team or user; ``null``: the account's default."""

    mode: Literal["online", "offline"] = "online"
    """``offline`` writes the run under ``RUN_DIR/wandb`` for a later ``wandb sync`` (no account
    needed); credentials for ``online`` come from ``WANDB_API_KEY`` or ``wandb login``."""


class MonitorConfig(_Section):
    log_every_steps: int = Field(default=10, ge=1)
    """Flush per-step ``train`` records to ``metrics.jsonl`` and TensorBoard every this
    many optimizer steps. Losses stay on the device in between, so logging does not
    add a device synchronisation to every step."""

    tensorboard: bool = True
    """Write TensorBoard event files to ``RUN_DIR/tensorboard``."""

    progress_bar: bool | Literal["auto"] = "auto"
    """Rich progress bar on rank 0: ``true``, ``false`` (YAML reads on/off as these), or
    ``auto``, which shows it when stdout is a terminal."""

    system_interval_s: float = Field(default=1.0, ge=0.0)
    """Seconds between samples of host (CPU, memory, disk, network) and GPU (NVML:
    utilization, memory, power, temperature, clocks, PCIe) figures, taken on a
    background thread by local rank 0 of each node; 0 turns the sampler off."""

    breakdown_every_steps: int = Field(default=10, ge=0)
    """Measure where the time of every N-th step goes (data wait, host-to-device copy,
    forward+backward, exposed gradient communication, optimizer, checkpoint stall);
    0 turns it off. Only measured steps pay for the timing."""

    mfu: bool = True
    """Count the model's FLOPs once (on the meta device, no compute) and report model
    FLOPs utilisation against the GPU's data-sheet peak or a measured CPU matmul peak."""

    usd_per_hour: float | None = Field(default=None, ge=0.0)
    """Price of all the run's machines together per hour; turns on the cost ledger
    (dollars spent, per epoch, projected). In an elastic job (``distributed.nodes``) it is
    the price of ``distributed.nodes.max`` nodes, and a stretch on fewer pays its share
    (price x nodes held / max); each ``cost`` record names the nodes it charged.
    ``null``: no cost records."""

    on_demand_usd_per_hour: float | None = Field(default=None, ge=0.0)
    """On-demand price of the same machines (in an elastic job: of ``max`` nodes, shared
    the same way), to report what spot capacity saved."""

    report: bool = True
    """At the end of ``skylift run``, write the HTML report (``RUN_DIR/report/index.html``
    with PNGs; also ``skylift report RUN_DIR`` at any time)."""

    diagnose: bool = True
    """At the end of the run, write a ``diagnosis`` record and log what bounds the run
    (input, compute, communication, checkpoint, memory) with the change that would help."""

    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    """Guards that stop money burning: a budget, an idle GPU, a stalled run."""

    exporters: list[Literal["cloudwatch", "aliyun_cms", "mlflow", "wandb"]] = Field(default_factory=list)
    """Also send the run's records to these (rank 0, off the training thread; see
    ``skylift.monitor.exporters``). TensorBoard is ``monitor.tensorboard``."""

    export_queue_records: int = Field(default=10_000, ge=100)
    """Records the exporters may fall behind by; past it the oldest are dropped and counted."""

    cloudwatch: CloudWatchConfig = Field(default_factory=CloudWatchConfig)
    """``cloudwatch`` exporter settings."""

    aliyun_cms: AliyunCmsConfig = Field(default_factory=AliyunCmsConfig)
    """``aliyun_cms`` exporter settings (Alibaba Cloud CloudMonitor custom metrics)."""

    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    """``mlflow`` exporter settings."""

    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """``wandb`` exporter settings."""

    @model_validator(mode="after")
    def _budget_needs_a_price(self) -> MonitorConfig:
        if self.guards.budget_usd is not None and self.usd_per_hour is None:
            raise ValueError("monitor.guards.budget_usd needs monitor.usd_per_hour (the price the budget is spent at)")
        return self
