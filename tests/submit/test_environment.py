"""In-job detection of each platform's rank/master contract, on recorded environments
and files, and its hook into ``skylift run``'s topology flags."""

from __future__ import annotations

import json

import pytest

from skylift.submit import environment
from skylift.submit.environment import TopologyFlags, detect_platform_topology, fill_from_platform

# What each platform sets on node 1 of a 2-node job (from their documentation).
RECORDED = {
    "PAI-DLC": {"MASTER_ADDR": "dlc1a2b3c4d-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
                "NPROC_PER_NODE": "8", "SKYLIFT_PLATFORM": "pai"},
    "TI-ONE": {"MASTER_ADDR": "10.0.0.4", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1", "INDEX": "1",
               "NODE_LIST": "10.0.0.4:8,10.0.0.5:8", "GPU_NUM": "16", "GPU_NUM_PER_NODE": "8"},
    "Kubeflow": {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "8", "PET_NODE_RANK": "1",
                 "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"},
    "SkyPilot": {"SKYPILOT_NODE_IPS": "10.0.1.7\n10.0.1.8", "SKYPILOT_NODE_RANK": "1", "SKYPILOT_NUM_NODES": "2",
                 "SKYPILOT_NUM_GPUS_PER_NODE": "8"},
}
EXPECTED_MASTER = {"PAI-DLC": ("dlc1a2b3c4d-master-0", 23456), "TI-ONE": ("10.0.0.4", 23456),
                   "Kubeflow": ("job-node-0-0.job", 29500), "SkyPilot": ("10.0.1.7", 29500)}


@pytest.fixture
def no_sagemaker(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "FILESYSTEM_ROOT", tmp_path)  # no SageMaker resource config under it


@pytest.mark.parametrize("platform", list(RECORDED))
def test_each_platforms_variables_give_its_topology(platform, no_sagemaker):
    found = detect_platform_topology(RECORDED[platform])
    assert found.platform == platform
    assert (found.nnodes, found.node_rank, found.nproc) == (2, 1, 8)
    assert (found.master_addr, found.master_port) == EXPECTED_MASTER[platform]


def test_sagemaker_resource_config_gives_rank_and_master(tmp_path):
    path = tmp_path / "opt/ml/input/config/resourceconfig.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"current_host": "algo-2", "hosts": ["algo-2", "algo-1"],
                                "current_instance_type": "ml.p3.16xlarge", "network_interface_name": "eth0"}))
    found = detect_platform_topology({}, filesystem_root=tmp_path)
    assert (found.platform, found.nnodes, found.node_rank) == ("SageMaker", 2, 1)
    assert (found.master_addr, found.master_port) == ("algo-1", 7777)
    assert found.nproc is None  # one per visible GPU
    assert found.grace_s == 110.0  # inside SageMaker's 120 s from SIGTERM to SIGKILL


def test_a_torchrun_worker_detects_nothing(no_sagemaker):
    assert detect_platform_topology({**RECORDED["PAI-DLC"], "LOCAL_RANK": "0"}) is None


def test_plain_rank_variables_are_not_mistaken_for_a_platform(no_sagemaker):
    assert detect_platform_topology({"MASTER_ADDR": "x", "WORLD_SIZE": "2", "RANK": "0"}) is None


def test_unset_flags_take_the_platforms_values_and_node_level_rank_is_removed(no_sagemaker, capsys):
    environ = dict(RECORDED["PAI-DLC"])
    args, _ = fill_from_platform(TopologyFlags(), environ)
    assert (args.nproc, args.nnodes, args.node_rank, args.master_addr, args.master_port) == (
        8, 2, 1, "dlc1a2b3c4d-master-0", 23456)
    assert "RANK" not in environ and "WORLD_SIZE" not in environ  # torchrun sets its own per process
    assert "PAI-DLC job" in capsys.readouterr().err


def test_an_explicit_flag_wins_and_is_reported(no_sagemaker, capsys):
    args, _ = fill_from_platform(TopologyFlags(nproc=4), dict(RECORDED["Kubeflow"]))
    assert args.nproc == 4 and args.nnodes == 2
    assert "--nproc 4 overrides Kubeflow's 8" in capsys.readouterr().err


def test_off_platform_the_defaults_apply_silently(no_sagemaker, capsys):
    args, grace_s = fill_from_platform(TopologyFlags(), {})
    assert grace_s is None
    assert (args.nproc, args.nnodes, args.node_rank, args.master_addr) == (1, 1, 0, "127.0.0.1")
    assert capsys.readouterr().err == ""


def test_a_garbled_variable_is_a_clear_error(no_sagemaker):
    from skylift.errors import SkyliftConfigError

    with pytest.raises(SkyliftConfigError, match="PET_NNODES"):
        detect_platform_topology({"PET_NNODES": "two"})
