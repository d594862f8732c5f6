"""Real two-node ``skylift run`` jobs on loopback under each platform's environment:
two processes, one per "node", no topology flag; the platform's variables (or
SageMaker's resource config) decide the ranks and the master (torchrun over gloo).

Node 0 listens on 127.0.0.2: any 127/8 address reaches this machine; the launcher takes a
loopback master of a multi-node job only with ``--one-machine`` (a rehearsal)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import free_port

MASTER = "127.0.0.2"


def _environment(platform: str, rank: int, port: int, folder: Path) -> dict[str, str]:
    if platform == "Kubeflow":
        return {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
                "PET_MASTER_ADDR": MASTER, "PET_MASTER_PORT": str(port)}
    if platform == "SkyPilot":
        return {"SKYPILOT_NODE_IPS": f"{MASTER}\n127.0.0.3", "SKYPILOT_NODE_RANK": str(rank),
                "SKYPILOT_NUM_NODES": "2", "SKYPILOT_NUM_GPUS_PER_NODE": "1", "MASTER_PORT": str(port)}
    if platform == "SageMaker":
        root = folder / f"node-{rank}"  # each node's filesystem root, with SageMaker's file under it
        config = root / "opt/ml/input/config/resourceconfig.json"
        config.parent.mkdir(parents=True)
        config.write_text(json.dumps({"hosts": [MASTER, "127.0.0.3"], "current_host": [MASTER, "127.0.0.3"][rank]}))
        return {"SKYLIFT_TEST_FILESYSTEM_ROOT": str(root), "MASTER_PORT": str(port)}
    node_level = {"MASTER_ADDR": MASTER, "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(rank)}
    if platform == "TI-ONE":
        return {**node_level, "GPU_NUM_PER_NODE": "1", "INDEX": str(rank), "NODE_LIST": f"{MASTER}:1,127.0.0.3:1"}
    return {**node_level, "NPROC_PER_NODE": "1"}  # PAI-DLC


# `python -m skylift`, with SageMaker's resource config read under the test's folder.
_ENTRY = """import os, sys
from pathlib import Path
import skylift.submit.environment as environment
if "SKYLIFT_TEST_FILESYSTEM_ROOT" in os.environ:
    environment.FILESYSTEM_ROOT = Path(os.environ["SKYLIFT_TEST_FILESYSTEM_ROOT"])
from skylift.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("platform", ["SageMaker", "PAI-DLC", "TI-ONE", "Kubeflow", "SkyPilot"])
def test_two_nodes_start_from_the_platforms_environment(platform, tmp_path):
    port = free_port()
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith(("PET_", "SKYPILOT_", "RANK", "WORLD_SIZE", "MASTER_", "LOCAL_RANK"))}
    nodes = []
    for rank in (0, 1):
        # --no-doctor: the doctor's job checks are not read here and cost each node's launcher
        # an import of torch._dynamo; the platform's variables are read before them, either way.
        command = [sys.executable, "-c", _ENTRY, "run", "examples/quickstart.yaml", "--json", "--no-doctor", "--one-machine",
                   "--set", "schedule.max_steps=3", "--set", "schedule.warmup_steps=1",
                   "--set", f"run_dir={tmp_path / f'run-{rank}'}", "--set", "monitor.report=false",
                   "--set", "monitor.tensorboard=false",  # neither the report nor TensorBoard is read here
                   "--set", f"checkpoint.root={tmp_path / 'checkpoints'}"]
        environ = {**clean, **_environment(platform, rank, port, tmp_path), "OMP_NUM_THREADS": "1"}
        nodes.append(subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = [node.communicate(timeout=240) for node in nodes]
    for rank, (node, (_, stderr)) in enumerate(zip(nodes, outputs, strict=False)):
        assert node.returncode == 0, f"node {rank}: {stderr[-3000:]}"
        assert f"skylift: {platform} job" in stderr and f"node {rank} of 2" in stderr
    stdout = outputs[0][0]
    summary = json.loads(stdout[stdout.index("{"):])
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert summary["replicas_agree"] is True
