"""Open a page in headless Chromium over the DevTools protocol on a pipe (stdlib only).

``--remote-debugging-pipe`` speaks the protocol as NUL-terminated JSON on file
descriptors 3 (to the browser) and 4 (from it): no port, no websocket client. One
browser start gives the screenshot, the DOM after load, and every console message,
uncaught exception and browser log entry (a failed resource load, for example) with
its level. The ``--enable-logging`` stderr log cannot tell ``console.error`` from
``console.log``, so it is not used.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["PageResult", "chromium_path", "open_page"]

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "chrome")


def chromium_path() -> str | None:
    return next((path for name in CANDIDATES if (path := shutil.which(name))), None)


@dataclass
class PageResult:
    screenshot_png: bytes
    dom: str
    console: list[tuple[str, str]] = field(default_factory=list)
    """(level, text) of every console call, exception and log entry."""
    values: list[Any] = field(default_factory=list)
    """The value of each expression passed to :func:`open_page`, evaluated after load."""

    @property
    def errors(self) -> list[str]:
        return [text for level, text in self.console if level in ("error", "assert", "exception")]


class _Pipe:
    """The DevTools protocol over the browser's fds 3 and 4."""

    def __init__(self, to_browser: int, from_browser: int) -> None:
        self._out, self._in = to_browser, from_browser
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, params: dict | None = None, session: str | None = None, timeout_s: float = 30) -> dict:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._receive(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout_s: float = 30) -> dict:
        deadline = time.monotonic() + timeout_s
        for event in self.events:
            if event.get("method") == method:
                return event
        while True:
            event = self._receive(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    def _receive(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._in], [], [], left)[0]:
                raise TimeoutError("Chromium did not answer in time")
            chunk = os.read(self._in, 1 << 20)
            if not chunk:
                raise ConnectionError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)


def open_page(url: str, *, width: int = 1280, height: int = 900, full_page: bool = True,
              expressions: tuple[str, ...] = (), timeout_s: float = 60) -> PageResult:
    """Load ``url``, wait for its load event, return screenshot, DOM and console messages."""
    executable = chromium_path()
    if executable is None:
        raise FileNotFoundError("no Chromium on PATH")
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()
    # The browser's ends move above fd 9, so the shell's 3<& and 4>& cannot overwrite one another.
    to_browser_r, from_browser_w = _above_nine(to_browser_r), _above_nine(from_browser_w)
    with tempfile.TemporaryDirectory(prefix="skylift-chromium-") as profile:
        flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-extensions", "--hide-scrollbars", "--mute-audio", "--remote-debugging-pipe",
                 # The browser's own calls home (updates, sync, safe browsing) stay off.
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-default-apps", "--no-default-browser-check",
                 f"--user-data-dir={profile}", f"--window-size={width},{height}", "about:blank"]
        # bash (dash takes single-digit fds only) puts our pipe ends on fds 3 and 4, where the browser expects them.
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        browser = subprocess.Popen([*_without_network(), "bash", "-c", script, executable, *flags],
                                   pass_fds=(to_browser_r, from_browser_w),
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.close(to_browser_r)
        os.close(from_browser_w)
        pipe = _Pipe(to_browser_w, from_browser_r)
        try:
            return _visit(pipe, url, width, height, full_page, expressions, timeout_s)
        finally:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError, ConnectionError):
                pipe.call("Browser.close", timeout_s=5)
            os.close(to_browser_w)
            os.close(from_browser_r)
            try:
                browser.wait(timeout=10)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait()


def _without_network() -> list[str]:
    """A prefix that starts the browser in a network namespace of its own, where it can
    reach nothing (the suite's Python network guard does not see a native browser); empty
    where the namespace cannot be made (not root, no ``unshare``), with the flags above."""
    unshare = shutil.which("unshare")
    if unshare is None or os.geteuid() != 0:
        return []
    probe = subprocess.run([unshare, "--net", "true"], capture_output=True, timeout=10)
    return [unshare, "--net"] if probe.returncode == 0 else []


def _above_nine(fd: int) -> int:
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD, 10)
    os.close(fd)
    return moved


def _visit(pipe: _Pipe, url: str, width: int, height: int, full_page: bool, expressions: tuple[str, ...],
           timeout_s: float) -> PageResult:
    target = pipe.call("Target.createTarget", {"url": "about:blank"}, timeout_s=timeout_s)["targetId"]
    session = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    for domain in ("Runtime.enable", "Log.enable", "Page.enable"):
        pipe.call(domain, session=session)
    pipe.call("Emulation.setDeviceMetricsOverride",
              {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session=session)
    pipe.call("Page.navigate", {"url": url}, session=session)
    pipe.wait_for("Page.loadEventFired", timeout_s=timeout_s)
    values = [_evaluate(pipe, session, expression) for expression in ("document.documentElement.outerHTML", *expressions)]
    params: dict[str, Any] = {"format": "png"}
    if full_page:
        size = pipe.call("Page.getLayoutMetrics", session=session)["cssContentSize"]
        params.update(captureBeyondViewport=True,
                      clip={"x": 0, "y": 0, "width": width, "height": size["height"], "scale": 1})
    screenshot = base64.b64decode(pipe.call("Page.captureScreenshot", params, session=session)["data"])
    return PageResult(screenshot_png=screenshot, dom=values[0], console=_console(pipe.events), values=values[1:])


def _evaluate(pipe: _Pipe, session: str, expression: str) -> Any:
    reply = pipe.call("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session)
    if "exceptionDetails" in reply:
        raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
    return reply["result"].get("value")


def _console(events: list[dict[str, Any]]) -> list[tuple[str, str]]:
    messages = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(arg.get("value", arg.get("description", ""))) for arg in params.get("args", []))
            messages.append((params.get("type", "log"), text))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            messages.append(("exception", details.get("exception", {}).get("description", details.get("text", ""))))
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            messages.append((entry.get("level", "info"), f"{entry.get('source', '')}: {entry.get('text', '')}"))
    return messages
