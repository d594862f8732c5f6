"""How ``skylift submit`` and ``skylift jobs`` print requests and jobs; always redacted."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from skylift.cloud.redact import redact
from skylift.submit.base import JobRef, JobStatus, SubmitRequest, platform_info

__all__ = ["exit_code", "print_request", "print_status", "print_submitted", "request_document"]



def request_document(request: SubmitRequest) -> dict[str, Any]:
    """The request as one JSON-able mapping, secrets redacted: every ``submit.envs`` value
    whatever its name, every URL's user-info, every credential of this environment."""
    document: dict[str, Any] = {
        "platform": request.platform,
        "operation": request.operation,
        "target": request.target,
        "request": request.body,
    }
    if request.extra:
        document["applied_first"] = request.extra
    if request.notes:
        document["notes"] = request.notes
    return redact(document, envs=request.secret_envs)


def print_request(request: SubmitRequest, *, as_json: bool) -> None:
    document = request_document(request)
    if as_json:
        print(json.dumps({**document, "sent": False}, indent=2))
        return
    name = platform_info(request.platform).title
    print(f"skylift submit --dry-run: {name} {request.operation} -> {document['target']}; nothing was sent")
    for note in document.get("notes", []):
        print(f"skylift submit --dry-run: {note}")
    if platform_info(request.platform).request_format == "yaml":
        documents = [*document.get("applied_first", []), document["request"]]
        print(yaml.safe_dump_all(documents, sort_keys=False), end="")
    else:
        print(json.dumps(document["request"], indent=2))


def print_submitted(request: SubmitRequest, ref: JobRef, *, as_json: bool, record: Path | None = None) -> None:
    """The accepted job; ``record`` is its local record for ``skylift jobs watch``, if written."""
    if as_json:
        print(json.dumps({**request_document(request), "sent": True, "job": str(ref),
                          "record": str(record) if record else None}, indent=2))
        return
    print(f"skylift submit: {platform_info(request.platform).title} accepted {request.operation}; job {ref}")
    print(f"  follow it with: skylift jobs status {ref}   (logs: skylift jobs logs {ref})")
    if record is not None:
        print(f"  watch it later, resubmitting after a spot reclaim: skylift jobs watch {ref}   (record {record})")


def print_status(status: JobStatus, *, as_json: bool) -> None:
    if as_json:
        print(json.dumps(redact({"job": str(status.ref), "state": status.state, "detail": status.detail,
                                 "preempted": status.preempted})))
        return
    note = " (preempted: resubmit to resume)" if status.preempted else ""
    print(redact(f"{status.ref}: {status.state} - {status.detail}{note}"))


def exit_code(command: str, action: Callable[[], int]) -> int:
    """``action()``, or 1 with the platform's answer on stderr when a platform call fails."""
    from skylift.errors import EXIT_FAILURE
    from skylift.submit.base import PlatformError

    try:
        return action()
    except PlatformError as error:
        print(f"skylift {command}: {error}", file=sys.stderr)
        return EXIT_FAILURE
