"""Preemption notices end to end against a strict loopback metadata server.

Every test points ``SKYLIFT_METADATA_ENDPOINT`` at 127.0.0.1 (a dead port unless a
test starts the fake server), so nothing here can reach a real metadata address.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from skylift.cloud import aws, gcp
from skylift.cloud._protocol import MetadataError, is_transient
from skylift.cloud.notice import (
    NoticeWatcher,
    PreemptionNotice,
    detect_cloud,
    load_poller,
    metadata_base_url,
    watch_signals,
)
from skylift.cloud.vendors import cloud_names
from tests.cloud.metadata_server import MetadataServer

CLOUDS = cloud_names()

POLL_INTERVAL_S = 0.05
WAIT_S = 5.0


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", "http://127.0.0.1:9")  # discard port: nothing listens
    monkeypatch.delenv("SKYLIFT_CLOUD", raising=False)
    empty_dmi = tmp_path / "no-dmi"
    empty_dmi.mkdir()
    monkeypatch.setattr("skylift.cloud.notice.DMI_DIR", empty_dmi)


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    with MetadataServer() as fake:
        monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", fake.url)
        yield fake


class Inbox:
    """Collects notices from the watcher thread."""

    def __init__(self) -> None:
        self.notices: list[PreemptionNotice] = []
        self.arrived = threading.Event()

    def __call__(self, notice: PreemptionNotice) -> None:
        self.notices.append(notice)
        self.arrived.set()

    def wait(self, count: int = 1) -> list[PreemptionNotice]:
        deadline = time.monotonic() + WAIT_S
        while len(self.notices) < count and time.monotonic() < deadline:
            self.arrived.wait(0.02)
        assert len(self.notices) >= count, f"expected {count} notice(s) within {WAIT_S} s, got {self.notices}"
        return self.notices


def start_watcher(cloud: str, monkeypatch: pytest.MonkeyPatch) -> tuple[NoticeWatcher, Inbox]:
    monkeypatch.setenv("SKYLIFT_CLOUD", cloud)
    inbox = Inbox()
    return NoticeWatcher(inbox, poll_interval_s=POLL_INTERVAL_S).start(), inbox


@pytest.mark.parametrize(
    ("cloud", "kind"),
    [
        ("aws", "spot-termination"),
        ("gcp", "spot-termination"),
        ("gcp", "maintenance"),
        ("azure", "spot-termination"),
        ("azure", "maintenance"),
        ("aliyun", "spot-termination"),
        ("tencent", "spot-termination"),
    ],
)
def test_watcher_reports_one_notice_with_the_armed_deadline(server, monkeypatch, cloud, kind):
    watcher, inbox = start_watcher(cloud, monkeypatch)
    try:
        time.sleep(0.3)
        assert inbox.notices == [], "a notice while nothing was armed"
        expected_deadline_s = server.arm(cloud, kind=kind, deadline_in_s=90)
        (notice,) = inbox.wait()
        time.sleep(5 * POLL_INTERVAL_S)
        assert len(inbox.notices) == 1
        assert not watcher.running, "the watcher stops after a termination notice"
    finally:
        watcher.stop()
    assert (notice.cloud, notice.kind) == (cloud, kind)
    assert notice.deadline_s == pytest.approx(expected_deadline_s, abs=1.0)
    assert notice.received_at_s == pytest.approx(time.time(), abs=WAIT_S)
    assert watcher.notice is notice


def test_aws_rebalance_is_reported_and_watching_goes_on(server, monkeypatch):
    watcher, inbox = start_watcher("aws", monkeypatch)
    try:
        server.arm("aws", kind="rebalance")
        inbox.wait(1)
        assert watcher.running, "a rebalance recommendation is no deadline; keep polling"
        expected_deadline_s = server.arm("aws", kind="spot-termination", deadline_in_s=100)
        rebalance, termination = inbox.wait(2)
    finally:
        watcher.stop()
    assert rebalance.kind == "rebalance"
    assert rebalance.seconds_left() == pytest.approx(120.0, abs=WAIT_S)
    assert termination.kind == "spot-termination"
    assert termination.deadline_s == pytest.approx(expected_deadline_s, abs=1.0)


@pytest.mark.parametrize("cloud", CLOUDS)
def test_poll_finds_nothing_while_unarmed(server, cloud):
    assert load_poller(cloud)(server.url, 1.0) is None


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/latest/meta-data/spot/instance-action", 401),
        ("PUT", "/latest/api/token", 400),
        ("GET", "/latest/api/token", 405),
        ("GET", "/computeMetadata/v1/instance/preempted", 403),
        ("GET", "/metadata/scheduledevents?api-version=2020-07-01", 400),
        ("GET", "/latest/meta-data/instance/spot/termination-time", 401),
    ],
)
def test_server_rejects_requests_without_the_vendor_headers(server, method, path, status):
    """So a client that forgets a header or the token flow fails the tests above."""
    request = urllib.request.Request(server.url + path, data=b"" if method == "PUT" else None, method=method)
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=2)
    assert raised.value.code == status


@pytest.mark.parametrize(
    ("cloud", "token_path", "item_path"),
    [
        ("aws", "/latest/api/token", "/latest/meta-data/spot/instance-action"),
        ("aliyun", "/latest/api/token", "/latest/meta-data/instance/spot/termination-time"),
    ],
)
def test_token_is_cached_then_refetched_after_a_401(server, cloud, token_path, item_path):
    poll = load_poller(cloud)
    for _ in range(3):
        assert poll(server.url, 1.0) is None
    assert server.count("PUT", token_path) == 1, "the token is reused until near its TTL"

    server.expire_tokens()
    server.arm(cloud, deadline_in_s=60)
    notice = poll(server.url, 1.0)

    assert notice is not None and notice.kind == "spot-termination"
    assert server.count("GET", item_path, status=401) == 1
    assert server.count("PUT", token_path) == 2


@pytest.mark.parametrize("mode", ["503", "drop"])
def test_transient_failures_do_not_stop_the_watcher(server, monkeypatch, mode):
    server.fail_next(6, mode=mode)
    expected_deadline_s = server.arm("aws", deadline_in_s=90)
    watcher, inbox = start_watcher("aws", monkeypatch)
    try:
        (notice,) = inbox.wait()
    finally:
        watcher.stop()
    assert notice.deadline_s == pytest.approx(expected_deadline_s, abs=1.0)
    assert server.count("PUT", "/latest/api/token", status=503 if mode == "503" else 0) >= 1


def test_a_503_is_classified_transient(server):
    server.fail_next(1)
    with pytest.raises(urllib.error.HTTPError) as raised:
        gcp.poll(server.url, 1.0)
    assert is_transient(raised.value)


def test_gcp_answer_without_metadata_flavor_is_rejected(server, monkeypatch):
    server.gcp_spoofed = True
    server.arm("gcp")
    with pytest.raises(MetadataError, match="Metadata-Flavor"):
        gcp.poll(server.url, 1.0)
    assert not is_transient(MetadataError("x"))

    watcher, inbox = start_watcher("gcp", monkeypatch)
    try:
        time.sleep(0.3)
        assert inbox.notices == [] and watcher.running, "a spoofed TRUE is no notice; keep polling"
        server.gcp_spoofed = False
        inbox.wait()
    finally:
        watcher.stop()


def test_azure_ignores_events_for_other_vms(server):
    poll = load_poller("azure")
    server.arm("azure", resources=("some-other-vm",))
    assert poll(server.url, 1.0) is None
    server.arm("azure", resources=("some-other-vm", "skylift-vm-0"))
    assert poll(server.url, 1.0) is not None


def test_callback_errors_are_contained(server, monkeypatch):
    def explode(notice: PreemptionNotice) -> None:
        raise RuntimeError("callback bug")

    monkeypatch.setenv("SKYLIFT_CLOUD", "tencent")
    server.arm("tencent")
    with NoticeWatcher(explode, poll_interval_s=POLL_INTERVAL_S) as watcher:
        deadline = time.monotonic() + WAIT_S
        while watcher.notice is None and time.monotonic() < deadline:
            time.sleep(0.02)
    assert watcher.notice is not None and not watcher.running


def test_watcher_without_a_cloud_starts_nothing():
    watcher = NoticeWatcher(lambda notice: None).start()
    assert watcher.cloud is None and not watcher.running
    watcher.stop()


def test_detect_cloud_honours_skylift_cloud(monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", " Azure ")
    assert detect_cloud() == "azure"


def test_detect_cloud_rejects_an_unknown_value(monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", "oracle")
    # The registry lists its clouds in name order.
    with pytest.raises(ValueError, match=r"SKYLIFT_CLOUD.*aliyun, aws, azure, gcp, tencent"):
        detect_cloud()
    with pytest.raises(ValueError, match="SKYLIFT_CLOUD"):
        NoticeWatcher(lambda notice: None)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        ({"sys_vendor": "Amazon EC2\n", "product_name": "p5.48xlarge\n"}, "aws"),
        ({"sys_vendor": "Xen\n", "bios_version": "4.11.amazon\n"}, "aws"),
        ({"sys_vendor": "Google\n", "product_name": "Google Compute Engine\n"}, "gcp"),
        ({"sys_vendor": "Microsoft Corporation\n", "chassis_asset_tag": "7783-7084-3265-9085-8269-3286-77\n"}, "azure"),
        ({"sys_vendor": "Microsoft Corporation\n", "product_name": "Virtual Machine\n"}, None),  # plain Hyper-V
        ({"sys_vendor": "Alibaba Cloud\n", "product_name": "Alibaba Cloud ECS\n"}, "aliyun"),
        ({"sys_vendor": "Tencent Cloud\n", "product_name": "CVM\n"}, "tencent"),
        ({"sys_vendor": "LENOVO\n"}, None),
        ({}, None),
    ],
)
def test_detect_cloud_reads_dmi(tmp_path, files, expected):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert detect_cloud(dmi_dir=tmp_path) == expected


def test_metadata_base_url(monkeypatch):
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", "http://127.0.0.1:8080/")
    assert {metadata_base_url(cloud) for cloud in CLOUDS} == {"http://127.0.0.1:8080"}
    monkeypatch.delenv("SKYLIFT_METADATA_ENDPOINT")
    assert metadata_base_url("aws") == "http://169.254.169.254"
    assert metadata_base_url("aliyun") == "http://100.100.100.200"
    assert metadata_base_url("tencent") == "http://metadata.tencentyun.com"
    monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", "127.0.0.1:8080")
    with pytest.raises(ValueError, match="SKYLIFT_METADATA_ENDPOINT"):
        metadata_base_url("gcp")


def test_signal_becomes_a_notice_and_restore_puts_the_old_handler_back(monkeypatch):
    monkeypatch.setenv("SKYLIFT_CLOUD", "gcp")
    previous = signal.getsignal(signal.SIGUSR1)
    inbox = Inbox()
    restore = watch_signals(inbox)
    try:
        assert signal.getsignal(signal.SIGUSR1) is not previous
        os.kill(os.getpid(), signal.SIGUSR1)
        (notice,) = inbox.wait()
    finally:
        restore()
    assert signal.getsignal(signal.SIGUSR1) is previous
    assert (notice.cloud, notice.kind, notice.detail) == ("gcp", "signal", "SIGUSR1")
    assert notice.deadline_s == pytest.approx(notice.received_at_s + 30.0)


def test_signal_notice_off_cloud_uses_the_grace_period():
    inbox = Inbox()
    restore = watch_signals(inbox, signals=(signal.SIGUSR1,), grace_s=7.0)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        (notice,) = inbox.wait()
    finally:
        restore()
    assert notice.cloud == "local"
    assert notice.seconds_left(now_s=notice.received_at_s) == pytest.approx(7.0)


def test_seconds_left():
    notice = PreemptionNotice("aws", "spot-termination", "", received_at_s=100.0, deadline_s=220.0)
    assert notice.seconds_left(now_s=200.0) == 20.0
    assert PreemptionNotice("aws", "rebalance", "", 100.0, None).seconds_left() is None


def test_aws_instance_action_time_is_the_deadline(server):
    expected_deadline_s = server.arm("aws", deadline_in_s=42)
    notice = aws.poll(server.url, 1.0)
    assert notice is not None and notice.deadline_s == expected_deadline_s
    assert "action=terminate" in notice.detail
