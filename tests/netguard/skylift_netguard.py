"""Refuse every connection and name lookup that would leave 127.0.0.0/8 and ::1.

The test suite installs this in its own process (``tests/conftest.py``) and, through
``sitecustomize.py`` beside this file on ``PYTHONPATH``, in every Python process a
test starts (the CLI, torchrun's workers, servers). A refused call raises
:class:`NetworkRefused` (an ``OSError``, so client code fails as it would on an
unreachable host) *and* is written down, so a library that swallows the error and
carries on (botocore falling back through its credential chain, an SDK's retry
loop) still fails the test: ``tests/conftest.py`` reads the record after each test.

What is checked, for IPv4 and IPv6 sockets: ``connect``, ``connect_ex``, ``sendto``
and ``sendmsg`` with an address; name lookups (``getaddrinfo``, ``gethostbyname``,
``gethostbyname_ex``, ``gethostbyaddr``) of anything but a numeric address, the
names of ``/etc/hosts`` that map to loopback, ``localhost`` and this machine's own
host name (a lookup of that one may go through nsswitch's ``myhostname`` or the
hosts file, and torch's elastic agent makes it). Unix and netlink sockets are not
network traffic and pass. Native code that opens sockets without Python (gloo,
c10d's TCPStore) is outside this guard: the project pins those to the loopback
address and interface itself.

``SKYLIFT_NETGUARD_LOG``: a folder; each refusal appends one line to a file named
after the process id there. ``SKYLIFT_NETGUARD_RECORD_ONLY=1``: the real
``connect`` and resolver beneath the guard are replaced by recorders that never
touch the network, for the guard's own tests.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["Guard", "NetworkRefused", "guarded_functions", "install", "is_loopback_address", "recorders"]

_LOG_ENV = "SKYLIFT_NETGUARD_LOG"
_RECORD_ONLY_ENV = "SKYLIFT_NETGUARD_RECORD_ONLY"
_INET_FAMILIES = (socket.AF_INET, socket.AF_INET6)


class NetworkRefused(OSError):
    """A test tried to reach past loopback."""


def is_loopback_address(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and IPv4-mapped loopback; False for names and others."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _is_numeric(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


def _loopback_names(hosts_file: str = "/etc/hosts") -> set[str]:
    """Names the hosts file maps to a loopback address (resolved from the file, no network)."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
    try:
        with open(hosts_file, encoding="utf-8") as handle:
            for line in handle:
                fields = line.split("#", 1)[0].split()
                if len(fields) >= 2 and is_loopback_address(fields[0]):
                    names.update(name.lower() for name in fields[1:])
    except OSError:
        pass
    return names


class Guard:
    """The checks, over replaceable real functions (so a test can put recorders there)."""

    def __init__(self, real: dict[str, Callable[..., Any]], log_dir: str | None = None) -> None:
        self.real = real
        self.log_dir = log_dir
        self.refusals: list[str] = []
        self._lock = threading.Lock()
        self._local_names = _loopback_names() | {socket.gethostname().lower()}

    def refuse(self, what: str) -> NetworkRefused:
        message = f"network guard: {what} would leave 127.0.0.0/8 (tests must use loopback endpoints)"
        with self._lock:
            self.refusals.append(message)
            if self.log_dir:
                os.makedirs(self.log_dir, exist_ok=True)
                with open(os.path.join(self.log_dir, f"{os.getpid()}.log"), "a", encoding="utf-8") as handle:
                    handle.write(message + "\n")
        return NetworkRefused(message)

    def name_allowed(self, host: Any) -> bool:
        if host is None:
            return True  # a passive (bind) lookup
        if isinstance(host, bytes):
            host = host.decode("ascii", "replace")
        host = str(host)
        if _is_numeric(host):
            return True  # no lookup happens; a connect to it is checked on its own
        name = host.rstrip(".").lower()
        return name in self._local_names or name.endswith(".localhost")

    def check_address(self, family: int, address: Any, operation: str) -> None:
        if family not in _INET_FAMILIES or address is None:
            return
        host = address[0] if isinstance(address, tuple) else address
        if isinstance(host, bytes):
            host = host.decode("ascii", "replace")
        if not is_loopback_address(str(host)):
            raise self.refuse(f"{operation} to {address!r}")

    def check_name(self, host: Any, operation: str) -> None:
        if not self.name_allowed(host):
            raise self.refuse(f"{operation}({host!r})")


def _guarded_socket_methods(guard: Guard) -> dict[str, Callable[..., Any]]:
    real = guard.real

    def connect(self: socket.socket, address: Any) -> None:
        guard.check_address(self.family, address, "connect")
        return real["connect"](self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        guard.check_address(self.family, address, "connect_ex")
        return real["connect_ex"](self, address)

    def sendto(self: socket.socket, data: Any, *args: Any) -> int:
        guard.check_address(self.family, args[-1] if args else None, "sendto")
        return real["sendto"](self, data, *args)

    def sendmsg(self: socket.socket, buffers: Any, ancdata: Any = (), flags: int = 0, address: Any = None) -> int:
        guard.check_address(self.family, address, "sendmsg")
        if address is None:
            return real["sendmsg"](self, buffers, ancdata, flags)
        return real["sendmsg"](self, buffers, ancdata, flags, address)

    return {"connect": connect, "connect_ex": connect_ex, "sendto": sendto, "sendmsg": sendmsg}


def _guarded_resolvers(guard: Guard) -> dict[str, Callable[..., Any]]:
    real = guard.real

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        guard.check_name(host, "getaddrinfo")
        return real["getaddrinfo"](host, *args, **kwargs)

    def gethostbyname(host: str) -> str:
        guard.check_name(host, "gethostbyname")
        return real["gethostbyname"](host)

    def gethostbyname_ex(host: str) -> Any:
        guard.check_name(host, "gethostbyname_ex")
        return real["gethostbyname_ex"](host)

    def gethostbyaddr(host: str) -> Any:
        guard.check_name(host, "gethostbyaddr")
        if _is_numeric(host) and not is_loopback_address(host):
            raise guard.refuse(f"gethostbyaddr({host!r})")  # a reverse lookup asks DNS
        return real["gethostbyaddr"](host)

    return {
        "getaddrinfo": getaddrinfo,
        "gethostbyname": gethostbyname,
        "gethostbyname_ex": gethostbyname_ex,
        "gethostbyaddr": gethostbyaddr,
    }


def guarded_functions(guard: Guard) -> dict[str, Callable[..., Any]]:
    """The socket methods and resolver functions that check before calling ``guard.real``."""
    return {**_guarded_socket_methods(guard), **_guarded_resolvers(guard)}


def recorders(calls: list[tuple[str, tuple]]) -> dict[str, Callable[..., Any]]:
    """Stand-ins for the real functions that only note the call and fail, sending nothing."""

    numeric_lookup = socket.getaddrinfo

    def recorder(name: str) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:
            calls.append((name, args[1:] if name in _SOCKET_METHODS else args))
            raise ConnectionRefusedError(f"recorded {name}; nothing was sent")

        return record

    def lookup_numeric_only(host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0, flags: int = 0):
        # AI_NUMERICHOST: the resolver parses a literal address and never asks DNS.
        calls.append(("getaddrinfo", (host, port)))
        return numeric_lookup(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)

    stand_ins = {name: recorder(name) for name in (*_SOCKET_METHODS, *_RESOLVERS)}
    stand_ins["getaddrinfo"] = lookup_numeric_only
    return stand_ins


_SOCKET_METHODS = ("connect", "connect_ex", "sendto", "sendmsg")
_RESOLVERS = ("getaddrinfo", "gethostbyname", "gethostbyname_ex", "gethostbyaddr")
_installed: Guard | None = None
recorded_calls: list[tuple[str, tuple]] = []
"""What reached the recorders, with ``SKYLIFT_NETGUARD_RECORD_ONLY=1``."""


def install(log_dir: str | None = None, real: dict[str, Callable[..., Any]] | None = None) -> Guard:
    """Put the guard in front of this process's sockets and resolver (once; later calls return it)."""
    global _installed  # noqa: PLW0603 - one guard per process, kept where every later call finds it
    if _installed is not None:
        return _installed
    if real is None and os.environ.get(_RECORD_ONLY_ENV) == "1":
        real = recorders(recorded_calls)
    real = real or {
        **{name: getattr(socket.socket, name) for name in _SOCKET_METHODS},
        **{name: getattr(socket, name) for name in _RESOLVERS},
    }
    guard = Guard(real, log_dir if log_dir is not None else os.environ.get(_LOG_ENV))
    for name, function in guarded_functions(guard).items():
        setattr(socket.socket if name in _SOCKET_METHODS else socket, name, function)
    _installed = guard
    return guard
