"""``skylift launch`` runs unmodified torchrun-style scripts."""

from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out = sys.argv[1]
    with open(os.path.join(out, f"rank{rank}.txt"), "w") as handle:
        handle.write(f"{rank} {world} {os.environ['LOCAL_RANK']} {total.item()} {' '.join(sys.argv[2:])}")
    with open(os.path.join(out, f"gloo-interface{rank}.txt"), "w") as handle:
        handle.write(os.environ.get("GLOO_SOCKET_IFNAME", ""))
    if len(sys.argv) > 2 and sys.argv[2] == "fail" and rank == 1:
        sys.exit(3)
    """
)


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


@pytest.mark.multiprocess
def test_launch_runs_an_unmodified_script_on_two_processes(cli, script, tmp_path):
    result = cli("launch", "--nproc", "2", "--", "python", str(script), str(tmp_path), "--epochs", "3")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted((tmp_path / f"rank{rank}.txt").read_text() for rank in range(2))
    assert lines == ["0 2 0 3.0 --epochs 3", "1 2 1 3.0 --epochs 3"]
    assert "terminate called" not in result.stderr
    # A loopback rendezvous keeps gloo on the loopback interface.
    assert {(tmp_path / f"gloo-interface{rank}.txt").read_text() for rank in range(2)} == {"lo"}


@pytest.mark.multiprocess
def test_launch_returns_the_failing_workers_exit_code(cli, script, tmp_path):
    result = cli("launch", "--nproc", "2", "--", "python", str(script), str(tmp_path), "fail")
    assert result.returncode == 3
    assert "exit code 3" in result.stderr


def test_launch_without_a_script_explains(cli_here):
    result = cli_here("launch", "--nproc", "2")
    assert result.returncode == 2
    assert "skylift launch --nproc 2 -- python train.py" in result.stderr


def test_launch_dry_run_shows_torchrun(cli_here, script):
    result = cli_here("launch", "--nproc", "4", "--dry-run", "--", "python", str(script))
    assert result.returncode == 0
    assert "--nproc-per-node=4" in result.stdout and str(script) in result.stdout


def test_multi_node_needs_an_address_and_port(cli_here, script):
    result = cli_here("launch", "--nproc", "2", "--nnodes", "2", "--", "python", str(script))
    assert result.returncode == 2
    assert "--master-port is required" in result.stderr
