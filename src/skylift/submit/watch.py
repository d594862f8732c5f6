"""``skylift submit --watch``: follow a job, and resubmit one the platform lost to a
spot reclaim without relaunching it (PAI-DLC general compute, TI-ONE).

A resubmitted job is the same job under a new name with the same checkpoint root, so
``skylift run --resume auto`` inside it continues from the last checkpoint.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from types import ModuleType

from skylift.submit.base import JobRef, JobStatus, PlatformError
from skylift.config.submit import SubmitConfig
from skylift.submit.spec import JobSpec

__all__ = ["endpoint_for", "watch"]

_DONE = ("succeeded", "failed", "stopped")
MAX_STATUS_ERRORS = 5
"""Status calls that may fail in a row (network, throttling) before ``--watch`` gives up."""


def endpoint_for(options: SubmitConfig, platform: str) -> str | None:
    """The endpoint (Kubernetes: kube context) ``submit`` used, for the follow-up calls."""
    return {"sagemaker": options.sagemaker.endpoint_url, "pai": options.pai.endpoint,
            "tione": options.tione.endpoint, "k8s": options.kubernetes.context}.get(platform)


def watch(platform: ModuleType, job: JobSpec, ref: JobRef, *, sleep: Callable[[float], None] = time.sleep,
          say: Callable[[str], None] = print) -> int:
    """Poll until the job ends; 0 if it succeeded, else 1. Resubmits after reclaims."""
    options = job.options
    resubmits, last, errors = 0, None, 0
    while True:
        try:
            status = platform.status(ref, endpoint_for(options, ref.platform))
            errors = 0
        except PlatformError as error:
            errors += 1
            if errors >= MAX_STATUS_ERRORS:
                raise
            say(f"skylift submit --watch: no status for {ref} ({error}); asking again")
            sleep(options.poll_interval_s)
            continue
        if (status.state, status.detail) != last:
            say(f"skylift submit --watch: {ref}: {status.state} ({status.detail})")
            last = (status.state, status.detail)
        if status.state not in _DONE:
            sleep(options.poll_interval_s)
            continue
        if status.state == "succeeded":
            return 0
        if not status.preempted:
            say(f"skylift submit --watch: {ref} ended {status.state}; see why with: skylift jobs logs {ref}")
            return 1
        if resubmits >= options.max_resubmits:
            say(_gave_up(status, options))
            return 1
        resubmits += 1
        job = job.resubmitted(resubmits)
        ref = platform.send(platform.build(job), options)
        say(f"skylift submit --watch: the spot capacity was reclaimed ({status.detail}); resubmitted as {ref} "
            f"({resubmits} of {options.max_resubmits}); it resumes from the last checkpoint in {job.checkpoint_root}")
        last = None


def _gave_up(status: JobStatus, options: SubmitConfig) -> str:
    return (f"skylift submit --watch: {status.ref} was reclaimed again ({status.detail}) and "
            f"submit.max_resubmits ({options.max_resubmits}) is used up; the checkpoints are kept: submit the same "
            "config again to resume, or raise --max-resubmits")
