"""A loopback HTTP server that records each request and answers from a script.

Vendor SDK clients are pointed at it, so their real request building and signing
run and nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import http.server
import json
from collections.abc import Callable
from dataclasses import dataclass

from tests.servers import LoopbackHTTP


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        return json.loads(self.body or b"{}")


Responder = Callable[[Recorded], tuple[int, dict]]


class RecordingServer(LoopbackHTTP):
    """``answer`` maps a recorded request to (status, JSON body)."""

    def __init__(self, answer: Responder) -> None:
        self.requests: list[Recorded] = []
        self.answer = answer
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                recorded = Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                                    self.rfile.read(length) if length else b"")
                server.requests.append(recorded)
                status, payload = server.answer(recorded)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _serve

        self._serve_forever(Handler)

    @property
    def endpoint(self) -> str:
        return self.endpoint_url
