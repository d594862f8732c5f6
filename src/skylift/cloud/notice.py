"""Preemption notices: the record, cloud detection, the polling thread, signal handlers.

A spot machine is taken back with a short warning published on its metadata service.
:class:`NoticeWatcher` polls that service on a daemon thread and hands the first
notice to a callback, so the trainer can stop at a step boundary and save in time.
:func:`watch_signals` covers the other path, a SIGTERM or SIGUSR1 sent by a launcher,
kubelet or node agent. Vendor protocols and facts live in one module per cloud,
gathered by :mod:`skylift.cloud.vendors`.

Nothing here may crash or stall training: failed polls are logged and retried, and
detection reads local DMI files only, never the network.
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Literal

from skylift.cloud._protocol import is_transient
from skylift.cloud.vendors import check_cloud, cloud_vendor, cloud_vendors
from skylift.errors import SkyliftConfigError

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11's; this stays an annotation

__all__ = [
    "DEFAULT_SIGNAL_GRACE_S",
    "NOTICE_WINDOW_S",
    "RELAYED_NOTICE_VARIABLE",
    "NoticeKind",
    "NoticeWatcher",
    "Poller",
    "PreemptionNotice",
    "detect_cloud",
    "load_poller",
    "metadata_base_url",
    "new_notice",
    "notice_window_s",
    "watch_signals",
]

log = logging.getLogger("skylift.cloud")

NoticeKind = Literal["spot-termination", "rebalance", "maintenance", "signal"]

DEFAULT_SIGNAL_GRACE_S = 30.0
"""Signal deadline off any known cloud: Kubernetes' default terminationGracePeriodSeconds."""

RELAYED_NOTICE_VARIABLE = "SKYLIFT_RELAYED_NOTICE"
"""A file where ``skylift launch`` writes the cloud notice it turned into the workers'
SIGTERM: a worker's signal handler reports that notice (its deadline) instead of a
guessed window."""

DMI_DIR = Path("/sys/class/dmi/id")

_WARN_AFTER_FAILURES = 12
"""Consecutive failed polls before a warning: a metadata service that never answers
(an IMDSv2 hop limit of 1 inside a container, say) must not stay silent."""


@dataclass(frozen=True)
class PreemptionNotice:
    """Warning that this machine goes away at ``deadline_s``.

    Times are ``time.time()`` seconds. ``deadline_s`` comes from the notice when the
    vendor states one, else ``received_at_s`` plus the cloud's documented window.
    """

    cloud: str
    kind: NoticeKind
    detail: str
    received_at_s: float
    deadline_s: float | None

    def seconds_left(self, now_s: float | None = None) -> float | None:
        """Seconds until the deadline (negative once past); None without a deadline."""
        if self.deadline_s is None:
            return None
        return self.deadline_s - (time.time() if now_s is None else now_s)


Poller = Callable[[str, float], "PreemptionNotice | None"]


class _NoticeWindows(Mapping[str, float]):
    """Cloud name to its notice window, read from the registry on every access (so a cloud
    registered later is in it). Kept for callers that look a window up by name
    (``skylift.launch``); new code calls :func:`notice_window_s`."""

    def __getitem__(self, cloud: str) -> float:
        vendor = cloud_vendor(cloud)
        if vendor is None:
            raise KeyError(cloud)
        return vendor.notice_window_s

    def __iter__(self) -> Iterator[str]:
        return iter([vendor.name for vendor in cloud_vendors()])

    def __len__(self) -> int:
        return len(cloud_vendors())


NOTICE_WINDOW_S: Mapping[str, float] = _NoticeWindows()


def notice_window_s(cloud: str | None) -> float:
    """Seconds the cloud documents between a notice and the stop; ``DEFAULT_SIGNAL_GRACE_S`` off any known cloud."""
    vendor = cloud_vendor(cloud) if cloud else None
    return DEFAULT_SIGNAL_GRACE_S if vendor is None else vendor.notice_window_s


def new_notice(cloud: str, kind: NoticeKind, detail: str, deadline_s: float | None = None) -> PreemptionNotice:
    """A notice received now; without a stated deadline, the cloud's window from now."""
    now_s = time.time()
    if deadline_s is None:
        deadline_s = now_s + notice_window_s(cloud)
    return PreemptionNotice(cloud=cloud, kind=kind, detail=detail, received_at_s=now_s, deadline_s=deadline_s)


def _check_cloud(cloud: str, source: str) -> str:
    return check_cloud(cloud, source).name


def detect_cloud(*, dmi_dir: Path | None = None) -> str | None:
    """The cloud this machine runs on, from ``SKYLIFT_CLOUD`` or local DMI data.

    Reads files only: probing metadata addresses would hang for the connect timeout
    on every laptop and touch the network where there may be none.

    Args:
        dmi_dir: where the DMI files live (tests point this at a temporary folder).

    Returns:
        A registered cloud's name (:func:`skylift.cloud.vendors.cloud_names`), or None.

    Raises:
        SkyliftConfigError: (a ``ValueError``) ``SKYLIFT_CLOUD`` names no known cloud.

    Example:
        >>> detect_cloud()  # on an EC2 instance, SKYLIFT_CLOUD unset
        'aws'
    """
    forced = os.environ.get("SKYLIFT_CLOUD", "").strip().lower()
    if forced:
        return _check_cloud(forced, "SKYLIFT_CLOUD")
    folder = DMI_DIR if dmi_dir is None else dmi_dir
    for vendor in cloud_vendors():
        for name, needle in vendor.dmi_signatures:
            try:
                text = (folder / name).read_text(errors="replace")
            except OSError:
                continue
            if needle.lower() in text.lower():
                return vendor.name
    return None


def metadata_base_url(cloud: str) -> str:
    """``scheme://host[:port]`` of the cloud's metadata service, without a trailing slash.

    ``SKYLIFT_METADATA_ENDPOINT`` (e.g. ``http://127.0.0.1:8080``) replaces the host
    for every cloud; paths, headers and token flow stay the vendor's.
    """
    vendor = check_cloud(cloud, "cloud")
    override = os.environ.get("SKYLIFT_METADATA_ENDPOINT", "").strip()
    if not override:
        return vendor.metadata_host
    if not override.startswith(("http://", "https://")):
        raise SkyliftConfigError(f"SKYLIFT_METADATA_ENDPOINT={override!r} must start with http:// or https://")
    return override.rstrip("/")


def load_poller(cloud: str) -> Poller:
    """The vendor module's ``poll`` function, imported on first use."""
    module = importlib.import_module(check_cloud(cloud, "cloud").poll_module)
    return module.poll


class NoticeWatcher:
    """Polls the metadata service on a daemon thread and reports a notice once.

    The first ``spot-termination`` or ``maintenance`` notice is passed to ``on_notice``
    and the thread ends. A ``rebalance`` (AWS's early, deadline-free warning) is
    passed once and polling goes on, so the real two-minute notice still arrives.
    ``on_notice`` runs on the watcher thread: it should be quick and thread-safe
    (set an ``Event``, say). On a machine where no cloud is detected the watcher
    starts nothing.

    Example:
        >>> with NoticeWatcher(lambda n: stop.set(), cloud="aws") as watcher:
        ...     train()
    """

    def __init__(
        self,
        on_notice: Callable[[PreemptionNotice], object],
        *,
        cloud: str | None = None,
        poll_interval_s: float | None = None,
        request_timeout_s: float = 1.0,
        join_timeout_s: float = 3.0,
    ) -> None:
        if (poll_interval_s is not None and poll_interval_s <= 0) or request_timeout_s <= 0:
            raise ValueError("NoticeWatcher: poll_interval_s and request_timeout_s must be positive")
        self.on_notice = on_notice
        self.cloud = detect_cloud() if cloud is None else _check_cloud(cloud, "cloud")
        vendor = cloud_vendor(self.cloud) if self.cloud else None
        default_interval_s = vendor.poll_interval_s if vendor is not None else 5.0
        self.poll_interval_s = default_interval_s if poll_interval_s is None else poll_interval_s
        self.request_timeout_s = request_timeout_s
        self.join_timeout_s = join_timeout_s
        self.notice: PreemptionNotice | None = None
        """The latest notice delivered, for callers that prefer to check than be called."""
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._failures_in_a_row = 0

    def start(self) -> Self:
        """Start polling. Endpoint and vendor module are resolved here, so errors raise here."""
        if self.cloud is None:
            log.info("no cloud detected (set SKYLIFT_CLOUD to force one); not watching for preemption")
            return self
        if self._thread is not None:
            raise RuntimeError("NoticeWatcher.start() called twice")
        poll, base_url = load_poller(self.cloud), metadata_base_url(self.cloud)
        self._thread = threading.Thread(
            target=self._run, args=(poll, base_url), name=f"skylift-notice-{self.cloud}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling and wait up to ``join_timeout_s`` for the thread (safe from ``on_notice``)."""
        self._stop_event.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.join_timeout_s)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self, poll: Poller, base_url: str) -> None:
        delivered_kinds: set[str] = set()
        while not self._stop_event.is_set():
            notice = self._poll_once(poll, base_url)
            if self._stop_event.is_set():  # stop() came during the poll: the caller has moved on
                return
            if notice is not None and notice.kind not in delivered_kinds:
                delivered_kinds.add(notice.kind)
                self._deliver(notice)
                if notice.kind != "rebalance":
                    return
            self._stop_event.wait(self.poll_interval_s)

    def _poll_once(self, poll: Poller, base_url: str) -> PreemptionNotice | None:
        try:
            notice = poll(base_url, self.request_timeout_s)
        except Exception as error:  # noqa: BLE001 - any failure is retried: this thread must outlive it
            self._report_failure(error, base_url)
            return None
        self._failures_in_a_row = 0
        return notice

    def _report_failure(self, error: Exception, base_url: str) -> None:
        self._failures_in_a_row += 1
        transient = is_transient(error)
        message = "%s metadata poll at %s failed (%d in a row): %r"
        args = (self.cloud, base_url, self._failures_in_a_row, error)
        if (not transient and self._failures_in_a_row == 1) or self._failures_in_a_row == _WARN_AFTER_FAILURES:
            log.warning(message + "; still polling", *args)
        else:
            log.debug(message, *args)

    def _deliver(self, notice: PreemptionNotice) -> None:
        self.notice = notice
        log.warning(
            "preemption notice from %s: %s (%s), %.0f s left",
            notice.cloud, notice.kind, notice.detail, notice.seconds_left() or 0.0,
        )
        try:
            self.on_notice(notice)
        except Exception:
            log.exception("preemption notice callback failed")


def watch_signals(
    on_notice: Callable[[PreemptionNotice], object],
    signals: Iterable[int] = (signal.SIGTERM, signal.SIGUSR1),
    *,
    grace_s: float | None = None,
) -> Callable[[], None]:
    """Turn SIGTERM/SIGUSR1 into ``kind="signal"`` notices; returns a restore function.

    Each signal calls ``on_notice`` (a second SIGTERM often means "now"), on the main
    thread between bytecodes, so the callback must be short. Existing handlers are
    replaced, not chained: SIGTERM no longer ends the process, so the caller must exit
    once it has saved.

    The deadline is the signal's arrival plus ``grace_s`` or, when None, the detected
    cloud's notice window (``DEFAULT_SIGNAL_GRACE_S`` off-cloud). Pass ``grace_s`` when
    you know who sends the signal: a SIGTERM from the OS shutdown at the end of a spot
    window leaves far less than the window.

    Raises:
        RuntimeError: not on the main thread (Python allows signal handlers only there).
        SkyliftConfigError: ``SKYLIFT_CLOUD`` names no known cloud.
    """
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("watch_signals() must be called from the main thread")
    cloud = detect_cloud() or "local"
    window_s = notice_window_s(cloud) if grace_s is None else grace_s

    def handle(signal_number: int, frame: FrameType | None) -> None:
        now_s = time.time()
        name = signal.Signals(signal_number).name
        relayed = _relayed_notice() if signal_number == signal.SIGTERM else None
        on_notice(relayed or PreemptionNotice(cloud, "signal", name, received_at_s=now_s, deadline_s=now_s + window_s))

    previous = {number: signal.signal(number, handle) for number in signals}

    def restore() -> None:
        while previous:
            number, handler = previous.popitem()
            signal.signal(number, signal.SIG_DFL if handler is None else handler)

    return restore


def _relayed_notice() -> PreemptionNotice | None:
    """The notice the launcher relayed as this SIGTERM, if it wrote one (see
    :data:`RELAYED_NOTICE_VARIABLE`); None for any other SIGTERM."""
    import json

    path = os.environ.get(RELAYED_NOTICE_VARIABLE)
    if not path:
        return None
    try:
        record = json.loads(Path(path).read_text())
        return PreemptionNotice(record["cloud"], record["kind"], record["detail"],
                                received_at_s=float(record["received_at_s"]), deadline_s=record["deadline_s"])
    except (OSError, ValueError, KeyError, TypeError):  # no notice relayed: a plain SIGTERM
        return None
