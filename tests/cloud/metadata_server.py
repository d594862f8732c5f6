"""A loopback stand-in for the five clouds' metadata services, strict like the real ones.

One ``ThreadingHTTPServer`` on 127.0.0.1 (port 0) speaks every vendor's paths at once:

* AWS IMDSv2 only: ``PUT /latest/api/token`` needs ``X-aws-ec2-metadata-token-ttl-seconds``
  (400 without); every GET needs a token issued that way (401 otherwise).
* GCP: requests need ``Metadata-Flavor: Google`` (403 without); answers carry it back,
  unless ``gcp_spoofed`` is set to play an impostor.
* Azure: requests need ``Metadata: true`` and an ``api-version`` (400 without).
* Alibaba Cloud in security-hardening mode: tokens as AWS, with its own header names.
* Tencent Cloud: no headers; times in UTC+8 without a zone, as documented.

A client bug in headers or token flow therefore fails the test rather than passing
silently. ``arm`` publishes a notice, ``fail_next`` injects 503s or dropped
connections, ``expire_tokens`` forces the 401 path.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import parse_qs, urlsplit

__all__ = ["MetadataServer", "Recorded"]

VM_NAME = "skylift-vm-0"
_TOKEN_TTL_HEADERS = {
    "aws": "X-aws-ec2-metadata-token-ttl-seconds",
    "aliyun": "X-aliyun-ecs-metadata-token-ttl-seconds",
}
_TOKEN_HEADERS = {"aws": "X-aws-ec2-metadata-token", "aliyun": "X-aliyun-ecs-metadata-token"}
_UTC_PLUS_8 = timezone(timedelta(hours=8))

Reply = tuple[int, dict[str, str], str]


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    status: int


@dataclass(frozen=True)
class _Armed:
    kind: str
    deadline_s: float
    resources: tuple[str, ...]


class MetadataServer:
    """Start with ``with MetadataServer() as server:``; ``server.url`` is the endpoint."""

    def __init__(self) -> None:
        self.gcp_spoofed = False
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._armed: dict[str, _Armed] = {}
        self._tokens: dict[str, str] = {}  # token -> cloud that issued it
        self._failures_left = 0
        self._failure_mode: Literal["503", "drop"] = "503"
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.fake = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-metadata", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> MetadataServer:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def arm(
        self, cloud: str, *, kind: str = "spot-termination", deadline_in_s: float = 90.0,
        resources: tuple[str, ...] = (VM_NAME,),
    ) -> float:
        """Publish a notice; returns the deadline a correct client must report.

        Times are whole seconds, as the vendors write them. GCP states no time, so its
        expected deadline is the 30 s window from now. ``kind`` is
        ``"spot-termination"``, ``"rebalance"`` (AWS) or ``"maintenance"`` (GCP, Azure).
        ``resources`` are the VM names an Azure event lists.
        """
        deadline_s = float(int(time.time() + deadline_in_s))
        if cloud == "gcp":
            deadline_s = time.time() + 30.0
        elif kind == "rebalance":
            deadline_s = time.time() + 120.0
        with self._lock:
            self._armed[cloud] = _Armed(kind, deadline_s, resources)
        return deadline_s

    def fail_next(self, count: int, *, mode: Literal["503", "drop"] = "503") -> None:
        """The next ``count`` requests get a 503 or a connection closed without an answer."""
        with self._lock:
            self._failures_left, self._failure_mode = count, mode

    def expire_tokens(self) -> None:
        """Forget every token issued, as a TTL running out or a host restart would."""
        with self._lock:
            self._tokens.clear()

    def count(self, method: str, path: str, status: int | None = None) -> int:
        with self._lock:
            return sum(
                1 for r in self.requests
                if r.method == method and r.path == path and (status is None or r.status == status)
            )

    # -- request handling (server threads) --

    def take_failure(self) -> str | None:
        with self._lock:
            if self._failures_left <= 0:
                return None
            self._failures_left -= 1
            return self._failure_mode

    def record(self, method: str, path: str, status: int) -> None:
        with self._lock:
            self.requests.append(Recorded(method, path, status))

    def route(self, method: str, target: str, headers: dict[str, str]) -> Reply:
        path = urlsplit(target).path
        if path == "/latest/api/token":
            return self._issue_token(method, headers)
        if path.startswith("/computeMetadata/"):
            return self._gcp(path, headers)
        if path.startswith("/metadata/"):
            return self._azure(path, parse_qs(urlsplit(target).query), headers)
        if path == "/latest/meta-data/instance/spot/termination-time":
            return self._aliyun(headers)
        if path == "/latest/meta-data/spot/termination-time":
            return self._tencent()
        if path.startswith("/latest/meta-data/"):
            return self._aws(path, headers)
        return 404, {}, "not found"

    def _issue_token(self, method: str, headers: dict[str, str]) -> Reply:
        if method != "PUT":
            return 405, {}, "tokens are issued by PUT only"
        for cloud, ttl_header in _TOKEN_TTL_HEADERS.items():
            ttl = headers.get(ttl_header.lower(), "")
            if ttl.isdigit() and 1 <= int(ttl) <= 21600:
                token = secrets.token_urlsafe(16)
                with self._lock:
                    self._tokens[token] = cloud
                return 200, {ttl_header: ttl}, token
        return 400, {}, "missing or invalid TTL header"

    def _has_token(self, cloud: str, headers: dict[str, str]) -> bool:
        token = headers.get(_TOKEN_HEADERS[cloud].lower(), "")
        with self._lock:
            return self._tokens.get(token) == cloud

    def _armed_for(self, cloud: str) -> _Armed | None:
        with self._lock:
            return self._armed.get(cloud)

    def _aws(self, path: str, headers: dict[str, str]) -> Reply:
        if not self._has_token("aws", headers):
            return 401, {}, "Unauthorized"
        armed = self._armed_for("aws")
        iso = datetime.fromtimestamp(armed.deadline_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ") if armed else ""
        if path == "/latest/meta-data/spot/instance-action" and armed and armed.kind == "spot-termination":
            return 200, {"Content-Type": "text/plain"}, json.dumps({"action": "terminate", "time": iso})
        if path == "/latest/meta-data/events/recommendations/rebalance" and armed and armed.kind == "rebalance":
            return 200, {"Content-Type": "text/plain"}, json.dumps({"noticeTime": iso})
        return 404, {}, "Not Found"

    def _gcp(self, path: str, headers: dict[str, str]) -> Reply:
        if headers.get("metadata-flavor") != "Google":
            return 403, {}, "Missing Metadata-Flavor:Google header."
        reply_headers = {} if self.gcp_spoofed else {"Metadata-Flavor": "Google"}
        armed = self._armed_for("gcp")
        if path == "/computeMetadata/v1/instance/preempted":
            preempted = armed is not None and armed.kind == "spot-termination"
            return 200, reply_headers, "TRUE" if preempted else "FALSE"
        if path == "/computeMetadata/v1/instance/maintenance-event":
            maintenance = armed is not None and armed.kind == "maintenance"
            return 200, reply_headers, "TERMINATE_ON_HOST_MAINTENANCE" if maintenance else "NONE"
        return 404, reply_headers, "not found"

    def _azure(self, path: str, query: dict[str, list[str]], headers: dict[str, str]) -> Reply:
        if headers.get("metadata") != "true" or "api-version" not in query:
            return 400, {}, json.dumps({"error": "Bad request. Required metadata header not specified"})
        if path == "/metadata/instance/compute/name" and query.get("format") == ["text"]:
            return 200, {}, VM_NAME
        if path != "/metadata/scheduledevents":
            return 404, {}, "not found"
        armed = self._armed_for("azure")
        events = [] if armed is None else [{
            "EventId": "602d9444-d2cd-49c7-8624-8643e7171297",
            "EventType": "Preempt" if armed.kind == "spot-termination" else "Terminate",
            "ResourceType": "VirtualMachine",
            "Resources": list(armed.resources),
            "EventStatus": "Scheduled",
            "NotBefore": formatdate(armed.deadline_s, usegmt=True),
            "Description": "", "EventSource": "Platform", "DurationInSeconds": -1,
        }]
        return 200, {"Content-Type": "application/json"}, json.dumps({"DocumentIncarnation": 1, "Events": events})

    def _aliyun(self, headers: dict[str, str]) -> Reply:
        if not self._has_token("aliyun", headers):
            return 401, {}, "Unauthorized"
        armed = self._armed_for("aliyun")
        if armed is None:
            return 404, {}, "Not Found"
        return 200, {}, datetime.fromtimestamp(armed.deadline_s, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")

    def _tencent(self) -> Reply:
        armed = self._armed_for("tencent")
        if armed is None:
            return 404, {}, "Not Found"
        return 200, {}, datetime.fromtimestamp(armed.deadline_s, _UTC_PLUS_8).strftime("%Y-%m-%d %H:%M:%S")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._serve("GET")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass

    def _serve(self, method: str) -> None:
        fake: MetadataServer = self.server.fake  # type: ignore[attr-defined]
        failure = fake.take_failure()
        if failure == "drop":
            fake.record(method, self.path, 0)
            self.close_connection = True
            return
        headers = {name.lower(): value for name, value in self.headers.items()}
        if failure:
            status, reply_headers, body = 503, {}, "Service Unavailable"
        else:
            status, reply_headers, body = fake.route(method, self.path, headers)
        fake.record(method, self.path, status)
        payload = body.encode()
        self.send_response(status)
        for name, value in {"Content-Length": str(len(payload)), **reply_headers}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(payload)
