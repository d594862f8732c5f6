"""The cloud and platform registries are the only lists of vendors, and a new vendor is one module.

``skylift.cloud.vendors`` and ``skylift.submit.base`` gather what each
``skylift/cloud/<vendor>.py`` and ``skylift/submit/<platform>.py`` declares; nothing else
in ``src/`` may spell a collection of their names (it would be a table a new vendor has
to find and edit). The second half registers a cloud and a platform from this file, as
a plugin would, and finds them in every place that used to need its own table.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.cloud import _protocol
from skylift.cloud.notice import NoticeWatcher, detect_cloud, load_poller, new_notice, notice_window_s
from skylift.cloud.vendors import CloudVendor, KubernetesFlavour, cloud_names, kubernetes_flavours, register, unregister
from skylift.config.load import load_config
from skylift.doctor.instance import gather_cloud
from skylift.errors import SkyliftConfigError
from skylift.submit.base import (
    Platform,
    PlatformTopology,
    platform_info,
    platform_names,
    register_platform,
    resolve_platform,
    unregister_platform,
)
from skylift.submit.environment import detect_platform_topology
from skylift.submit.spec import endpoint_for
from tests.cloud.metadata_server import MetadataServer, Reply

SOURCE = Path(__file__).resolve().parents[2] / "src" / "skylift"
REGISTRY_FILES = {SOURCE / "cloud" / "vendors.py", SOURCE / "submit" / "base.py"}


def _vendor_names() -> set[str]:
    clouds = set(cloud_names()) | set(kubernetes_flavours())
    return clouds | set(platform_names(with_aliases=True))


def _vendor_files() -> set[Path]:
    modules = [sys.modules[vendor.poll_module] for vendor in _registered_clouds()]
    modules += [sys.modules[platform_info(name).module] for name in platform_names()]
    return {Path(module.__file__).resolve() for module in modules}


def _registered_clouds() -> list[CloudVendor]:
    from skylift.cloud.vendors import cloud_vendors

    return list(cloud_vendors())


def _spelled_lists(tree: ast.AST, names: set[str]) -> list[tuple[int, list[str]]]:
    """Tuples, lists, sets, dict keys and ``Literal[...]`` holding two or more vendor names."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            items = node.elts
        elif isinstance(node, ast.Dict):
            items = [key for key in node.keys if key is not None]
        else:
            continue
        spelled = [item.value for item in items if isinstance(item, ast.Constant) and item.value in names]
        if len(set(spelled)) >= 2:
            found.append((node.lineno, spelled))
    return found


def test_the_scan_sees_what_it_must_refuse():
    """A guard against a scan that finds nothing: the old tables are caught."""
    names = _vendor_names()
    old = 'CLOUDS = ("aws", "gcp", "azure")\nP = Literal["k8s", "skypilot"]\nW = {"aws": 1.0, "gcp": 2.0}\n'
    assert sorted(line for line, _ in _spelled_lists(ast.parse(old), names)) == [1, 2, 3]


def test_only_the_registries_and_the_vendor_modules_list_vendors():
    names = _vendor_names()
    assert {"aws", "gcp", "azure", "aliyun", "tencent", "sagemaker", "pai", "tione", "k8s", "skypilot"} <= names
    allowed = REGISTRY_FILES | _vendor_files()
    offenders = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.resolve() in allowed:
            continue
        for line, spelled in _spelled_lists(ast.parse(path.read_text(encoding="utf-8")), names):
            offenders.append(f"{path.relative_to(SOURCE.parents[1])}:{line}: {', '.join(spelled)}")
    assert not offenders, (
        "lists of clouds or platforms outside their registries:\n  " + "\n  ".join(offenders)
        + "\nRead the registry instead (skylift.cloud.vendors, skylift.submit.base.platforms), so a new "
        "vendor stays one module."
    )


# ---- a sixth cloud, declared here as one module would declare it

INSTANCE_TYPE = "nimbus.gpu8.h200"


class NimbusMetadata(MetadataServer):
    """A made-up cloud's metadata service: every request needs ``Nimbus-Metadata: 1``."""

    def route(self, method: str, target: str, headers: dict[str, str]) -> Reply:
        if headers.get("nimbus-metadata") != "1":
            return 400, {}, "missing Nimbus-Metadata header"
        if target == "/v1/instance/type":
            return 200, {}, INSTANCE_TYPE
        if target == "/v1/instance/reclaim":
            return 200, {}, "2030-01-01T00:00:00Z"
        return 404, {}, "not found"


def poll(base_url: str, timeout_s: float):
    response = _protocol.http_request(base_url + "/v1/instance/reclaim", timeout_s=timeout_s,
                                      headers={"Nimbus-Metadata": "1"})  # fmt: skip
    if response.status == 404:
        return None
    return new_notice("nimbus", "spot-termination", f"reclaim={response.text}", _protocol.parse_iso_time_s(response.text))


NIMBUS = CloudVendor(
    name="nimbus", poll_module=__name__, notice_window_s=45.0, poll_interval_s=2.0,
    metadata_host="http://127.0.0.1:9", dmi_signatures=(("sys_vendor", "Nimbus Cloud"),),
    instance_type_path="/v1/instance/type", request_headers={"Nimbus-Metadata": "1"}, interruptions_per_hour=0.2,
    kubernetes=KubernetesFlavour("nks", {"nimbus.example/spot": "true"}),
)  # fmt: skip


@pytest.fixture
def nimbus(monkeypatch, tmp_path):
    register(NIMBUS)
    monkeypatch.delenv("SKYLIFT_CLOUD", raising=False)
    dmi = tmp_path / "dmi"
    dmi.mkdir()
    (dmi / "sys_vendor").write_text("Nimbus Cloud\n")
    monkeypatch.setattr("skylift.cloud.notice.DMI_DIR", dmi)
    with NimbusMetadata() as server:
        monkeypatch.setenv("SKYLIFT_METADATA_ENDPOINT", server.url)
        yield server
    unregister("nimbus")


def test_a_new_cloud_is_detected_polled_validated_and_probed(nimbus):
    assert detect_cloud() == "nimbus"  # from its DMI signature
    watcher = NoticeWatcher(lambda notice: None)
    assert (watcher.cloud, watcher.poll_interval_s) == ("nimbus", 2.0)  # the notice polling choices
    notice = load_poller("nimbus")(nimbus.url, 1.0)
    assert (notice.cloud, notice.kind) == ("nimbus", "spot-termination")
    assert notice_window_s("nimbus") == 45.0
    facts = gather_cloud()  # doctor's instance lookup, over loopback HTTP with the vendor's header
    assert (facts.name, facts.source, facts.instance_type) == ("nimbus", "dmi", INSTANCE_TYPE)
    config = load_config(None, ["preemption.cloud=nimbus", "plan.interruptions_per_hour={nimbus: 0.3}",
                                "submit.kubernetes.cloud=nks"])  # fmt: skip
    assert config.preemption.cloud == "nimbus" and config.plan.interruptions_per_hour == {"nimbus": 0.3}


def test_a_new_cloud_reaches_the_plan_the_catalog_and_kubernetes(nimbus):
    from skylift.catalog import InstanceRow
    from skylift.plan.ranking import PlanRequest, interruption_rates
    from skylift.submit.kubernetes import grace_period_s
    from skylift.submit.spec import parse_submit

    assert interruption_rates(PlanRequest(epochs=1))["nimbus"] == 0.2
    row = InstanceRow(provider="nimbus", instance_type="n8", region="r1", gpu_model="H200", gpu_count=8,
                      gpu_memory_gib=141, vcpus=96, ram_gib=1024, gpu_interconnect="nvlink", intra_node_gb_s=900,
                      network_gbps=400, network_fabric="none", price_status="price_unverified", spec_source="test",
                      spec_checked=False)  # fmt: skip
    assert row.spot_notice_window_s == 45.0
    assert grace_period_s(parse_submit({"kubernetes": {"cloud": "nks"}}, "test")) == 45


def test_without_the_module_the_name_is_refused_everywhere():
    assert "nimbus" not in cloud_names()
    with pytest.raises(SkyliftConfigError, match="preemption.cloud"):
        load_config(None, ["preemption.cloud=nimbus"])
    with pytest.raises(SkyliftConfigError, match="plan.interruptions_per_hour"):
        load_config(None, ["plan.interruptions_per_hour={nimbus: 0.3}"])
    with pytest.raises(SkyliftConfigError, match="submit.kubernetes.cloud"):
        load_config(None, ["submit.kubernetes.cloud=nks"])


# ---- a sixth platform, declared here as one module would declare it

def _detect(environ, root):
    if "CIRRUS_NODES" not in environ:
        return None
    return PlatformTopology("Cirrus", "CIRRUS_* variables", int(environ["CIRRUS_NODES"]), int(environ["CIRRUS_RANK"]),
                            environ["CIRRUS_HEAD"], 29400)  # fmt: skip


CIRRUS = Platform(
    name="cirrus", title="Cirrus Batch", module=__name__, aliases=("cirrus-batch",),
    elastic_note=lambda nodes, count, options: f"elastic: no, cirrus runs {count} fixed nodes",
    detect_topology=_detect, detect_order=50, endpoint=lambda options: "https://cirrus.example", stop_grace_s=60.0,
)  # fmt: skip


@pytest.fixture
def cirrus():
    register_platform(CIRRUS)
    yield
    unregister_platform("cirrus")


def test_a_new_platform_is_chosen_detected_and_followed(cirrus, tmp_path):
    from skylift.config.submit import SubmitConfig

    assert resolve_platform("cirrus-batch") == "cirrus" and "cirrus" in platform_names()
    found = detect_platform_topology({"CIRRUS_NODES": "2", "CIRRUS_RANK": "1", "CIRRUS_HEAD": "10.0.0.9"},
                                     filesystem_root=tmp_path)  # fmt: skip
    assert (found.platform, found.nnodes, found.node_rank, found.master_addr) == ("Cirrus", 2, 1, "10.0.0.9")
    assert endpoint_for(SubmitConfig(), "cirrus") == "https://cirrus.example"


def test_kubernetes_is_k8s_on_the_command_line():
    root = SOURCE.parents[1]
    argv = ["submit", "examples/spot_s3.yaml", "--platform", "kubernetes", "--instance", "p4d.24xlarge",
            "--gpus-per-node", "8", "--image", "registry.example/skylift:0.1.0", "--dry-run", "--json"]
    result = subprocess.run([sys.executable, "-m", "skylift", *argv], cwd=root, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["platform"] == "k8s"
