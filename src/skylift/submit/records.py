"""Local records of submitted jobs, so ``skylift jobs watch`` can resubmit one after a
spot reclaim when the terminal that submitted it is gone (the laptop slept, the
window closed).

``skylift submit`` writes ``$SKYLIFT_JOBS_DIR/<platform>/<first job name>.json``
(default ``~/.skylift/jobs``) once the platform accepts a job: the config's resolved
path and a hash of its text (a script job: its command in the image, and the config
only if ``--config`` named one), the ``--set`` overrides and flags it was submitted with,
the checkpoint root and image they resolved to, every job reference so far and the
resubmission count. No credentials: an override of ``submit.envs`` (any name), or
one whose key looks secret, or whose value holds a URL's user-info or a credential
variable's value, is kept by key only, and ``jobs watch`` asks for it again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from skylift.cloud.redact import redact
from skylift.errors import SkyliftConfigError
from skylift.submit.base import JobRef
from skylift.submit.script import script_job_from_inputs
from skylift.submit.spec import JobSpec, endpoint_for, job_from_inputs

__all__ = ["JOBS_DIR_VARIABLE", "CannotResubmit", "JobRecord", "find", "job_for", "jobs_dir", "new_record",
           "resubmitted", "save"]

JOBS_DIR_VARIABLE = "SKYLIFT_JOBS_DIR"
_VERSION = 1


class CannotResubmit(Exception):
    """The record cannot be turned back into the job; the text says why and the fix."""


@dataclass(frozen=True)
class JobRecord:
    platform: str
    name: str
    """The first job's name; resubmissions are ``<name>-r1``, ``-r2``..."""
    refs: list[str]
    """Every job submitted for this run, oldest first; the last one is the live one."""
    resubmits: int
    config_path: str
    """The config file, resolved on this machine, that ``jobs watch`` reads again
    (``""``: a script job submitted without ``--config``)."""
    config_argument: str
    """The config path as given, which the command inside the image names."""
    config_sha256: str
    overrides: list[str]
    """``--set`` items as given, less the withheld ones."""
    flags: dict[str, Any]
    """``skylift submit``'s flags that were given, by ``with_flags`` name."""
    checkpoint_root: str
    image: str
    withheld: list[str] = field(default_factory=list)
    """Keys of ``--set`` items whose value looked secret and was not written."""
    endpoint: str | None = None
    """The API endpoint (Kubernetes: kube context) submit used; ``None``: the vendor's."""
    poll_interval_s: float = 30.0
    """``submit.poll_interval_s`` at submit, for a watch that cannot rebuild the job."""
    submitted_at: str = ""
    updated_at: str = ""
    script: list[str] = field(default_factory=list)
    """A script job's command in the image (``python train.py ARGS``); empty for a config job."""
    version: int = _VERSION


def jobs_dir() -> Path:
    return Path(os.environ.get(JOBS_DIR_VARIABLE) or Path.home() / ".skylift" / "jobs")


def path_for(platform: str, name: str) -> Path:
    return jobs_dir() / platform / f"{name}.json"


def new_record(job: JobSpec, ref: JobRef, *, config_path: str | None, overrides: list[str] | tuple[str, ...],
               flags: dict[str, Any]) -> JobRecord:
    """The record of ``job``, accepted as ``ref``; ``config_path`` as given (``None``: a
    script job without ``--config``)."""
    kept, withheld = [], []
    for item in overrides:
        key, _, value = item.partition("=")
        # Every submit.envs value is secret whatever its name; so is a URL's user-info.
        if key.strip().startswith("submit.envs.") or redact(value, under=key.strip()) != value:
            withheld.append(key.strip())
        else:
            kept.append(item)
    now = _now()
    resolved = Path(config_path).resolve() if config_path else None
    return JobRecord(
        platform=ref.platform, name=job.name, refs=[str(ref)], resubmits=job.attempt,
        config_path=str(resolved or ""), config_argument=job.config_path,
        config_sha256=_sha256(resolved) if resolved else "", overrides=kept,
        flags={key: value for key, value in flags.items() if value is not None},
        checkpoint_root=job.checkpoint_root, image=job.options.image or "", withheld=withheld,
        endpoint=endpoint_for(job.options, ref.platform), poll_interval_s=job.options.poll_interval_s,
        submitted_at=now, updated_at=now, script=list(job.script),
    )


def save(record: JobRecord) -> Path:
    """Write ``record`` atomically (a reader never sees half a file); returns its path."""
    path = path_for(record.platform, record.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".record-", suffix=".json")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(asdict(record), stream, indent=2)
            stream.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def resubmitted(record: JobRecord, ref: JobRef, resubmits: int) -> JobRecord:
    """``record`` after resubmission number ``resubmits`` as ``ref``, saved."""
    updated = replace(record, refs=[*record.refs, str(ref)], resubmits=resubmits, updated_at=_now())
    save(updated)
    return updated


def find(ref: JobRef) -> JobRecord | None:
    """The record that lists ``ref`` (the first job or any resubmission), or ``None``."""
    folder = jobs_dir() / ref.platform
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else ():
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            if str(ref) in raw.get("refs", []) and raw.get("version") == _VERSION:
                return JobRecord(**raw)
        except (OSError, ValueError, TypeError):
            continue  # another tool's file, or one from a newer skylift: not ours to read
    return None


def job_for(record: JobRecord, *, extra_overrides: list[str] | tuple[str, ...] = (),
            config_path: str | None = None, extra_flags: dict[str, Any] | None = None) -> tuple[JobSpec, list[str]]:
    """The recorded job, rebuilt from its config, for the next resubmission; and notes to print.

    Raises:
        CannotResubmit: the config is gone, a withheld secret was not given again, or
            the config now resolves to another checkpoint root or image (the new job
            would not resume the run).
    """
    live = record.refs[-1]
    path = Path(config_path or record.config_path) if config_path or record.config_path else None
    if path is not None and not path.is_file():
        raise CannotResubmit(f"its config {path} is gone; give where it is now: "
                             f"skylift jobs watch {live} --config PATH")
    given = {item.partition("=")[0].strip() for item in extra_overrides}
    missing = [key for key in record.withheld if key not in given]
    if missing:
        sets = " ".join(f"--set {key}=VALUE" for key in missing)
        raise CannotResubmit(f"{', '.join(missing)} had a secret value at submit, which skylift does not write to "
                             f"disk; give it again: skylift jobs watch {live} {sets}")
    flags = {**record.flags, **{key: value for key, value in (extra_flags or {}).items() if value is not None}}
    try:
        job = _rebuilt(record, path, [*record.overrides, *extra_overrides], flags)
    except SkyliftConfigError as error:
        raise CannotResubmit(f"its config no longer loads: {error}") from None
    for key, now, then in (("checkpoint.root", job.checkpoint_root, record.checkpoint_root),
                           ("submit.image", job.options.image or "", record.image)):
        if now != then:
            raise CannotResubmit(f"{path} now gives {key} {now!r}, and the job ran with {then!r}: a new job would "
                                 f"not resume it; restore the config, or: skylift jobs watch {live} --set {key}={then}")
    notes = []
    if path is not None and _sha256(path) != record.config_sha256:
        notes.append(f"{path} changed since the job was submitted; a resubmission uses it as it is now "
                     "(same checkpoint root and image)")
    return replace(job, name=record.name, attempt=record.resubmits), notes


def _rebuilt(record: JobRecord, path: Path | None, overrides: list[str], flags: dict[str, Any]) -> JobSpec:
    if not record.script:
        return job_from_inputs(str(path), overrides, flags, record.config_argument)
    # The script lives in the image: this machine need not hold it any more.
    job = script_job_from_inputs(record.script, str(path) if path else None, overrides, flags, check_script=False)
    return replace(job, config_path=record.config_argument)


def _sha256(path: Path) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return ""


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
