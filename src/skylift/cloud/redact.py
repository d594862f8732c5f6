"""Redaction of secrets in requests before they are printed or logged.

Two rules: a value under a secret-looking name is replaced, and any string that
contains the value of a credential variable of this process's environment is too
(so a secret pasted into ``submit.envs`` under an innocent name is still hidden).
"""

from __future__ import annotations

import os
import re
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact"]

REDACTED = "***redacted***"

_SECRET_NAME = re.compile(r"(secret|password|passwd|token|credential|private[_-]?key|access[_-]?key|api[_-]?key)", re.I)
# Credential variables of the vendors skylift submits to.
_CREDENTIAL_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET", "ALIBABA_CLOUD_SECURITY_TOKEN", "ALIBABA_CLOUD_ACCESS_KEY_ID",
    "TENCENTCLOUD_SECRET_KEY", "TENCENTCLOUD_SESSION_TOKEN", "TENCENTCLOUD_SECRET_ID",
)
_MIN_SECRET_LENGTH = 8  # shorter values would redact ordinary words


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact(value: Any, *, under: str = "") -> Any:
    """A copy of ``value`` (dicts, lists, strings) with secrets replaced by ``REDACTED``.

    Example:
        >>> redact({"Envs": {"WANDB_API_KEY": "abc123456", "STEPS": "3"}})
        {'Envs': {'WANDB_API_KEY': '***redacted***', 'STEPS': '3'}}
    """
    if isinstance(value, dict):
        if _is_name_value_pair(value):
            hidden = is_secret_name(str(value.get("Name") or value.get("name")))
            return {key: REDACTED if hidden and key.lower() == "value" else redact(item) for key, item in value.items()}
        return {key: redact(item, under=str(key)) for key, item in value.items()}
    if isinstance(value, list):
        return [redact(item, under=under) for item in value]
    if isinstance(value, str):
        if under and is_secret_name(under) and value:
            return REDACTED
        return _scrub(value)
    return value


def _is_name_value_pair(value: dict) -> bool:
    # Kubernetes env entries and TI-ONE Envs carry the name in a sibling key.
    keys = {key.lower() for key in value}
    return "name" in keys and "value" in keys


def _scrub(text: str) -> str:
    for variable in _CREDENTIAL_VARIABLES:
        secret = os.environ.get(variable, "")
        if len(secret) >= _MIN_SECRET_LENGTH and secret in text:
            text = text.replace(secret, REDACTED)
    return text
