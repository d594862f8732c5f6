"""``skylift submit --watch`` and ``skylift jobs watch``: follow a job, and resubmit one
the platform lost to a spot reclaim without relaunching it (PAI-DLC general compute,
TI-ONE).

A resubmitted job is the same job under a new name with the same checkpoint root, so
``skylift run --resume auto`` inside it continues from the last checkpoint. Each
resubmission is added to the job's local record (:mod:`skylift.submit.records`), so a
later ``jobs watch`` follows the newest job and counts ``max_resubmits`` on from there.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import ModuleType

from skylift.config.submit import SubmitConfig
from skylift.submit import records
from skylift.submit.base import JobRef, JobStatus, PlatformError, platform_module
from skylift.submit.records import JobRecord
from skylift.submit.spec import JobSpec, endpoint_for

__all__ = ["endpoint_for", "follow", "reconnect", "watch"]

_DONE = ("succeeded", "failed", "stopped")
MAX_STATUS_ERRORS = 5
"""Status calls that may fail in a row (network, throttling) before ``--watch`` gives up."""
DEFAULT_POLL_INTERVAL_S = SubmitConfig.model_fields["poll_interval_s"].default

Say = Callable[[str], None]


def watch(platform: ModuleType, job: JobSpec, ref: JobRef, *, resubmits: int = 0, record: JobRecord | None = None,
          endpoint: str | None = None, sleep: Callable[[float], None] | None = None, say: Say = print,
          command: str = "skylift submit --watch") -> int:
    """Poll until the job ends; 0 if it succeeded, else 1. Resubmits after reclaims.

    ``resubmits`` were already made (by an earlier process, from ``record``); the
    limit ``max_resubmits`` counts them too.
    """
    options = job.options
    endpoint = endpoint or endpoint_for(options, ref.platform)
    while True:
        status = _until_done(platform, ref, endpoint, options.poll_interval_s, sleep or time.sleep, say, command)
        if status.state == "succeeded":
            return 0
        if not status.preempted:
            say(f"{command}: {ref} ended {status.state}; see why with: skylift jobs logs {ref}")
            return 1
        if resubmits >= options.max_resubmits:
            say(_gave_up(status, options, command))
            return 1
        resubmits += 1
        job = job.resubmitted(resubmits)
        ref = platform.send(platform.build(job), options)
        say(f"{command}: the spot capacity was reclaimed ({status.detail}); resubmitted as {ref} "
            f"({resubmits} of {options.max_resubmits}); it resumes from the last checkpoint in {job.checkpoint_root}")
        if record is not None:
            record = _noted(record, ref, resubmits, command)


def follow(platform: ModuleType, ref: JobRef, *, reason: str, endpoint: str | None = None,
           poll_interval_s: float = DEFAULT_POLL_INTERVAL_S, sleep: Callable[[float], None] | None = None,
           say: Say = print, command: str = "skylift jobs watch") -> int:
    """Poll until the job ends, resubmitting nothing (``reason`` says why); 0 if it succeeded."""
    status = _until_done(platform, ref, endpoint, poll_interval_s, sleep or time.sleep, say, command)
    if status.state == "succeeded":
        return 0
    if status.preempted:
        say(f"{command}: {ref} was reclaimed ({status.detail}) and cannot be resubmitted from here: {reason}. "
            f"Its checkpoints are kept; to resume, submit the same config again: "
            f"skylift submit CONFIG --platform {ref.platform} ...")
    else:
        say(f"{command}: {ref} ended {status.state}; see why with: skylift jobs logs {ref}")
    return 1


def reconnect(ref: JobRef, *, config_path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
              max_resubmits: int | None = None, poll_interval_s: float | None = None, endpoint: str | None = None,
              say: Say = print, command: str = "skylift jobs watch") -> int:
    """Follow a job submitted earlier; resubmit it after reclaims if its record allows."""
    platform = platform_module(ref.platform)
    record = records.find(ref)
    if record is None:
        reason = (f"no record of it in {records.jobs_dir() / ref.platform} (skylift submit writes one when the "
                  f"platform accepts a job; set {records.JOBS_DIR_VARIABLE} if it wrote it elsewhere)")
        say(f"{command}: following {ref} by status only; {reason}")
        return follow(platform, ref, reason=reason, endpoint=endpoint,
                      poll_interval_s=poll_interval_s or DEFAULT_POLL_INTERVAL_S, say=say, command=command)
    live = JobRef.parse(record.refs[-1])
    if live != ref:
        say(f"{command}: {ref} was resubmitted as {live}; following {live}")
    try:
        job, notes = records.job_for(record, extra_overrides=overrides, config_path=config_path,
                                     extra_flags={"max_resubmits": max_resubmits, "poll_interval_s": poll_interval_s})
    except records.CannotResubmit as error:
        say(f"{command}: following {live} by status only; it cannot be resubmitted: {error}")
        return follow(platform, live, reason=str(error), endpoint=endpoint or record.endpoint,
                      poll_interval_s=poll_interval_s or record.poll_interval_s, say=say, command=command)
    for note in notes:
        say(f"{command}: {note}")
    say(f"{command}: following {live}; {record.resubmits} of {job.options.max_resubmits} resubmissions used "
        f"(record {records.path_for(record.platform, record.name)})")
    return watch(platform, job, live, resubmits=record.resubmits, record=record, endpoint=endpoint, say=say,
                 command=command)


def _until_done(platform: ModuleType, ref: JobRef, endpoint: str | None, poll_interval_s: float,
                sleep: Callable[[float], None], say: Say, command: str) -> JobStatus:
    last, errors = None, 0
    while True:
        try:
            status = platform.status(ref, endpoint)
            errors = 0
        except PlatformError as error:
            errors += 1
            if errors >= MAX_STATUS_ERRORS:
                raise
            say(f"{command}: no status for {ref} ({error}); asking again")
            sleep(poll_interval_s)
            continue
        if (status.state, status.detail) != last:
            say(f"{command}: {ref}: {status.state} ({status.detail})")
            last = (status.state, status.detail)
        if status.state in _DONE:
            return status
        sleep(poll_interval_s)


def _noted(record: JobRecord, ref: JobRef, resubmits: int, command: str) -> JobRecord:
    try:
        return records.resubmitted(record, ref, resubmits)
    except OSError as error:
        # The job is running either way; only a later `jobs watch` loses track of it.
        print(f"{command}: could not update the job record ({error}); a later "
              f"`skylift jobs watch` would follow the old job", file=sys.stderr)
        return record


def _gave_up(status: JobStatus, options: SubmitConfig, command: str) -> str:
    return (f"{command}: {status.ref} was reclaimed again ({status.detail}) and "
            f"submit.max_resubmits ({options.max_resubmits}) is used up; the checkpoints are kept: submit the same "
            f"config again to resume, or allow more: skylift jobs watch {status.ref} "
            f"--max-resubmits {options.max_resubmits + 1}")
