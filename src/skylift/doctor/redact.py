"""Keep credentials, tokens and home paths out of a report meant to be pasted anywhere.

Three layers, applied to every string of the text and JSON output:

1. the value of any environment variable whose name says it is secret
   (``AWS_SECRET_ACCESS_KEY``, ``HF_TOKEN``, ``*_KEY``, ``*PASSWORD*``...) is replaced
   wherever it appears, and such variables are listed as ``<redacted>``;
2. the user-info part of URLs (``https://user:pass@host``) and well-known token shapes
   (AWS access key ids, GitHub and Hugging Face tokens) are replaced;
3. the home folder becomes ``~`` and other users' homes ``/home/<user>``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["REDACTED", "Redactor", "is_secret_name"]

REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSW|CREDENTIAL|PRIVATE|(^|_)KEY($|_)|API_?KEY|AUTH", re.IGNORECASE)
_URL_USERINFO = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s@]+@")
_TOKEN_SHAPES = re.compile(
    r"\b(?:AKIA|ASIA)[A-Z0-9]{16}\b"  # AWS access key ids
    r"|\b(?:ghp|gho|ghs|ghu|ghr)_[A-Za-z0-9]{20,}\b|\bgithub_pat_[A-Za-z0-9_]{20,}\b"
    r"|\bhf_[A-Za-z0-9]{20,}\b"
    r"|\bxox[abpr]-[A-Za-z0-9-]{10,}\b"
)
_OTHER_HOMES = re.compile(r"(?P<root>/home|/Users)/[^/\s:'\"]+")
_MIN_SECRET_LENGTH = 4  # shorter values ("1", "true") would blank out ordinary text


def is_secret_name(name: str) -> bool:
    """True for variable names that hold credentials by convention."""
    return bool(_SECRET_NAME.search(name))


class Redactor:
    """Redacts strings, and dicts/lists of them, for this environment and home folder."""

    def __init__(self, environ: Mapping[str, str] | None = None, home: str | None = None) -> None:
        environ = os.environ if environ is None else environ
        values = {value for name, value in environ.items() if is_secret_name(name) and len(value) >= _MIN_SECRET_LENGTH}
        self._secret_values = sorted(values, key=len, reverse=True)  # longest first: no partial leftovers
        home = str(Path.home()) if home is None else home
        self._home = re.compile(re.escape(home.rstrip("/")) + r"(?=/|$|[\s:'\"])") if home not in ("", "/") else None

    def text(self, text: str) -> str:
        """``text`` with secrets, URL credentials, token shapes and home paths replaced."""
        for value in self._secret_values:
            text = text.replace(value, REDACTED)
        text = _URL_USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", text)
        text = _TOKEN_SHAPES.sub(REDACTED, text)
        if self._home is not None:
            text = self._home.sub("~", text)
        return _OTHER_HOMES.sub(lambda match: f"{match['root']}/<user>", text)

    def value(self, value: Any) -> Any:
        """A JSON-like value with every string (keys included) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(item) for item in value]
        if isinstance(value, dict):
            return {self.value(key): self.value(item) for key, item in value.items()}
        return value

    def environment(self, variables: Mapping[str, str]) -> dict[str, str]:
        """Variables with secret-named ones shown as ``<redacted>`` and the rest redacted as text."""
        return {name: REDACTED if is_secret_name(name) else self.text(value) for name, value in variables.items()}
