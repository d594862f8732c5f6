"""Script jobs as ``skylift submit --platform P --config examples/own_loop.yaml -- python
examples/own_loop.py examples/own_loop.yaml`` makes them: the repository's own Runtime
example (README "Door 1") is the script, the repository the image's project."""

from __future__ import annotations

import shlex
from pathlib import Path

from tests.submit.conftest import FIXED_NOW, IMAGE, STORES

__all__ = ["REPO_ROOT", "SCRIPT", "SCRIPT_CONFIG", "launch_argv", "make_script_job", "node_command", "platform_flags",
           "root_for"]

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ("python", "examples/own_loop.py", "examples/own_loop.yaml")
SCRIPT_CONFIG = "examples/own_loop.yaml"

INSTANCE_TYPES = {"sagemaker": "ml.p4d.24xlarge", "pai": "ecs.gn7i-c8g1.2xlarge", "tione": "TI.GN7.2XLARGE32.POST",
                  "k8s": "p4d.24xlarge", "skypilot": "A100:8"}


def root_for(platform: str) -> str:
    """The checkpoint root the script jobs here name, on ``platform``'s object store."""
    return f"{STORES[platform]}://bucket-1250000000/runs/own-loop"


def platform_flags(platform: str, submit: dict | None = None) -> dict:
    """What a user gives submit for ``platform`` (as ``with_flags`` names), two spot nodes."""
    return {
        "image": IMAGE, "instance_count": 2, "spot": True, "instance_type": INSTANCE_TYPES[platform],
        "region": {"sagemaker": "us-east-1", "pai": "cn-hangzhou", "tione": "ap-guangzhou"}.get(platform),
        "sagemaker": {"role_arn": "arn:aws:iam::123456789012:role/SkyliftTraining"},
        "kubernetes": {"cloud": "eks"},
        "tione": {"cos_keys_from": "image"},
        "gpus_per_node": 8 if platform == "k8s" else None,
        **(submit or {}),
    }


def make_script_job(platform: str, *, submit: dict | None = None, run: list[str] | None = None,
                    config: str | None = SCRIPT_CONFIG, script: tuple[str, ...] = SCRIPT, project: Path = REPO_ROOT):
    """A script JobSpec for ``platform``; ``run`` are extra ``--set`` items, ``project``
    the folder the image is built from."""
    from skylift.submit.script import script_job_from_inputs

    overrides = [f"checkpoint.root={root_for(platform)}", *(run or [])]
    return script_job_from_inputs(list(script), config, overrides, platform_flags(platform, submit),
                                  project=project, now=FIXED_NOW)


def launch_argv(root: str, *, grace_s: str | None = None, run_dir: str | None = "runs/own_loop") -> list[str]:
    """The ``skylift launch`` argv a script job's node runs, for checkpoint root ``root``."""
    argv = ["skylift", "launch", "--checkpoint-root", root]
    argv += ["--run-dir", run_dir] if run_dir else []
    argv += ["--grace-s", grace_s] if grace_s else []
    return [*argv, "--", *SCRIPT]


def node_command(platform: str, body: dict, applied_first: list[dict] = ()) -> tuple[list[str], dict[str, str]]:
    """The argv and environment ``platform`` gives each node of the job ``body`` asks for;
    on Kubernetes a ``secretKeyRef`` reads the Secret among ``applied_first``, as the kubelet does."""
    if platform == "sagemaker":
        spec = body["AlgorithmSpecification"]
        return spec["ContainerEntrypoint"] + spec["ContainerArguments"], dict(body["Environment"])
    if platform == "pai":
        return shlex.split(body["UserCommand"]), dict(body["Envs"])
    if platform == "tione":
        return shlex.split(body["StartCmdInfo"]["StartCmd"]), {env["Name"]: env["Value"] for env in body["Envs"]}
    if platform == "k8s":
        trainer = body["spec"]["trainer"]
        secrets = {item["metadata"]["name"]: item["stringData"] for item in applied_first if item["kind"] == "Secret"}

        def value(env: dict) -> str:
            if "value" in env:
                return env["value"]
            reference = env["valueFrom"]["secretKeyRef"]
            return secrets[reference["name"]][reference["key"]]

        return list(trainer["command"]), {env["name"]: value(env) for env in trainer["env"]}
    return shlex.split(body["run"]), {**body["envs"], **body.get("secrets", {})}  # SkyPilot
