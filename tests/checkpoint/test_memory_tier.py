"""``checkpoint.memory``'s parts on real sockets: a node's step files reach its peer's
memory folder whole or not at all, only for the peer's own token, and a sender killed
mid-file leaves the previous step readable there."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from skylift.checkpoint.manifest import Manifest, file_entry, step_folder
from skylift.checkpoint.memory_tier import MemoryTier, memory_budget_problem
from skylift.checkpoint.replica import ReplicaError, ReplicaPeer
from skylift.checkpoint.tiers import read_with_fallback
from skylift.config.checkpoint import MemoryTierConfig
from skylift.storage import open_store
from tests.conftest import REPO_ROOT


def _node(tmp_path, name: str) -> MemoryTier:
    remote = open_store(str(tmp_path / "root"))  # never read below: the reads must all come from memory
    return MemoryTier(MemoryTierConfig(enabled=True, root=str(tmp_path / name)), remote, node_leader=True)


def _commit(tier: MemoryTier, step: int, files: dict[str, bytes]) -> bytes:
    for name, data in files.items():
        tier.store.write_bytes(f"{step_folder(step)}/{name}", data)
    manifest = Manifest.create(step, 2, {name: file_entry(data) for name, data in files.items()}).encode()
    tier.write_manifest(step, manifest)
    return manifest


def _receiving(tier: MemoryTier) -> ReplicaPeer:
    peer = tier.listen("127.0.0.1", timeout_s=10)
    assert peer is not None
    return peer


def test_a_step_reaches_the_peers_memory_and_reads_back_verified_without_the_root(tmp_path):
    sender, receiver = _node(tmp_path, "node0"), _node(tmp_path, "node1")
    sender.peer = _receiving(receiver)
    try:
        files = {"model-rank0.safetensors": os.urandom(3 * 2**20), "rng-rank0.pt": b"rng state", "trainer.json": b"{}"}
        manifest = _commit(sender, 4, files)
        receiver.store.write_bytes("step-4/trainer.json", b"{}")  # the peer's own copy of a replicated file
        sent = sender.replicate(4, manifest)
    finally:
        receiver.close()
    assert sent == len(files["model-rank0.safetensors"]) + len(files["rng-rank0.pt"]), "held files are not resent"
    decoded = Manifest.decode(manifest, "test")
    contents, sources = read_with_fallback(decoded, sorted(files), receiver.store, sender.remote)
    assert contents == files and set(sources.values()) == {"local"}
    assert receiver.store.read_bytes("step-4/manifest.json") == manifest
    assert receiver.receiver is None and 4 in sender.bytes_sent


def test_a_connection_without_the_peers_token_stores_nothing(tmp_path):
    sender, receiver = _node(tmp_path, "node0"), _node(tmp_path, "node1")
    real = _receiving(receiver)
    sender.peer = ReplicaPeer(real.address, real.port, token="0" * 32)
    try:
        manifest = _commit(sender, 4, {"rng-rank0.pt": b"rng state"})
        with pytest.raises(ReplicaError, match="did not answer"):
            sender.replicate(4, manifest)
    finally:
        receiver.close()
    assert receiver.store.list() == []


SENDER = textwrap.dedent("""
    import sys
    from skylift.checkpoint.memory_tier import MemoryTier
    from skylift.checkpoint.replica import ReplicaPeer
    from skylift.config.checkpoint import MemoryTierConfig
    from skylift.storage import open_store

    root, remote, address, port, token, step = sys.argv[1:]
    tier = MemoryTier(MemoryTierConfig(enabled=True, root=root), open_store(remote), node_leader=True)
    tier.peer = ReplicaPeer(address, int(port), token)
    tier.replicate(int(step), tier.store.read_bytes(f"step-{step}/manifest.json"))
""")


def test_a_sender_killed_mid_file_leaves_nothing_torn_and_the_previous_step_whole(tmp_path):
    sender, receiver = _node(tmp_path, "node0"), _node(tmp_path, "node1")
    peer = _receiving(receiver)
    sender.peer = peer
    try:
        before = {"model-rank0.safetensors": os.urandom(2**20), "rng-rank0.pt": b"step 5"}
        sender.replicate(5, _commit(sender, 5, before))
        # Step 6's shard spans three pieces: the fault point after the first one kills the sender.
        after = {"model-rank0.safetensors": os.urandom(20 * 2**20), "rng-rank0.pt": b"step 6"}
        _commit(sender, 6, after)
        killed = subprocess.run(
            [sys.executable, "-c", SENDER, str(sender.store.root.parent), str(tmp_path / "root"), peer.address,
             str(peer.port), peer.token, "6"],
            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
            env={**os.environ, "SKYLIFT_FAULT_INJECTION": "during_replication:step=6"},
        )  # fmt: skip
        assert killed.returncode == -9, killed.stderr[-2000:]
        # The receiver sees the connection close mid-file and drops its temporary.
        deadline = time.monotonic() + 30
        while receiver.store.temporary_keys():
            if time.monotonic() > deadline:
                raise AssertionError(f"temporaries left: {receiver.store.temporary_keys()}")
            time.sleep(0.05)
    finally:
        receiver.close()
    assert not receiver.store.exists("step-6/model-rank0.safetensors")
    assert receiver.store.temporary_keys() == []
    manifest = Manifest.decode(receiver.store.read_bytes("step-5/manifest.json"), "test")
    contents, _ = read_with_fallback(manifest, sorted(before), receiver.store, sender.remote)
    assert contents == before


def test_a_memory_that_cannot_hold_the_copies_is_refused_with_the_fix(tmp_path):
    tier = _node(tmp_path, "node0")
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    problem = memory_budget_problem(tier, node_share_bytes=free, peer_share_bytes=free)
    assert problem is not None
    assert problem.startswith("checkpoint.memory: this node needs") and "3 steps of its" in problem
    assert "mount -o remount,size=" in problem and "checkpoint.memory.enabled: false" in problem
    assert memory_budget_problem(tier, node_share_bytes=2**20, peer_share_bytes=2**20) is None


def test_the_memory_tier_in_front_of_a_local_folder_is_a_clear_error(tmp_path, cli_here):
    from tests.checkpoint.runs import lean_train_here

    result = lean_train_here(cli_here, tmp_path / "run", "checkpoint.memory.enabled=true",
                             f"checkpoint.memory.root={tmp_path / 'shm'}")
    assert result.returncode == 2
    assert "checkpoint.memory.enabled" in result.stderr and "object store" in result.stderr


def test_a_resume_that_finds_the_safe_step_nowhere_says_which_step_it_passed_over(tmp_path, caplog):
    from skylift.checkpoint.memory_tier import SAFE_MARKER, passed_over_safe_step

    root = open_store(str(tmp_path / "root"))
    assert passed_over_safe_step(root, 14) is None  # never safe: nothing to say
    root.write_bytes(SAFE_MARKER, b"step-21\n")
    line = passed_over_safe_step(root, 14)
    assert line is not None and line.startswith("step 21 was safe in memory, but no node of this job holds it now")
    assert "resumed from step 14, the newest durable checkpoint" in line and line in caplog.text
    assert passed_over_safe_step(root, 21) is None
