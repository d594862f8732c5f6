"""Real servers on 127.0.0.1 for tests: a moto S3 server and a fault-injecting proxy.

Traffic never leaves the loopback interface.
"""

from __future__ import annotations

import http.client
import http.server
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

SENTINEL_KEY_ID = "AKIASENTINELKEYID0001"
SENTINEL_SECRET = "sentinel-secret-value-never-log-me-0001"
SENTINEL_TOKEN = "sentinel-session-token-never-log-me-0001"
S3_ENVIRONMENT = {
    "AWS_ACCESS_KEY_ID": SENTINEL_KEY_ID,
    "AWS_SECRET_ACCESS_KEY": SENTINEL_SECRET,
    "AWS_SESSION_TOKEN": SENTINEL_TOKEN,
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class MotoServer:
    """moto's S3 on 127.0.0.1; its state lives in this process, so it survives restarts."""

    def __init__(self) -> None:
        self.port = free_port()
        self._server = None

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> MotoServer:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

    def restart_after(self, down_s: float) -> threading.Thread:
        """Stop now and start again on the same port after ``down_s`` seconds."""
        self.stop()
        thread = threading.Thread(target=lambda: (time.sleep(down_s), self.start()), daemon=True)
        thread.start()
        return thread

    def reset(self) -> None:
        import boto3

        client = boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1")
        for bucket in client.list_buckets().get("Buckets", []):
            objects = client.list_objects_v2(Bucket=bucket["Name"]).get("Contents", [])
            if objects:
                client.delete_objects(Bucket=bucket["Name"], Delete={"Objects": [{"Key": o["Key"]} for o in objects]})
            client.delete_bucket(Bucket=bucket["Name"])

    def create_bucket(self, name: str) -> None:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint_url, region_name="us-east-1").create_bucket(Bucket=name)


class LoopbackHTTP:
    """A threading HTTP server on 127.0.0.1 (a free port), served from a daemon thread."""

    def _serve_forever(self, handler: type[http.server.BaseHTTPRequestHandler]) -> None:
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class FaultyProxy(LoopbackHTTP):
    """An HTTP proxy on 127.0.0.1 in front of ``upstream_port`` that injects faults.

    ``fail(n, status)`` answers the next n requests with an error status (with
    ``when``, the next n requests for which ``when(method, path)`` is true),
    ``drop(n)`` closes the next n connections without answering (``drop_every()``: every
    one from now on, a dead server), ``truncate(n)`` sends only half of the next n
    response bodies.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.faults: deque[tuple[str, int, Callable[[str, str], bool] | None]] = deque()
        self._faults_lock = threading.Lock()
        self.dropping_every = False
        self.requests_seen = 0
        self.faults_injected = 0
        self.answered: list[tuple[str, str, int]] = []
        """(method, path, body bytes) of each request relayed, in order."""
        self.statuses: list[int] = []
        """The upstream's status for each of :attr:`answered`, in the same order."""
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                proxy.requests_seen += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                fault = proxy.take_fault(self.command, self.path)
                if fault and fault[0] == "drop":
                    proxy.faults_injected += 1
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault and fault[0] == "status":
                    proxy.faults_injected += 1
                    code = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}.get(fault[1], "InternalError")
                    payload = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                    self.send_response(fault[1])
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                upstream.request(self.command, self.path, body=body, headers=dict(self.headers))
                response = upstream.getresponse()
                data = response.read()
                with proxy._faults_lock:  # the two lists stay in step across handler threads
                    proxy.statuses.append(response.status)
                    proxy.answered.append((self.command, self.path, len(data)))
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(name, value)
                # A HEAD's answer has no body: its length is the object's, as upstream gave it.
                length = response.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if fault and fault[0] == "truncate" and len(data) > 1:
                    proxy.faults_injected += 1
                    self.wfile.write(data[: len(data) // 2])
                    self.close_connection = True
                    return
                self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _relay

        self._serve_forever(Handler)

    def fail(self, count: int, status: int = 503, when: Callable[[str, str], bool] | None = None) -> None:
        self.faults.extend([("status", status, when)] * count)

    def drop(self, count: int) -> None:
        self.faults.extend([("drop", 0, None)] * count)

    def drop_every(self) -> None:
        """Close every connection from now on unanswered, pooled keep-alive ones too (closing
        the listener would spare those). A flag, not a count: ``drop(10**9)`` queued a billion
        entries, 8 GB of memory in the test's process."""
        self.dropping_every = True

    def truncate(self, count: int) -> None:
        self.faults.extend([("truncate", 0, None)] * count)

    def take_fault(self, method: str, path: str) -> tuple[str, int, object] | None:
        """The first queued fault that applies to this request, removed from the queue."""
        if self.dropping_every:
            return ("drop", 0, None)
        with self._faults_lock:
            for fault in self.faults:
                if fault[2] is None or fault[2](method, path):
                    self.faults.remove(fault)
                    return fault
        return None

