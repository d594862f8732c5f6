"""What every platform module provides, the registry, and lazy vendor imports.

A platform module (``skylift.submit.<name>``) exposes:

* ``problems(options, checkpoint_root) -> list[Problem]``: what the platform needs beyond
  the common checks (:mod:`skylift.submit.checks`), all at once; ``OBJECT_STORES``: the
  schemes it reads the checkpoint root and the data from (absent: any object store);
* ``build(job: JobSpec) -> SubmitRequest``: the exact request, nothing sent;
* ``send(request: SubmitRequest) -> JobRef``: create the job;
* ``status(ref) -> JobStatus``, ``logs(ref) -> list[str]``, ``stop(ref) -> None``.

Vendor SDKs are optional extras, imported only inside these functions through
:func:`import_sdk`, which turns a missing one into the pip command that installs it.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

from skylift.errors import SkyliftConfigError, SkyliftError

__all__ = [
    "MODULES",
    "JobRef",
    "JobState",
    "JobStatus",
    "PlatformError",
    "SubmitRequest",
    "credentials_error",
    "guarded",
    "import_sdk",
    "platform_module",
    "vendor_errors",
]

# platform -> (module, display name)
MODULES: dict[str, tuple[str, str]] = {
    "sagemaker": ("skylift.submit.sagemaker", "AWS SageMaker"),
    "pai": ("skylift.submit.pai", "Alibaba Cloud PAI-DLC"),
    "tione": ("skylift.submit.tione", "Tencent Cloud TI-ONE"),
    "k8s": ("skylift.submit.kubernetes", "Kubernetes (Kubeflow)"),
    "skypilot": ("skylift.submit.skypilot", "SkyPilot"),
}

JobState = Literal["pending", "running", "succeeded", "failed", "stopped"]


@dataclass(frozen=True)
class SubmitRequest:
    """A platform's request, exactly as it is (or would be) sent."""

    platform: str
    operation: str
    """The vendor's name for the call, e.g. ``CreateTrainingJob``."""
    target: str
    """Where it goes: region, endpoint or kube context."""
    body: dict[str, Any]
    """The request payload (JSON-able), or for SkyPilot the task YAML as a mapping."""
    extra: list[dict[str, Any]] = field(default_factory=list)
    """Objects sent before ``body`` (the ClusterTrainingRuntime of a TrainJob)."""
    notes: list[str] = field(default_factory=list)
    """What ``--dry-run`` says beside the request (whether the platform keeps an elastic job running)."""
    secret_envs: dict[str, str] = field(default_factory=dict, repr=False)
    """The job's ``submit.envs``: sent as they are, hidden in everything printed whatever their names."""


@dataclass(frozen=True)
class JobRef:
    """A submitted job: ``platform:location:id``, e.g. ``pai:cn-hangzhou:dlc1a2b3c``."""

    platform: str
    location: str
    job_id: str

    def __str__(self) -> str:
        return f"{self.platform}:{self.location}:{self.job_id}"

    @classmethod
    def parse(cls, text: str) -> JobRef:
        platform, _, rest = text.partition(":")
        location, _, job_id = rest.partition(":")
        if platform not in MODULES or not job_id:
            raise SkyliftConfigError(
                f"job {text!r} is not PLATFORM:LOCATION:ID with PLATFORM one of {', '.join(MODULES)}",
                hint="skylift submit prints the job reference, e.g.: skylift jobs status pai:cn-hangzhou:dlc1a2b3c",
            )
        return cls(platform, location, job_id)


@dataclass(frozen=True)
class JobStatus:
    ref: JobRef
    state: JobState
    detail: str = ""
    """The platform's own status and reason, e.g. ``Failed: spot instance reclaimed``."""
    preempted: bool = False
    """Ended because the platform took the capacity back (resubmit to resume)."""


def platform_module(name: str) -> ModuleType:
    if name not in MODULES:
        raise SkyliftConfigError(f"--platform {name!r} is not one of {', '.join(MODULES)}")
    return importlib.import_module(MODULES[name][0])


def import_sdk(module: str, extra: str, package: str) -> Any:
    """``importlib.import_module(module)``, or an error with the pip command for ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise SkyliftConfigError(
            f"the {package} SDK is not installed (needed for this platform)",
            hint=f"Install it with: pip install 'skylift[{extra}]'   (or: pip install {package})",
        ) from None


def credentials_error(platform: str, how: str) -> SkyliftConfigError:
    """No usable credentials: say the vendor's own way to set them, never a value."""
    return SkyliftConfigError(f"no {MODULES[platform][1]} credentials were found", hint=how)


class PlatformError(SkyliftError):
    """The platform refused or failed a call; the text is the platform's own answer, redacted."""


@contextmanager
def vendor_errors(platform: str, *error_types: type[BaseException]) -> Iterator[None]:
    """Turn the vendor SDK's errors into :class:`PlatformError` naming the platform."""
    from skylift.cloud.redact import redact

    try:
        yield
    except error_types as error:
        raise PlatformError(f"{MODULES[platform][1]}: {redact(str(error))}") from None


class _Guarded:
    """A vendor client whose every method raises :class:`PlatformError` for the vendor's errors."""

    def __init__(self, client: Any, platform: str, error_types: tuple[type[BaseException], ...]) -> None:
        self._client, self._platform, self._error_types = client, platform, error_types

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._client, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with vendor_errors(self._platform, *self._error_types):
                return method(*args, **kwargs)

        return call


def guarded(client: Any, platform: str, *error_types: type[BaseException]) -> Any:
    return _Guarded(client, platform, error_types)
