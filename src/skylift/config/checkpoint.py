"""The ``checkpoint`` and ``preemption`` sections: what a run saves, and how it survives a stop."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from skylift.cloud.vendors import cloud_names, cloud_vendor
from skylift.config.section import Section

__all__ = ["CheckpointConfig", "MemoryTierConfig", "PreemptionConfig"]


class MemoryTierConfig(Section):
    """A copy of every checkpoint in this node's memory, sent on to the next node's memory.

    A save then counts as *safe* once every node's share is in two nodes' memory (seconds),
    and *durable* once the object store's manifest is committed (minutes for a large
    model). A restart of crashed workers, or the survivors of a lost node, resume from
    memory without reading the object store; a whole-job restart on new machines resumes
    from the object store, which stays the truth."""

    enabled: bool = False
    """Commit every checkpoint to host memory first (a tmpfs folder), in front of an
    object-store ``checkpoint.root``."""

    root: str = "/dev/shm/skylift"
    """The tmpfs folder that holds the copies. It outlives the worker processes (a crash
    and restart reads it back) but not the machine. Its size limit (tmpfs: half the RAM by
    default) bounds what fits: the start refuses a run whose checkpoints would not."""

    replicate: bool = True
    """Send each node's share to the next node's memory (ring order over nodes) over a
    TCP connection beside training; off: a copy on this node only (never *safe*)."""

    port: int = Field(default=0, ge=0, le=65535)
    """TCP port each node's receiver listens on; 0: any free port (the nodes tell each
    other theirs over the job's own process group). Set one where a firewall needs it."""


class CheckpointConfig(Section):
    enabled: bool = True
    """Save resumable checkpoints (atomic, verified; see the docs page "Checkpoints and preemption")."""

    root: str | None = None
    """Where checkpoints go: a local path or ``s3://``, ``oss://``, ``cos://``, ``file://``
    URL. ``null`` means ``RUN_DIR/checkpoints``."""

    endpoint_url: str | None = None
    """S3 API endpoint for S3-compatible stores (MinIO, OSS, COS). ``null`` reads
    ``SKYLIFT_S3_ENDPOINT_URL``/``AWS_ENDPOINT_URL`` (s3://), ``SKYLIFT_OSS_ENDPOINT_URL``
    (oss://) or ``SKYLIFT_COS_ENDPOINT_URL`` (cos://). Credentials always come from the
    environment or the cloud's credential chain, never from the config."""

    local_root: str | None = None
    """A folder on this node's own disk that also holds every checkpoint, in front of an
    object-store ``root``. Each save commits here first (seconds), then uploads from here
    to ``root``; ``--resume auto`` reads each file from here when its copy verifies, else
    from ``root``. Pays off where the disk outlives the process: a crash or OOM restart
    on the same machine, or a spot VM that is stopped rather than deleted (GCP's and
    Azure's default; AWS with interruption behaviour ``stop``). ``null``: off."""

    memory: MemoryTierConfig = Field(default_factory=MemoryTierConfig)
    """The in-memory tier, replicated to a peer node (see the docs page "Checkpoints and
    preemption": what survives which failure)."""

    every_steps: int | None = Field(default=None, ge=1)
    """Save every this many optimizer steps (``null``: not by step count)."""

    every_minutes: float | None = Field(default=10.0, gt=0.0)
    """Save when this many minutes passed since the last save (``null``: not by time)."""

    save_at_end: bool = True
    """Save a checkpoint when training ends."""

    keep: int = Field(default=3, ge=2)
    """Committed checkpoints to keep; older ones are deleted only after a newer one is
    committed. At least 2, so a corrupt newest checkpoint never leaves none."""

    async_save: bool = True
    """Write and upload in a background thread; the step pays only for copying the
    state off the device."""

    when_busy: Literal["wait", "skip"] = "wait"
    """A save due while the previous one is still being written: ``wait`` for it, or
    ``skip`` this one (decided by all ranks together)."""

    on_failure: Literal["continue", "exit"] = "continue"
    """A save that fails (disk full, store down past the retry deadline) is abandoned on
    all ranks and the previous commit kept; then ``continue`` training or ``exit``
    with code 1."""

    resume: str = "auto"
    """``auto``: continue from the newest checkpoint that verifies (torn or corrupt ones
    are skipped with a warning); ``never``: start fresh (refused if the root already
    holds checkpoints); or the path/URL of one ``step-N`` folder, used only if it verifies."""

    lease_ttl_s: float = Field(default=60.0, ge=1.0)
    """A run lease whose heartbeat is older than this is stale; a second job on the
    same root is refused while the lease is live, and may take over a stale one. A job
    whose lease was taken over (it was paused past this, say) stops at its next step
    boundary without writing the root again, exit 1."""

    unreachable_limit_s: float = Field(default=300.0, gt=0.0)
    """How long the checkpoint root may stay unreachable (saves failing with timeouts,
    refused or dropped connections, 5xx or throttling after all their retries), counted
    from the start of the first such save, before the run stops (exit 1) with a line
    naming the newest committed step; a save that commits starts the count again.
    Whatever ``on_failure`` says: a store that stays down would otherwise cost every due
    save its whole retry budget."""

    save_final_model: bool = True
    """Also write the trained weights to ``RUN_DIR/model.safetensors`` at the end."""


class PreemptionConfig(Section):
    enabled: bool = True
    """Watch for spot/preemption notices and SIGTERM/SIGUSR1; on one, all ranks stop at
    the same step, save if the save fits the notice window, and exit with code 143."""

    cloud: str = "auto"
    """Whose metadata service to poll for notices: a registered cloud (``aws``, ``gcp``,
    ``azure``, ``aliyun``, ``tencent``: :mod:`skylift.cloud.vendors`), ``auto`` detects it
    (or reads ``SKYLIFT_CLOUD``), ``off`` watches signals only."""

    poll_interval_s: float | None = Field(default=None, gt=0.0)
    """Seconds between metadata polls; ``null``: the cloud's recommended interval."""

    @field_validator("cloud", mode="before")
    @classmethod
    def _yaml_off(cls, value: object) -> object:
        # YAML 1.1 reads an unquoted `off` as false.
        return "off" if value is False else value

    @field_validator("cloud")
    @classmethod
    def _a_registered_cloud(cls, value: str) -> str:
        # Checked against the cloud registry, not a list here: a new cloud is its own module.
        if value in ("auto", "off") or cloud_vendor(value) is not None:
            return value
        raise ValueError(f"{value!r} is not a known cloud; use one of: {', '.join(cloud_names())}, auto or off")

    grace_s: float | None = Field(default=None, gt=0.0)
    """Seconds the launcher gives workers to save after SIGTERM before killing them, and
    the window assumed for a signal; ``null``: the detected cloud's notice window
    (120 s on AWS, 30 s elsewhere or when unknown)."""
