"""Skylift jobs for the SkyPilot platform built without the run config (whose recipes
import torch), so ``make test-skypilot`` can run in a venv without torch; the main
suite checks that they are the jobs ``make_job`` builds."""

from __future__ import annotations

from types import SimpleNamespace

from skylift.submit.spec import job_spec_from, parse_submit
from tests.submit.conftest import FIXED_NOW, IMAGE

__all__ = ["ROOT", "VARIANTS", "torch_free_job", "torch_free_script_job"]

ROOT = "s3://bucket-1250000000/runs/quick"

# One job per branch of skypilot.build: accelerators or an instance type, infra, disk, restarts, envs.
VARIANTS = {
    "accelerators": {},
    "instance-type-on-aws": {"instance_type": "p4d.24xlarge", "skypilot": {"infra": "aws"}},
    "region-disk-restarts-envs": {
        "skypilot": {"infra": "aws/us-east-1", "disk_size_gib": 200, "max_restarts_on_errors": 3},
        "envs": {"WANDB_MODE": "offline", "NCCL_DEBUG": "WARN"},
    },
    "kubernetes": {"instance_type": "H100:8", "skypilot": {"infra": "k8s/my-context"}},
}


def torch_free_job(submit: dict):
    """The job make_job("skypilot", submit=...) makes, without loading the run config
    (its recipes import torch): job_spec_from over the fields of quickstart.yaml it reads."""
    options = parse_submit(
        {"image": IMAGE, "instance_count": 2, "spot": True, "instance_type": "A100:8", **submit}, source="test"
    )
    config = SimpleNamespace(
        run_dir="runs/quickstart",
        checkpoint=SimpleNamespace(enabled=True, root=ROOT),
        data=SimpleNamespace(url="s3://bucket-1250000000/shards/train", val_url="s3://bucket-1250000000/shards/val"),
        preemption=SimpleNamespace(grace_s=None),
        distributed=SimpleNamespace(nodes=None),
    )
    return job_spec_from(config, options, "examples/quickstart.yaml", [], now=FIXED_NOW)


def torch_free_script_job():
    """The job make_script_job("skypilot") makes (``-- python examples/own_loop.py
    examples/own_loop.yaml`` with ``--config examples/own_loop.yaml``), without loading the
    config: its run folder, and no data (a script reads its own)."""
    from dataclasses import replace

    job = torch_free_job({})
    return replace(job, name="skylift-own-loop-20261201-080000", checkpoint_root="s3://bucket-1250000000/runs/own-loop",
                   data_url=None, val_url=None, run_dir="runs/own_loop",
                   script=("python", "examples/own_loop.py", "examples/own_loop.yaml"))
