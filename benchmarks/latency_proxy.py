"""A TCP proxy on 127.0.0.1 that delays the first byte of every response by a fixed latency.

Loopback answers in microseconds, which hides what makes object storage slow: every
request to a real store waits tens of milliseconds before its first byte. This proxy
puts that wait back. It relays bytes both ways unchanged; when the upstream starts
answering after the client has sent something (a request: HTTP/1.1 clients such as
urllib3 never pipeline), it sleeps ``latency_s`` before relaying that answer. Body
bytes then flow at loopback speed, so the latency is per request, not per byte.

Run it as its own process (``python -m benchmarks.latency_proxy --upstream-port P``)
so its CPU time stays out of the measured clients; it prints its port on one line.
Only 127.0.0.1 is ever bound or dialled.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys

__all__ = ["LatencyProxyProcess", "stop_process"]

LOOPBACK = "127.0.0.1"
_CHUNK_BYTES = 256 * 1024


class _Connection:
    """One client connection and its upstream twin; ``waiting`` means a request awaits its answer."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.waiting = False

    async def client_to_upstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(_CHUNK_BYTES):
            self.waiting = True
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()

    async def upstream_to_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(_CHUNK_BYTES):
            if self.waiting:
                self.waiting = False
                await asyncio.sleep(self.latency_s)  # first byte of this response
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()


async def _handle(
    client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter, upstream_port: int, latency_s: float
) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(LOOPBACK, upstream_port)
    except OSError:
        client_writer.close()
        return
    connection = _Connection(latency_s)
    try:
        await asyncio.gather(
            connection.client_to_upstream(client_reader, upstream_writer),
            connection.upstream_to_client(upstream_reader, client_writer),
        )
    except (ConnectionError, OSError):
        pass
    finally:
        for writer in (client_writer, upstream_writer):
            writer.close()


async def serve(upstream_port: int, latency_s: float, port: int = 0) -> None:
    server = await asyncio.start_server(
        lambda r, w: _handle(r, w, upstream_port, latency_s), LOOPBACK, port, backlog=256
    )
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class LatencyProxyProcess:
    """The proxy in a child process; ``endpoint_url`` is where clients connect."""

    def __init__(self, upstream_port: int, latency_s: float) -> None:
        self.latency_s = latency_s
        command = [sys.executable, "-m", "benchmarks.latency_proxy", "--upstream-port", str(upstream_port),
                   "--latency-s", str(latency_s)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.process.kill()
            raise RuntimeError(f"latency proxy did not start (said {line!r})")
        self.port = int(line)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def close(self) -> None:
        stop_process(self.process, timeout_s=5)


def stop_process(process: subprocess.Popen, *, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if it has not exited within ``timeout_s``."""
    process.terminate()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream-port", type=int, required=True)
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(args.upstream_port, args.latency_s, args.port))


if __name__ == "__main__":
    main()
