"""What every platform module provides, the registry, and lazy vendor imports.

A platform module (``skylift.submit.<name>``) declares ``PLATFORM = Platform(...)``: its
name and aliases, its display name, the endpoint its follow-up calls use, its elastic
note, how long it waits between SIGTERM and SIGKILL, how a node of its jobs learns the
topology, and whether its request prints as YAML. :func:`platforms` finds those modules
by scanning the package (as SkyPilot's ``clouds/`` and fsspec's registry do), so a new
platform is one new file; :func:`register_platform` adds one from elsewhere (a plugin, a
test). Its module also exposes:

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
import pkgutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal

from skylift.errors import SkyliftConfigError, SkyliftError

if TYPE_CHECKING:
    from skylift.config.distributed import ElasticNodes
    from skylift.config.submit import SubmitConfig

__all__ = [
    "JobRef",
    "JobState",
    "JobStatus",
    "Platform",
    "PlatformError",
    "PlatformTopology",
    "SubmitRequest",
    "credentials_error",
    "guarded",
    "import_sdk",
    "platform_info",
    "platform_module",
    "platform_names",
    "platforms",
    "register_platform",
    "resolve_platform",
    "unregister_platform",
    "vendor_errors",
]


@dataclass(frozen=True)
class PlatformTopology:
    """What a platform tells one node of a job (read by :mod:`skylift.submit.environment`)."""

    platform: str
    source: str
    """What it was read from, for the report."""
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int | None
    nproc: int | None = None
    """``None``: one process per visible GPU (at least one)."""
    grace_s: float | None = None
    node_level_variables: tuple[str, ...] = ()
    """Variables the platform sets per node that torchrun's workers read per process
    (``RANK``, ``WORLD_SIZE``): removed before the workers start."""
    elastic_nodes: tuple[int, int] | None = None
    """(MIN, MAX) when the platform runs an elastic job (``PET_NNODES=MIN:MAX``)."""
    node_rank_unknown: bool = False
    """The platform gave no node rank (an elastic PyTorchJob numbers nodes at rendezvous)."""


def _no_endpoint(options: SubmitConfig) -> str | None:
    return None


@dataclass(frozen=True)
class Platform:
    """One submit platform's facts. Every field is read by some other module."""

    name: str
    """``--platform`` value, first part of a job reference, ``SKYLIFT_PLATFORM`` inside its jobs."""
    title: str
    """Display name in messages (``AWS SageMaker``)."""
    module: str
    """The module with ``problems``, ``build``, ``send``, ``status``, ``logs``, ``stop`` (its own ``__name__``)."""
    elastic_note: Callable[[ElasticNodes, int, SubmitConfig], str]
    """The dry-run line for an elastic job (``distributed.nodes``) of this many nodes."""
    detect_topology: Callable[[Mapping[str, str], Path], PlatformTopology | None]
    """A node's topology from the environment and files (under the given filesystem root) this
    platform gives its jobs; ``None`` when they are not its."""
    detect_order: int
    """Detectors run in this order: a platform with its own markers before one whose
    variables (``MASTER_ADDR``, ``RANK``) any launcher may set."""
    aliases: tuple[str, ...] = ()
    """Other ``--platform`` spellings (``kubernetes`` for ``k8s``)."""
    endpoint: Callable[[SubmitConfig], str | None] = _no_endpoint
    """The endpoint (Kubernetes: kube context) the follow-up calls (status, logs, stop) use."""
    stop_grace_s: float | None = None
    """Seconds the platform gives between SIGTERM and SIGKILL when it fixes them itself
    (SageMaker); ``None`` where skylift sets them in the request."""
    request_format: Literal["json", "yaml"] = "json"
    """How ``--dry-run`` prints the request: an API body (JSON) or a manifest (YAML)."""


_platforms: dict[str, Platform] = {}
_scanned = threading.Event()
_lock = threading.RLock()


def register_platform(platform: Platform, *, replace: bool = False) -> Platform:
    """Add a platform that lives outside this package (a plugin's module, a test's).

    Raises:
        ValueError: its name or an alias is taken and ``replace`` is false.
    """
    with _lock:
        _scan()
        spellings = {platform.name, *platform.aliases}
        for other in _platforms.values():
            if replace and other.name == platform.name:
                continue
            if spellings & {other.name, *other.aliases}:
                raise ValueError(f"platform {platform.name!r} clashes with the registered {other.name!r}")
        _platforms[platform.name] = platform
    return platform


def unregister_platform(name: str) -> None:
    with _lock:
        _platforms.pop(name, None)


def _scan() -> None:
    """Import every module of :mod:`skylift.submit` that declares ``PLATFORM``, once."""
    with _lock:
        if _scanned.is_set():
            return
        _scanned.set()
        package = importlib.import_module("skylift.submit")
        for module_info in sorted(pkgutil.iter_modules(package.__path__), key=lambda info: info.name):
            if module_info.name.startswith("_") or module_info.ispkg:
                continue
            platform = getattr(importlib.import_module(f"skylift.submit.{module_info.name}"), "PLATFORM", None)
            if isinstance(platform, Platform):
                _platforms.setdefault(platform.name, platform)


def platforms() -> tuple[Platform, ...]:
    """Every registered platform, in name order."""
    with _lock:
        _scan()
        return tuple(sorted(_platforms.values(), key=lambda platform: platform.name))


def platform_names(*, with_aliases: bool = False) -> list[str]:
    return [spelling for platform in platforms()
            for spelling in (platform.name, *(platform.aliases if with_aliases else ()))]  # fmt: skip


def resolve_platform(name: str) -> str:
    """The platform's own name for ``name`` or one of its aliases.

    Raises:
        SkyliftConfigError: no platform is called that.
    """
    for platform in platforms():
        if name == platform.name or name in platform.aliases:
            return platform.name
    raise SkyliftConfigError(f"--platform {name!r} is not one of {', '.join(platform_names(with_aliases=True))}")


def platform_info(name: str) -> Platform:
    """The registered platform called ``name`` (or an alias of it)."""
    resolved = resolve_platform(name)
    with _lock:
        return _platforms[resolved]

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
        if platform not in platform_names() or not job_id:
            raise SkyliftConfigError(
                f"job {text!r} is not PLATFORM:LOCATION:ID with PLATFORM one of {', '.join(platform_names())}",
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
    return importlib.import_module(platform_info(name).module)


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
    return SkyliftConfigError(f"no {platform_info(platform).title} credentials were found", hint=how)


class PlatformError(SkyliftError):
    """The platform refused or failed a call; the text is the platform's own answer, redacted."""


@contextmanager
def vendor_errors(platform: str, *error_types: type[BaseException]) -> Iterator[None]:
    """Turn the vendor SDK's errors into :class:`PlatformError` naming the platform."""
    from skylift.cloud.redact import redact

    try:
        yield
    except error_types as error:
        raise PlatformError(f"{platform_info(platform).title}: {redact(str(error))}") from None


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
