"""The suite-wide network guard refuses what would leave loopback, in-process and in children.

Beneath the guard under test the real ``connect`` and resolver are recorders, so even a
broken guard sends nothing: the refused addresses are TEST-NET-3 (203.0.113.0/24, RFC 5737),
a cloud metadata address and public names.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import skylift_netguard as netguard

from tests.conftest import NETGUARD_DIR, REPO_ROOT, take_network_refusals


@pytest.fixture
def recorded():
    calls: list[tuple[str, tuple]] = []
    guard = netguard.Guard(netguard.recorders(calls), log_dir=None)
    return guard, netguard.guarded_functions(guard), calls


@pytest.mark.parametrize("address", [("203.0.113.7", 443), ("169.254.169.254", 80), ("100.100.100.200", 80)])
def test_connect_past_loopback_is_refused_and_nothing_is_sent(recorded, address):
    guard, functions, calls = recorded
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        with pytest.raises(netguard.NetworkRefused, match="would leave 127.0.0.0/8"):
            functions["connect"](sock, address)
        with pytest.raises(netguard.NetworkRefused):
            functions["connect_ex"](sock, address)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        with pytest.raises(netguard.NetworkRefused):
            functions["sendto"](sock, b"x", address)
    assert calls == []
    assert len(guard.refusals) == 3 and address[0] in guard.refusals[0]


def test_ipv6_past_loopback_is_refused(recorded):
    guard, functions, calls = recorded
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        with pytest.raises(netguard.NetworkRefused):
            functions["connect"](sock, ("2001:db8::1", 443, 0, 0))
        with pytest.raises(netguard.NetworkRefused):
            functions["connect"](sock, ("::ffff:203.0.113.7", 443, 0, 0))
    assert calls == []


def test_loopback_passes_through_to_the_real_connect(recorded):
    _, functions, calls = recorded
    for family, address in [(socket.AF_INET, ("127.0.0.1", 9)), (socket.AF_INET, ("127.0.0.2", 9)),
                            (socket.AF_INET6, ("::1", 9, 0, 0))]:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            with pytest.raises(ConnectionRefusedError, match="recorded connect"):
                functions["connect"](sock, address)
    assert [call[1][0] for call in calls] == [("127.0.0.1", 9), ("127.0.0.2", 9), ("::1", 9, 0, 0)]


def test_name_lookups_past_loopback_are_refused(recorded):
    guard, functions, calls = recorded
    for name in ("api.sagemaker.us-east-1.amazonaws.com", "pai-dlc.cn-hangzhou.aliyuncs.com", b"example.com"):
        with pytest.raises(netguard.NetworkRefused):
            functions["getaddrinfo"](name, 443)
    with pytest.raises(netguard.NetworkRefused):
        functions["gethostbyname"]("metadata.google.internal")
    with pytest.raises(netguard.NetworkRefused):
        functions["gethostbyaddr"]("203.0.113.7")  # a reverse lookup is a DNS query
    assert calls == []
    assert functions["getaddrinfo"]("127.0.0.1", 80)[0][4] == ("127.0.0.1", 80)
    for name in ("localhost", socket.gethostname()):  # allowed, and the stand-in resolves no names
        with pytest.raises(socket.gaierror):
            functions["getaddrinfo"](name, 80)
    assert [call[1][0] for call in calls] == ["127.0.0.1", "localhost", socket.gethostname()]
    assert len(guard.refusals) == 5


def test_unix_sockets_are_not_network_traffic(recorded, tmp_path):
    _, functions, calls = recorded
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        with pytest.raises(ConnectionRefusedError, match="recorded"):
            functions["connect"](sock, str(tmp_path / "socket"))
    assert len(calls) == 1


def test_this_process_runs_under_the_guard():
    assert socket.socket.connect.__qualname__.startswith("_guarded_socket_methods")
    assert socket.getaddrinfo.__qualname__.startswith("_guarded_resolvers")


def test_a_refusal_in_this_process_is_written_where_the_suite_reads():
    """Also in an xdist worker, whose guard sitecustomize installed before tests/conftest.py ran."""
    netguard.install().refuse("connect to 203.0.113.9:443 (this test's own, never attempted)")
    assert any("203.0.113.9" in line for line in take_network_refusals())


CHILD = """
import json, socket, urllib.request, skylift_netguard
outcomes = {}
for name, attempt in [
    ("connect", lambda: socket.create_connection(("203.0.113.7", 443), timeout=1)),
    ("metadata", lambda: urllib.request.urlopen("http://169.254.169.254/latest/meta-data/", timeout=1)),
    ("dns", lambda: urllib.request.urlopen("https://example.com/", timeout=1)),
    ("boto3", lambda: __import__("boto3").client("sts", region_name="us-east-1").get_caller_identity()),
]:
    try:
        attempt()
        outcomes[name] = "sent"
    except Exception as error:
        outcomes[name] = type(error).__name__ + ": " + str(error)
print(json.dumps({"outcomes": outcomes, "recorded": [c[0] for c in skylift_netguard.recorded_calls]}))
"""


def test_a_child_process_is_guarded_and_its_refusals_are_recorded(tmp_path):
    """A process started by a test gets the guard from PYTHONPATH, before any of its code runs."""
    env = {**os.environ, "SKYLIFT_NETGUARD_LOG": str(tmp_path), "SKYLIFT_NETGUARD_RECORD_ONLY": "1",
           "AWS_ACCESS_KEY_ID": "sentinel-key", "AWS_SECRET_ACCESS_KEY": "sentinel-secret",
           "AWS_MAX_ATTEMPTS": "1"}  # one refused attempt is the claim; botocore's retries only sleep
    env.pop("AWS_ENDPOINT_URL", None)
    assert str(NETGUARD_DIR) in env["PYTHONPATH"].split(os.pathsep)
    result = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    for name, outcome in report["outcomes"].items():
        # boto3 wraps the refusal in its own EndpointConnectionError: the log below holds it.
        assert "would leave 127.0.0.0/8" in outcome or (name == "boto3" and "EndpointConnectionError" in outcome)
    assert "connect" not in report["recorded"]  # only numeric look-ups reached the stand-ins
    logged = "".join(path.read_text() for path in tmp_path.glob("*.log"))
    assert "203.0.113.7" in logged and "169.254.169.254" in logged and "sts.us-east-1.amazonaws.com" in logged
    assert take_network_refusals() == []  # the child logged to its own folder, not the suite's
