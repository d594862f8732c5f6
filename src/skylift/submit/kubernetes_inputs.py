"""Kubernetes: a script job's ``--input`` as volumes, and ``submit.envs`` by reference.

Kubernetes mounts a volume, not a bucket: ``pvc://CLAIM[/SUBPATH]`` (a
PersistentVolumeClaim, read-only) and ``hostpath:///PATH`` (a folder of the node) are
inputs; an object-store URL is refused, since the pod has no mount for it (the program
reads it itself through skylift's storage layer, ``skylift.storage.open_store``, with
the pod's service account).

``submit.envs.NAME=secret:SECRET/KEY`` becomes ``valueFrom.secretKeyRef`` to the
existing Secret ``SECRET`` (the value never reaches skylift); any other value goes in
the job's own Secret (:mod:`skylift.submit.kubernetes`), also read by reference.
"""

from __future__ import annotations

import re
from typing import Any

from skylift.config.submit import SubmitConfig
from skylift.submit.checks import Problem
from skylift.submit.inputs import Mount, input_variable, secret_env_problems, secret_reference
from skylift.submit.spec import JobSpec

__all__ = ["INPUT_MOUNT", "container_env", "input_mounts", "input_problems", "literal_envs", "volumes"]

INPUT_MOUNT = "/mnt/skylift/inputs"
"""An input is mounted read-only at ``<this>/NAME``."""
_PVC = re.compile(r"pvc://([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?)(/.*)?")
_HOST_PATH = re.compile(r"hostpath://(/.*)")
_SECRET_FIX = "write it as secret:NAME/KEY, the key of an existing Secret (kubectl create secret generic NAME ...)"


def input_problems(options: SubmitConfig) -> list[Problem]:
    """An input that is not a volume Kubernetes mounts; a ``secret:`` value that is not NAME/KEY."""
    found = []
    for name, url in options.inputs.items():
        if _PVC.fullmatch(url) or _HOST_PATH.fullmatch(url):
            continue
        scheme = url.partition("://")[0] if "://" in url else "a plain path"
        found.append(Problem(f"--input {name}", f"Kubernetes mounts only pvc://CLAIM[/PATH] and hostpath:///PATH "
                             f"inputs, not {scheme}: copy the data to a PersistentVolumeClaim, or have the program "
                             "read the object store itself through skylift's storage layer (skylift.storage."
                             f"open_store) with the URL in an environment variable (--set submit.envs.{name.upper()}"
                             "_URL=URL) and the pod's service account for access",
                             ("--input", f"{name}=pvc://<claim>/<path>"),
                             drop=(f"--input {name}", f"--set submit.inputs.{name}")))
    found += secret_env_problems(options.envs, "Kubernetes", _SECRET_FIX, literal_secrets_allowed=True,
                                 references_allowed=True)
    return found


def input_mounts(job: JobSpec) -> list[Mount]:
    return [Mount(name, url, f"{INPUT_MOUNT}/{name}") for name, url in job.inputs.items()]


def _volume_name(name: str) -> str:
    # A volume's name is a DNS label: lower case, digits and '-'.
    return "input-" + name.lower().replace("_", "-")


def volumes(job: JobSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's ``volumes`` and the container's ``volumeMounts`` for the job's inputs."""
    pod_volumes, container_mounts = [], []
    for mount in input_mounts(job):
        volume: dict[str, Any] = {"name": _volume_name(mount.name)}
        container_mount: dict[str, Any] = {"name": volume["name"], "mountPath": mount.path, "readOnly": True}
        claim = _PVC.fullmatch(mount.url)
        if claim:
            volume["persistentVolumeClaim"] = {"claimName": claim.group(1), "readOnly": True}
            if claim.group(3) and claim.group(3).strip("/"):
                container_mount["subPath"] = claim.group(3).strip("/")
        else:
            host = _HOST_PATH.fullmatch(mount.url)
            assert host is not None  # input_problems refused anything else
            volume["hostPath"] = {"path": host.group(1), "type": "Directory"}
        pod_volumes.append(volume)
        container_mounts.append(container_mount)
    return pod_volumes, container_mounts


def literal_envs(job: JobSpec) -> dict[str, str]:
    """The ``submit.envs`` whose values skylift holds (they go in the job's own Secret)."""
    return {name: value for name, value in job.envs.items() if secret_reference(value) is None}


def container_env(job: JobSpec, own_secret: str) -> list[dict[str, Any]]:
    """``submit.envs`` by reference (to ``own_secret`` or the Secret a ``secret:`` names), then
    the inputs' folders."""
    env = []
    for name, value in job.envs.items():
        secret, key = secret_reference(value) or (own_secret, name)
        env.append({"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
    return env + [{"name": input_variable(mount.name), "value": mount.path} for mount in input_mounts(job)
                  if input_variable(mount.name) not in job.envs]
