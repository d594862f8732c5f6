"""S3 clients: one boto3 session per credential environment, and no connection shared
with a parent after a fork (DataLoader workers are forked)."""

from __future__ import annotations

import http.server
import os
import threading

import pytest

from skylift.storage import open_store
from tests.servers import S3_ENVIRONMENT


class _KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with the same object over HTTP/1.1 keep-alive, noting the client port."""

    protocol_version = "HTTP/1.1"
    ports: list[int] = []

    def do_GET(self):
        self.ports.append(self.client_address[1])
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("ETag", '"5d41402abc4b2a76b9719d911017c592"')
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def keep_alive_server(monkeypatch):
    for name, value in S3_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    _KeepAliveHandler.ports = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAliveHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_forked_child_opens_its_own_connection(keep_alive_server):
    store = open_store("s3://bucket-x/run", endpoint_url=keep_alive_server)
    assert store.read_bytes("key") == b"hello"
    assert store.read_bytes("key") == b"hello"
    parent_ports = set(_KeepAliveHandler.ports)
    assert len(parent_ports) == 1, "the parent keeps its connection alive"

    child = os.fork()
    if child == 0:
        try:
            os._exit(0 if store.read_bytes("key") == b"hello" else 3)
        except BaseException:
            os._exit(4)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    child_port = _KeepAliveHandler.ports[-1]
    assert child_port not in parent_ports, "the child wrote into the parent's socket"
    assert store.read_bytes("key") == b"hello"  # the parent's connection still works
    assert _KeepAliveHandler.ports[-1] in parent_ports


def test_stores_share_a_session_per_credential_environment(keep_alive_server, monkeypatch):
    from skylift.storage import s3_clients

    monkeypatch.setattr(s3_clients, "_sessions", {})
    first = open_store("s3://bucket-x/a", endpoint_url=keep_alive_server)
    second = open_store("s3://bucket-x/b", endpoint_url=keep_alive_server)
    assert first._client is not second._client
    assert len(s3_clients._sessions) == 1
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAOTHEROTHEROTHER0")
    third = open_store("s3://bucket-x/c", endpoint_url=keep_alive_server)
    assert len(s3_clients._sessions) == 2
    assert third._client._request_signer._credentials.access_key == "AKIAOTHEROTHEROTHER0"
    assert first._client._request_signer._credentials.access_key != "AKIAOTHEROTHEROTHER0"
