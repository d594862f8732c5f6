"""Shared pieces of the submit tests: a job builder and sentinel vendor credentials."""

from __future__ import annotations

from datetime import datetime, timezone

import pytest

from tests.servers import SENTINEL_KEY_ID, SENTINEL_SECRET, SENTINEL_TOKEN

ALIBABA_KEY_ID = "LTAISENTINELKEYID0001"
ALIBABA_SECRET = "alibaba-sentinel-secret-never-log-me-01"
TENCENT_KEY_ID = "AKIDSENTINELTENCENT0001"
TENCENT_SECRET = "tencent-sentinel-secret-never-log-me-01"
SECRETS = (SENTINEL_SECRET, SENTINEL_TOKEN, ALIBABA_SECRET, TENCENT_SECRET)
FIXED_NOW = datetime(2026, 12, 1, 8, 0, 0, tzinfo=timezone.utc)
IMAGE = "registry.example.com/team/skylift:1.0"

STORES = {"sagemaker": "s3", "pai": "oss", "tione": "cos", "k8s": "s3", "skypilot": "s3"}


@pytest.fixture(autouse=True)
def jobs_dir(tmp_path, monkeypatch):
    """Job records that `skylift submit` writes go to this test's own folder, never ~/.skylift."""
    folder = tmp_path / "skylift-jobs"
    monkeypatch.setenv("SKYLIFT_JOBS_DIR", str(folder))
    return folder


@pytest.fixture
def vendor_credentials(monkeypatch):
    """Sentinel credentials for every vendor, and no instance metadata lookups."""
    values = {
        "AWS_ACCESS_KEY_ID": SENTINEL_KEY_ID, "AWS_SECRET_ACCESS_KEY": SENTINEL_SECRET,
        "AWS_SESSION_TOKEN": SENTINEL_TOKEN, "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
        "ALIBABA_CLOUD_ACCESS_KEY_ID": ALIBABA_KEY_ID, "ALIBABA_CLOUD_ACCESS_KEY_SECRET": ALIBABA_SECRET,
        "ALIBABA_CLOUD_ECS_METADATA_DISABLED": "true",
        "TENCENTCLOUD_SECRET_ID": TENCENT_KEY_ID, "TENCENTCLOUD_SECRET_KEY": TENCENT_SECRET,
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    return values


def make_job(platform: str, *, submit: dict | None = None, run: list[str] | None = None, data: bool = True):
    """A JobSpec as `skylift submit` makes it, for ``platform``'s object store."""
    from skylift.config.load import load_config
    from skylift.submit.spec import job_spec_from, parse_submit

    store = STORES[platform]
    overrides = [f"checkpoint.root={store}://bucket-1250000000/runs/quick", *(run or [])]
    if data:
        overrides += [f"data.url={store}://bucket-1250000000/shards/train",
                      f"data.val_url={store}://bucket-1250000000/shards/val"]
    config = load_config("examples/quickstart.yaml", overrides)
    defaults = {
        "image": IMAGE, "instance_count": 2, "spot": True,
        "instance_type": {"sagemaker": "ml.p4d.24xlarge", "pai": "ecs.gn7i-c8g1.2xlarge",
                          "tione": "TI.GN7.2XLARGE32.POST", "k8s": "p4d.24xlarge", "skypilot": "A100:8"}[platform],
        "region": {"sagemaker": "us-east-1", "pai": "cn-hangzhou", "tione": "ap-guangzhou"}.get(platform),
        "sagemaker": {"role_arn": "arn:aws:iam::123456789012:role/SkyliftTraining"},
        "kubernetes": {"cloud": "eks"},
        "tione": {"cos_keys_from": "image"},
        "gpus_per_node": 8 if platform == "k8s" else None,
    }
    options = parse_submit({**defaults, **(submit or {})}, source="test")
    return job_spec_from(config, options, "examples/quickstart.yaml", run or [], now=FIXED_NOW)
