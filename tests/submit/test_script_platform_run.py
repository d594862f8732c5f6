"""Real two-node script jobs on loopback: each platform's request is built, and the
command and environment it gives a node run as two processes, one per "node", under
that platform's injected variables (SageMaker: its resource config). ``skylift launch``
finds the ranks and the master itself; a plain torch.distributed script (gloo) writes
what it saw: world size, ranks, its arguments and the SKYLIFT_ variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from skylift.submit.base import platform_module
from tests.servers import FaultyProxy, free_port
from tests.submit.script_jobs import make_script_job, node_command
from tests.submit.test_platform_run import _ENTRY, _environment

NAMES = {"sagemaker": "SageMaker", "pai": "PAI-DLC", "tione": "TI-ONE", "k8s": "Kubeflow", "skypilot": "SkyPilot"}
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    seen = {"rank": rank, "world_size": dist.get_world_size(), "node_rank": int(os.environ["GROUP_RANK"]),
            "sum": total.item(), "arguments": sys.argv[1:],
            "variables": {name: value for name, value in os.environ.items()
                          if name in ("SKYLIFT_RUN_DIR", "SKYLIFT_CHECKPOINT_ROOT", "SKYLIFT_PLATFORM")}}
    with open(os.path.join(os.environ["SKYLIFT_TEST_OUT"], f"rank{rank}.json"), "w") as handle:
        json.dump(seen, handle)
    dist.destroy_process_group()
    """
)


def _nodes(platform: str, argv: list[str], block: dict[str, str], project, folder,
           stores: dict[str, str]) -> list[subprocess.Popen]:
    port = free_port()
    # What this process may have of a platform's or a launcher's variables; the netguard's stay.
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("PET_", "SKYPILOT_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))
             and key not in ("SKYLIFT_RUN_DIR", "SKYLIFT_CHECKPOINT_ROOT", "SKYLIFT_PLATFORM")}
    nodes = []
    for rank in (0, 1):
        environ = {**clean, **block, **_environment(NAMES[platform], rank, port, folder),
                   "SKYLIFT_TEST_OUT": str(folder), "OMP_NUM_THREADS": "1", **stores}
        # argv[0] is `skylift`, argv[1] the command; both nodes are this machine: --one-machine
        command = [sys.executable, "-c", _ENTRY, argv[1], "--one-machine", *argv[2:]]
        nodes.append(subprocess.Popen(command, cwd=project, env=environ, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return nodes


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("platform", list(NAMES))
def test_two_nodes_run_the_submitted_script_under_the_platforms_environment(platform, tmp_path, moto_server):
    project = tmp_path / "project"
    project.mkdir()
    (project / "train.py").write_text(SCRIPT)
    job = make_script_job(platform, config=None, run=["run_dir=runs/two-nodes"], project=project,
                          script=("python", "train.py", "--epochs", "3"))
    argv, block = node_command(platform, platform_module(platform).build(job).body)
    root = argv[argv.index("--checkpoint-root") + 1]
    # The platform's object store on loopback (moto speaks for S3, OSS and COS alike), or for
    # a bucket the platform mounts (PAI-DLC's /mnt/...) a folder of this test: node 0's
    # launcher takes the job's run lease there.
    if "://" in root:
        moto_server.reset()
        moto_server.create_bucket(root.split("://")[1].split("/")[0])
    else:
        root = str(tmp_path / "mounted" / root.lstrip("/"))
        argv[argv.index("--checkpoint-root") + 1] = root
    proxy = FaultyProxy(moto_server.port)  # records the requests
    stores = {f"SKYLIFT_{scheme}_ENDPOINT_URL": proxy.endpoint_url for scheme in ("S3", "OSS", "COS")}
    nodes = _nodes(platform, argv, block, project, tmp_path, stores)
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]
    finally:
        proxy.close()
    for rank, (node, (_, stderr)) in enumerate(zip(nodes, outputs, strict=False)):
        assert node.returncode == 0, f"node {rank}: {stderr[-3000:]}"
        assert f"skylift: {NAMES[platform]} job" in stderr and f"node {rank} of 2" in stderr
        assert f"SKYLIFT_CHECKPOINT_ROOT={root}" in stderr  # launch says what the script reads
    # One lease for the job, taken by node 0's launcher and released at its end.
    # (Had node 1's launcher taken one too, one of the two would have been refused: exit 2 above.)
    if "://" in root:
        assert [path for method, path, _ in proxy.answered if method == "PUT" and "/lease/" in path], \
            "node 0's launcher took no lease"
    else:
        assert (Path(root) / "lease").is_dir(), "node 0's launcher took no lease"
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [(item["rank"], item["node_rank"], item["world_size"]) for item in seen] == [(0, 0, 2), (1, 1, 2)]
    assert {item["sum"] for item in seen} == {3.0}  # 1 + 2: both ranks in one group
    for item in seen:
        assert item["arguments"] == ["--epochs", "3"]
        # SageMaker's run folder is its model directory, which it uploads when the job ends.
        run_dir = "/opt/ml/model" if platform == "sagemaker" else "runs/two-nodes"
        assert item["variables"] == {"SKYLIFT_PLATFORM": platform, "SKYLIFT_CHECKPOINT_ROOT": root,
                                     "SKYLIFT_RUN_DIR": run_dir}
