"""What every vendor poller shares: one HTTP call, IMDSv2-style tokens, time parsing.

Metadata services live on link-local or private addresses, so requests here never go
through a proxy (``HTTP_PROXY`` would otherwise send them to the proxy, which cannot
reach them) and never follow redirects (a metadata answer that redirects is not one).
Only the standard library is used: the watcher runs inside the training process.
"""

from __future__ import annotations

import email.utils
import http.client
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone, tzinfo
from email.message import Message

__all__ = [
    "HttpResponse",
    "MetadataError",
    "TokenSession",
    "http_request",
    "is_transient",
    "parse_http_date_s",
    "parse_iso_time_s",
]

_MAX_BODY_BYTES = 64 * 1024
"""Notices are a few hundred bytes; anything bigger is not a metadata answer."""


_STALE_TOKEN_STATUSES = frozenset({401, 403})


class MetadataError(Exception):
    """The metadata service answered, but not as its vendor documents (not transient)."""


@dataclass(frozen=True)
class HttpResponse:
    """A finished exchange with any status below 500 (5xx raise, being transient)."""

    status: int
    headers: Message
    """Looked up by name in any case, as HTTP's are."""
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace").strip()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: object, **kwargs: object) -> None:
        return None  # urllib then raises HTTPError(3xx), returned to the caller as a status


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


def http_request(
    url: str, *, timeout_s: float, method: str = "GET", headers: Mapping[str, str] | None = None
) -> HttpResponse:
    """One request without proxies or redirects.

    Returns:
        The response for any status below 500, so callers can branch on 404 or 401.

    Raises:
        urllib.error.HTTPError: for 5xx. ``OSError`` / ``http.client.HTTPException``
        for refused, dropped or timed-out connections. All three are transient.
    """
    data = b"" if method == "PUT" else None
    request = urllib.request.Request(url, data=data, headers=dict(headers or {}), method=method)
    try:
        with _OPENER.open(request, timeout=timeout_s) as response:
            return HttpResponse(response.status, response.headers, response.read(_MAX_BODY_BYTES))
    except urllib.error.HTTPError as error:
        if error.code >= 500:
            raise
        with error:
            return HttpResponse(error.code, error.headers, error.read(_MAX_BODY_BYTES))


def is_transient(error: BaseException) -> bool:
    """True for failures worth retrying on the next poll: 5xx, refused, dropped, timed out."""
    if isinstance(error, urllib.error.HTTPError):
        return error.code >= 500
    return isinstance(error, (urllib.error.URLError, OSError, http.client.HTTPException))


class TokenSession:
    """IMDSv2-style session tokens (AWS, and Alibaba Cloud's hardened mode).

    A token comes from ``PUT token_path`` with a TTL header and rides on every GET in
    ``token_header``. It is cached per base URL until ``refresh_margin_s`` before its
    TTL runs out. A 401 means it expired early (or the service restarted), so the
    token is fetched again and the GET retried once; so is a 403, the status Alibaba
    Cloud may give instead (it documents none for a stale token).
    """

    def __init__(self, *, token_path: str, ttl_header: str, token_header: str, ttl_s: int) -> None:
        self.token_path = token_path
        self.ttl_header = ttl_header
        self.token_header = token_header
        self.ttl_s = ttl_s
        self.refresh_margin_s = min(60.0, ttl_s / 10)
        self._tokens: dict[str, tuple[str, float]] = {}  # base_url -> (token, expires at monotonic)
        self._lock = threading.Lock()

    def get(self, base_url: str, path: str, *, timeout_s: float) -> HttpResponse:
        """``GET base_url + path`` carrying a valid token; refetches it once on 401."""
        response = self._get_with(self._token(base_url, timeout_s), base_url, path, timeout_s)
        if response.status not in _STALE_TOKEN_STATUSES:
            return response
        with self._lock:
            self._tokens.pop(base_url, None)
        return self._get_with(self._token(base_url, timeout_s), base_url, path, timeout_s)

    def _get_with(self, token: str, base_url: str, path: str, timeout_s: float) -> HttpResponse:
        return http_request(base_url + path, timeout_s=timeout_s, headers={self.token_header: token})

    def _token(self, base_url: str, timeout_s: float) -> str:
        with self._lock:
            cached = self._tokens.get(base_url)
        if cached is not None and time.monotonic() < cached[1]:
            return cached[0]
        fetched_at = time.monotonic()
        response = http_request(
            base_url + self.token_path,
            method="PUT",
            timeout_s=timeout_s,
            headers={self.ttl_header: str(self.ttl_s)},
        )
        if response.status != 200 or not response.text:
            raise MetadataError(f"PUT {self.token_path} answered {response.status}, not a token")
        with self._lock:
            self._tokens[base_url] = (response.text, fetched_at + self.ttl_s - self.refresh_margin_s)
        return response.text


def parse_iso_time_s(text: str, *, naive_tz: tzinfo = timezone.utc) -> float | None:
    """``2026-11-29T18:07:51Z`` or ``2026-11-29 18:07:51`` to epoch seconds; None if unparsable.

    ``naive_tz`` is the zone a vendor documents for times written without one.
    """
    text = text.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"  # fromisoformat accepts "Z" only from Python 3.11
    try:
        parsed = datetime.fromisoformat(text)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=naive_tz)
    return parsed.timestamp()


def parse_http_date_s(text: str) -> float | None:
    """RFC 1123 (``Mon, 19 Sep 2016 18:29:47 GMT``) to epoch seconds; None if unparsable."""
    try:
        parsed = email.utils.parsedate_to_datetime(text.strip())
    except (TypeError, ValueError, IndexError):
        return None
    if parsed.tzinfo is None:  # "-0000" means UTC with no zone stated
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.timestamp()
