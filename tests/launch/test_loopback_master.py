"""One rule for a loopback master: with ``--nnodes > 1`` every loopback address (127/8,
``localhost``, ``::1``) is refused, since on a cluster each node would wait for itself,
unless ``--one-machine`` says every node is a command on this machine (a rehearsal of a
multi-node or elastic job); the error says how to rehearse."""

from __future__ import annotations

import pytest

from skylift.errors import SkyliftConfigError
from skylift.launch.launcher import Topology


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "127.0.0.2", "::1"])
def test_every_loopback_master_of_a_multi_node_job_is_refused_with_how_to_rehearse(address):
    with pytest.raises(SkyliftConfigError) as raised:
        Topology(nproc=1, nnodes=2, master_addr=address, master_port=29500).validate()
    message = str(raised.value)
    assert f"--master-addr {address} is this machine's loopback" in message
    assert "To rehearse a multi-node or elastic job on one machine" in message and "--one-machine" in message


@pytest.mark.parametrize("address", ["127.0.0.1", "localhost", "127.0.0.2"])
def test_one_machine_takes_any_loopback_master(address):
    Topology(nproc=1, nnodes=2, node_rank=1, master_addr=address, master_port=29500, one_machine=True).validate()


def test_one_machine_refuses_a_master_on_another_machine():
    with pytest.raises(SkyliftConfigError, match=r"--one-machine runs every node on this machine: --master-addr must "
                                                 r"be a loopback address \(127.0.0.1\), got 10.0.0.5"):
        Topology(nproc=1, nnodes=2, master_addr="10.0.0.5", master_port=29500, one_machine=True).validate()


def test_one_node_keeps_its_loopback_default():
    Topology(nproc=2).validate()


def test_the_cli_refuses_127_0_0_2_without_the_flag_and_dry_runs_with_it(cli_here, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('hello')\n")
    flags = ("--nproc", "1", "--nnodes", "2", "--master-addr", "127.0.0.2", "--master-port", "29500", "--dry-run")
    refused = cli_here("launch", *flags, "--", "python", str(script))
    assert refused.returncode == 2 and "--one-machine" in refused.stderr, refused.stderr
    rehearsed = cli_here("launch", *flags, "--one-machine", "--", "python", str(script))
    assert rehearsed.returncode == 0, rehearsed.stderr
    assert "--master-addr=127.0.0.2" in rehearsed.stdout
