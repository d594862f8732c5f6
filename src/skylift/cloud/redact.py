"""Redaction of secrets in requests, configs and logs before they are written or printed.

Three rules: a value under a secret-looking name (or under a name of ``submit.envs``)
is replaced; the user-info of every URL (``scheme://user:password@host``) is replaced;
and any string that contains the value of a credential variable of this process's
environment, or a long ``submit.envs`` value, has it replaced (so a secret pasted under
an innocent name is still hidden).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["REDACTED", "is_secret_name", "redact", "redact_config"]

REDACTED = "***redacted***"

_SECRET_NAME = re.compile(r"(secret|password|passwd|token|credential|private[_-]?key|access[_-]?key|api[_-]?key)",
                          re.IGNORECASE)
# Credential variables of the vendors skylift submits to.
_CREDENTIAL_VARIABLES = (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID",
    "ALIBABA_CLOUD_ACCESS_KEY_SECRET", "ALIBABA_CLOUD_SECURITY_TOKEN", "ALIBABA_CLOUD_ACCESS_KEY_ID",
    "TENCENTCLOUD_SECRET_KEY", "TENCENTCLOUD_SESSION_TOKEN", "TENCENTCLOUD_SECRET_ID",
)
_MIN_SECRET_LENGTH = 8  # shorter values would redact ordinary words
# scheme://USER-INFO@host: the user-info runs to the last "@" before the path, so a
# password holding a raw "@" is hidden whole.
_URL_USER_INFO = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]*://)[^\s/?#]+@")


def is_secret_name(name: str) -> bool:
    return bool(_SECRET_NAME.search(name))


def redact(value: Any, *, under: str = "", envs: Mapping[str, str] | None = None) -> Any:
    """A copy of ``value`` (dicts, lists, strings) with secrets replaced by ``REDACTED``.

    ``envs`` are the job's ``submit.envs``: each value is secret whatever its name, so it
    is hidden under its name (a mapping key, or a Name/Value entry's name) and anywhere a
    string holds it.

    Example:
        >>> redact({"Envs": {"WANDB_API_KEY": "abc123456", "STEPS": "3"}})
        {'Envs': {'WANDB_API_KEY': '***redacted***', 'STEPS': '3'}}
        >>> redact({"Envs": {"NOTE": "abc"}}, envs={"NOTE": "abc"})
        {'Envs': {'NOTE': '***redacted***'}}
    """
    return _Redactor(envs or {}).walk(value, under)


def redact_config(document: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a run config's dump (``RunConfig.model_dump(mode="json")``) as it may be
    written or printed: every ``submit.envs`` value, every URL's user-info and every
    credential of this environment replaced by ``REDACTED``. A config field is not hidden
    for its name alone (``token_budget`` is no secret).

    Example:
        >>> redact_config({"submit": {"envs": {"NOTE": "abc"}},
        ...                "monitor": {"uri": "http://me:pw@127.0.0.1:5000"}})
        {'submit': {'envs': {'NOTE': '***redacted***'}}, 'monitor': {'uri': 'http://***redacted***@127.0.0.1:5000'}}
    """
    submit = document.get("submit")
    envs = submit.get("envs") if isinstance(submit, Mapping) else None
    envs = {str(name): str(item) for name, item in envs.items()} if isinstance(envs, Mapping) else {}
    redactor = _Redactor(envs, by_name=False)
    result = redactor.walk(dict(document), "")
    if envs:
        result["submit"]["envs"] = {name: REDACTED if item else item for name, item in envs.items()}
    return result


class _Redactor:
    def __init__(self, envs: Mapping[str, str], *, by_name: bool = True) -> None:
        self.env_names = set(envs)
        # Longest first, so a value that contains another is replaced whole.
        self.env_values = sorted({item for item in envs.values() if len(item) >= _MIN_SECRET_LENGTH},
                                 key=len, reverse=True)
        self.by_name = by_name

    def hidden(self, name: str) -> bool:
        return self.by_name and (is_secret_name(name) or name in self.env_names)

    def walk(self, value: Any, under: str) -> Any:
        if isinstance(value, dict):
            if self.by_name and _is_name_value_pair(value):
                hidden = self.hidden(str(value.get("Name") or value.get("name")))
                return {key: REDACTED if hidden and key.lower() == "value" else self.walk(item, "")
                        for key, item in value.items()}
            return {key: self.walk(item, str(key)) for key, item in value.items()}
        if isinstance(value, list):
            return [self.walk(item, under) for item in value]
        if isinstance(value, str):
            if under and value and self.hidden(under):
                return REDACTED
            return self.scrub(value)
        return value

    def scrub(self, text: str) -> str:
        for secret in self.env_values:
            text = text.replace(secret, REDACTED)
        return _scrub(text)


def _is_name_value_pair(value: dict) -> bool:
    # Kubernetes env entries and TI-ONE Envs carry the name in a sibling key.
    keys = {key.lower() for key in value}
    return "name" in keys and "value" in keys


def _scrub(text: str) -> str:
    for variable in _CREDENTIAL_VARIABLES:
        secret = os.environ.get(variable, "")
        if len(secret) >= _MIN_SECRET_LENGTH and secret in text:
            text = text.replace(secret, REDACTED)
    return _URL_USER_INFO.sub(rf"\1{REDACTED}@", text)
