"""A script job's data (``--input NAME=URL``) and the secrets among ``submit.envs``.

Inputs: each platform mounts (or syncs) ``URL`` with its own documented mechanism and
the job learns the local folder from ``SKYLIFT_INPUT_<NAME>`` (:func:`input_variable`);
a scheme the platform cannot mount is refused, naming the schemes it can.

Secrets: a ``submit.envs`` variable whose name looks like a secret (the rule the
redaction uses, :func:`skylift.cloud.redact.is_secret_name`) and whose value is literal
would sit in clear text in a request that only has a plain environment (SageMaker
``Environment``, DLC ``Envs``, TI-ONE ``Envs``): refused before any request, with that
platform's fix. A value ``secret:NAME/KEY`` is a reference to key ``KEY`` of the
Kubernetes Secret ``NAME``, which only Kubernetes resolves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from skylift.cloud.redact import is_secret_name
from skylift.submit.checks import Problem, parse_store_url

__all__ = [
    "INPUT_NAME",
    "SECRET_PREFIX",
    "Mount",
    "input_notes",
    "input_problems",
    "input_variable",
    "secret_env_problems",
    "secret_reference",
]

INPUT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,62}")
"""An input's name: part of an environment variable's name, a SageMaker channel and a path."""
SECRET_PREFIX = "secret:"
"""``submit.envs.NAME=secret:SECRET/KEY``: the value of key ``KEY`` of Kubernetes Secret ``SECRET``."""
# A Secret's name is a DNS subdomain; a key is letters, digits, '-', '_' and '.'.
_SECRET_REFERENCE = re.compile(r"secret:([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)/([-._a-zA-Z0-9]+)")


@dataclass(frozen=True)
class Mount:
    """One input as a platform gives it to the job."""

    name: str
    url: str
    path: str
    """The folder inside the job."""


def input_variable(name: str) -> str:
    """``SKYLIFT_INPUT_TRAIN`` for input ``train``: the variable holding its local folder."""
    return f"SKYLIFT_INPUT_{name.upper()}"


def input_problems(inputs: Mapping[str, str], schemes: Sequence[str], platform: str,
                   mechanism: str) -> list[Problem]:
    """A problem per input whose URL is not ``SCHEME://BUCKET/...`` with a scheme the platform
    mounts (``mechanism``: how it mounts them, for the message)."""
    found = []
    for name, url in inputs.items():
        scheme, bucket, _ = parse_store_url(url)
        if scheme in schemes and bucket:
            continue
        wanted = ", ".join(f"{item}://" for item in schemes)
        found.append(Problem(f"--input {name}", f"{platform} mounts only {wanted} inputs ({mechanism}), not "
                             f"{url.partition('://')[0] + '://' if '://' in url else repr(url)}",
                             ("--input", f"{name}={schemes[0]}://<bucket>/<prefix>"),
                             drop=(f"--input {name}", f"--set submit.inputs.{name}")))
    return found


def input_notes(mounts: Sequence[Mount]) -> list[str]:
    """What ``--dry-run`` says of each input: where it is and the variable that names it."""
    return [f"input {mount.name}: {mount.url} at {mount.path} ({input_variable(mount.name)})" for mount in mounts]


def secret_reference(value: str) -> tuple[str, str] | None:
    """(Secret name, key) of a ``secret:NAME/KEY`` value; ``None`` for a literal."""
    match = _SECRET_REFERENCE.fullmatch(value)
    return (match.group(1), match.group(3)) if match else None


def secret_env_problems(envs: Mapping[str, str], platform: str, fix: str, *,
                        literal_secrets_allowed: bool = False, references_allowed: bool = False) -> list[Problem]:
    """A problem per ``submit.envs`` variable the platform cannot carry safely: a
    secret-looking name with a literal value (unless ``literal_secrets_allowed``: the
    platform keeps it as a secret itself), or a ``secret:`` value it cannot resolve
    (unless ``references_allowed``). ``fix`` says the platform's way."""
    found = []
    for name, value in envs.items():
        field = f"submit.envs.{name}"
        if value.startswith(SECRET_PREFIX):
            if references_allowed and secret_reference(value) is None:
                found.append(Problem(field, "is not secret:NAME/KEY (a Kubernetes Secret's name and key)", (),
                                     drop=(f"--set {field}",)))
            elif not references_allowed:
                found.append(Problem(field, f"is a secret: reference, which {platform} cannot resolve (only "
                                     f"Kubernetes has Secrets); {fix}", (), drop=(f"--set {field}",)))
        elif is_secret_name(name) and not literal_secrets_allowed:
            found.append(Problem(field, f"looks like a secret and {platform} would carry its value in clear text "
                                 f"in the request; {fix}", (), drop=(f"--set {field}",)))
    return found
