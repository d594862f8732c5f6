"""``checkpoint.local_root``: commit on this node's disk first, then upload to S3; resume
reads each file locally when its copy verifies, else from S3 (a moto server on 127.0.0.1).

Kills and two-process runs are subprocesses; a single-process run that is not killed (a
resume, a run whose files are only read, a config error) runs in this process
(``lean_train_here``): its start is not under test, and on one thread it equals the
subprocess's run bit for bit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from skylift.checkpoint.manifest import committed_steps
from skylift.storage import open_store
from tests.checkpoint.runs import assert_same_run, lean_train, lean_train_here, records, summary

KILLED = -9
BUCKET = "skylift-test"  # the bucket the s3_bucket fixture makes


@pytest.fixture
def tiered(moto_server, s3_bucket, tmp_path):
    """(overrides, env, remote store, local folder) for a run with both tiers."""
    url = f"s3://{s3_bucket}/run"
    local = tmp_path / "node-disk"
    overrides = [f"checkpoint.root={url}", f"checkpoint.local_root={local}"]
    env = {"SKYLIFT_S3_ENDPOINT_URL": moto_server.endpoint_url}
    return overrides, env, open_store(url, endpoint_url=moto_server.endpoint_url), local


def _objects(store) -> dict[str, bytes]:
    """Every object under a store's root, to put back into a later test's fresh bucket."""
    return {key: store.read_bytes(key) for key in store.list()}


def _fresh_bucket(moto_server) -> None:
    """What the s3_bucket fixture does, for a module-scoped fixture (which cannot use it)."""
    moto_server.reset()
    moto_server.create_bucket(BUCKET)


@pytest.fixture(scope="module")
def killed_at_step_30(moto_server, tmp_path_factory):
    """A run SIGKILLed after step 30; with synchronous saves, step 28 is committed in both
    places. Killed once for the module: each test resumes its own copy (:func:`_copy_of`)
    of the run folder, the node's disk and the root's objects, so what one test breaks
    (a corrupt file, a lost disk) no other test sees. Returns (folder, root's objects)."""
    _fresh_bucket(moto_server)
    folder = tmp_path_factory.mktemp("killed-at-30")
    url = f"s3://{BUCKET}/run"
    overrides = [f"checkpoint.root={url}", f"checkpoint.local_root={folder / 'node-disk'}"]
    killed = lean_train(folder / "run", *overrides, "checkpoint.async_save=false",
                        env={"SKYLIFT_S3_ENDPOINT_URL": moto_server.endpoint_url,
                             "SKYLIFT_FAULT_INJECTION": "step_end:step=30"})
    assert killed.returncode == KILLED, killed.stderr[-2000:]
    remote = open_store(url, endpoint_url=moto_server.endpoint_url)
    assert committed_steps(remote)[-1] == committed_steps(_local_store(folder / "node-disk"))[-1] == 28
    return folder, _objects(remote)


def _copy_of(killed, tiered, tmp_path):
    """This test's own copy of the killed run: its run folder, node disk and root; returns the run folder."""
    folder, objects = killed
    _, _, remote, local = tiered
    shutil.copytree(folder / "run", tmp_path / "run")
    shutil.copytree(folder / "node-disk", local)
    for key, data in objects.items():
        remote.write_bytes(key, data)
    return tmp_path / "run"


def _local_store(local):
    (folder,) = [path for path in local.iterdir() if path.is_dir()]
    return open_store(str(folder))


def test_every_save_commits_locally_and_in_the_root(tiered, tmp_path, cli_here):
    overrides, env, remote, local = tiered
    result = lean_train_here(cli_here, tmp_path / "run", *overrides, "schedule.max_steps=21", env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    local_store = _local_store(local)
    assert committed_steps(remote) == committed_steps(local_store) == [7, 14, 21]  # keep: 3
    for step in (7, 14, 21):
        local_manifest = json.loads(local_store.read_bytes(f"step-{step}/manifest.json"))
        remote_manifest = json.loads(remote.read_bytes(f"step-{step}/manifest.json"))
        assert local_manifest["files"] == remote_manifest["files"]
    saves = records(tmp_path / "run", "checkpoint")
    assert saves and all(save["uploaded"] and 0 < save["local_commit_s"] <= save["write_s"] for save in saves)


def test_kill_during_upload_resumes_from_the_local_copy_exactly(tiered, reference, tmp_path, cli_here):
    """The upload of step 28 is cut short: S3's newest is 21, the node's disk has 28."""
    overrides, env, remote, local = tiered
    run_dir = tmp_path / "run"
    killed = lean_train(run_dir, *overrides, env={**env, "SKYLIFT_FAULT_INJECTION": "after_upload:step=28"})
    assert killed.returncode == KILLED, killed.stderr[-2000:]
    assert committed_steps(remote)[-1] == 21
    assert committed_steps(_local_store(local))[-1] == 28

    resumed = lean_train_here(cli_here, run_dir, *overrides, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 28
    assert f"6 of 6 files from the local copy {local}" in resumed.stderr
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_corrupt_local_file_is_read_from_the_root_instead(killed_at_step_30, tiered, reference, tmp_path, cli_here):
    overrides, env, remote, local = tiered
    run_dir = _copy_of(killed_at_step_30, tiered, tmp_path)
    model_file = _local_store(local).path("step-28/model.safetensors")
    data = bytearray(model_file.read_bytes())
    data[-3] ^= 0x01
    model_file.write_bytes(bytes(data))

    resumed = lean_train_here(cli_here, run_dir, *overrides, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 28
    assert "step-28/model.safetensors does not match the manifest" in resumed.stderr
    assert "used the root's copy" in resumed.stderr
    assert_same_run(run_dir, reference)


@pytest.mark.slow
def test_lost_local_disk_resumes_from_the_root(killed_at_step_30, tiered, reference, tmp_path, cli_here):
    overrides, env, remote, local = tiered
    run_dir = _copy_of(killed_at_step_30, tiered, tmp_path)
    shutil.rmtree(local)  # a new VM: the node's disk is gone, S3 is not

    resumed = lean_train_here(cli_here, run_dir, *overrides, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 28
    assert_same_run(run_dir, reference)


def test_local_root_without_an_object_store_root_is_a_clear_error(tmp_path, cli_here):
    result = lean_train_here(cli_here, tmp_path / "run", f"checkpoint.local_root={tmp_path / 'disk'}")
    assert result.returncode == 2
    assert "checkpoint.local_root" in result.stderr and "object store" in result.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_resume_from_the_local_copy_after_a_rank_dies_mid_upload(tiered, reference_ddp, tmp_path):
    overrides, env, remote, local = tiered
    run_dir = tmp_path / "run"
    crashed = lean_train(run_dir, *overrides, "preemption.grace_s=5", nproc=2,
                         env={**env, "SKYLIFT_FAULT_INJECTION": "after_upload:step=28:rank=1"})
    assert crashed.returncode != 0
    assert committed_steps(remote)[-1] == 21, "the root never saw step 28's manifest"
    assert committed_steps(_local_store(local))[-1] == 28

    resumed = lean_train(run_dir, *overrides, nproc=2, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 28
    assert summary(run_dir)["replicas_agree"] is True
    assert_same_run(run_dir, reference_ddp)


@pytest.mark.slow
def test_corrupt_local_manifest_is_named_and_the_roots_is_used(killed_at_step_30, tiered, reference, tmp_path,
                                                                cli_here):
    overrides, env, remote, local = tiered
    run_dir = _copy_of(killed_at_step_30, tiered, tmp_path)
    _local_store(local).path("step-28/manifest.json").write_text("{not json")

    resumed = lean_train_here(cli_here, run_dir, *overrides, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 28
    assert "used the root's manifest" in resumed.stderr and "step-28/manifest.json" in resumed.stderr
    assert_same_run(run_dir, reference)


def _two_nodes(tmp_path, overrides, env, *, timeout_s=300):
    """Nodes 0 and 1 (one process each) on loopback, each with its own run folder and
    its own node disk; returns each node's (exit code, stderr)."""
    import os
    import subprocess
    import sys

    from tests.checkpoint.runs import EXACT, LEAN
    from tests.conftest import REPO_ROOT
    from tests.servers import free_port

    port, launched = free_port(), []
    for node in (0, 1):
        args = [sys.executable, "-m", "skylift", "run", "examples/quickstart.yaml", "--json",
                "--nproc", "1", "--nnodes", "2", "--node-rank", str(node),
                "--master-addr", "127.0.0.2", "--master-port", str(port), "--one-machine", "--no-doctor"]  # fmt: skip
        for override in (*EXACT, *LEAN, *overrides, f"run_dir={tmp_path / f'run-node{node}'}",
                         f"checkpoint.local_root={tmp_path / f'disk-node{node}'}"):  # fmt: skip
            args += ["--set", override]
        log = (tmp_path / f"node{node}.log").open("w")  # files: a full pipe would stall a rank
        launched.append((subprocess.Popen(args, cwd=REPO_ROOT, env={**os.environ, **env}, stdout=log, stderr=log), log))
    results = []
    for process, log in launched:
        process.wait(timeout=timeout_s)
        log.close()
        results.append((process.returncode, Path(log.name).read_text()))
    return results


def _two_nodes_killed_after_uploading_step_28(moto_server, s3_bucket, tmp_path):
    """Node 1 dies after uploading step 28, before the root's commit: (overrides, env).

    Each node's disk then holds step 28's manifest, the replicated state and its own
    ranks' files (not the other node's)."""
    import os

    url = f"s3://{s3_bucket}/two-nodes"
    overrides = [f"checkpoint.root={url}", "preemption.grace_s=5"]
    # The threads per worker the one-node reference got: the launcher's default, the cores over
    # its 2 workers, unless the suite's environment set them (an xdist worker's share of the
    # cores, tests/conftest.py). Another thread count sums matmuls in another order.
    threads = os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // 2))
    env = {"SKYLIFT_S3_ENDPOINT_URL": moto_server.endpoint_url, "OMP_NUM_THREADS": threads}
    crashed = _two_nodes(tmp_path, overrides, {**env, "SKYLIFT_FAULT_INJECTION": "after_upload:step=28:rank=1"})
    assert all(code != 0 for code, _ in crashed), crashed
    assert committed_steps(open_store(url, endpoint_url=moto_server.endpoint_url))[-1] == 21
    node_disks = [_local_store(tmp_path / f"disk-node{node}") for node in (0, 1)]
    assert [committed_steps(disk)[-1] for disk in node_disks] == [28, 28]
    files_on = [set(json.loads(disk.read_bytes("step-28/manifest.json"))["files"]) for disk in node_disks]
    assert files_on[0] == files_on[1]
    held = [{path.name for path in disk.path("step-28").iterdir()} - {"manifest.json"} for disk in node_disks]
    assert held[0] == {name for name in files_on[0] if "rank1" not in name}
    assert held[1] == {name for name in files_on[1] if "rank0" not in name}
    return overrides, env


@pytest.fixture(scope="module")
def two_nodes_killed(moto_server, tmp_path_factory):
    """The two-node crash above, once for the module: (folder, overrides, env, root's objects).
    Each test resumes its own copy of it (:func:`_two_nodes_copy`)."""
    _fresh_bucket(moto_server)
    folder = tmp_path_factory.mktemp("two-nodes-killed")
    overrides, env = _two_nodes_killed_after_uploading_step_28(moto_server, BUCKET, folder)
    objects = _objects(open_store(f"s3://{BUCKET}/two-nodes", endpoint_url=moto_server.endpoint_url))
    return folder, overrides, env, objects


def _two_nodes_copy(killed, moto_server, s3_bucket, tmp_path):
    """Both nodes' run folders and disks, and the root, as the crash left them: (overrides, env)."""
    folder, overrides, env, objects = killed
    for name in ("run-node0", "run-node1", "disk-node0", "disk-node1"):
        if (folder / name).exists():  # node 1 writes no run folder
            shutil.copytree(folder / name, tmp_path / name)
    remote = open_store(f"s3://{s3_bucket}/two-nodes", endpoint_url=moto_server.endpoint_url)
    for key, data in objects.items():
        remote.write_bytes(key, data)
    return overrides, env


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_resume_from_their_local_copies(two_nodes_killed, moto_server, s3_bucket, reference_ddp, tmp_path):
    overrides, env = _two_nodes_copy(two_nodes_killed, moto_server, s3_bucket, tmp_path)
    resumed = _two_nodes(tmp_path, overrides, env)
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    assert summary(tmp_path / "run-node0")["resumed_from_step"] == 28
    assert "resumed from s3://" in resumed[0][1] and "step-28: 6 of 6 files from the local copy" in resumed[0][1]
    assert_same_run(tmp_path / "run-node0", reference_ddp)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_nodes_fall_back_together_when_one_lost_its_disk(two_nodes_killed, moto_server, s3_bucket, reference_ddp,
                                                             tmp_path):
    """Node 1 comes back as a new VM: step 28 is nowhere for its rank, so both take 21."""
    overrides, env = _two_nodes_copy(two_nodes_killed, moto_server, s3_bucket, tmp_path)
    shutil.rmtree(tmp_path / "disk-node1")
    resumed = _two_nodes(tmp_path, overrides, env)
    assert [code for code, _ in resumed] == [0, 0], resumed[0][1][-3000:] + resumed[1][1][-3000:]
    assert "skylift[rank 1]: skipping checkpoint" in resumed[1][1] and "step-28" in resumed[1][1]
    assert summary(tmp_path / "run-node0")["resumed_from_step"] == 21
    assert_same_run(tmp_path / "run-node0", reference_ddp)


def test_replicated_files_that_differ_from_rank_0s_leave_the_local_copy(tmp_path, caplog):
    """A node leader other than rank 0's checks its copy of the replicated state against
    the manifest rank 0 committed: a diverged replica must not be resumed from."""
    from skylift.checkpoint.manifest import Manifest, file_entry
    from skylift.checkpoint.tiers import LocalTier

    tier = LocalTier(str(tmp_path / "disk"), open_store(str(tmp_path / "root")), node_leader=True)
    written = {"model.safetensors": b"this node's weights", "trainer.json": b"{}"}
    for name, data in written.items():
        tier.store.write_bytes(f"step-7/{name}", data)
    rank_0s = {"model.safetensors": file_entry(b"rank 0's weights"), "trainer.json": file_entry(b"{}")}
    manifest = Manifest.create(7, 2, rank_0s).encode()

    dropped = tier.drop_mismatches(7, manifest, {name: file_entry(data) for name, data in written.items()})
    assert dropped == ["model.safetensors"]
    assert not tier.store.exists("step-7/model.safetensors") and tier.store.exists("step-7/trainer.json")
    assert "model.safetensors differ from rank 0's" in caplog.text


def test_local_folders_holding_only_temporaries_are_cleaned(tmp_path):
    """A node killed during a local step folder's first file leaves only a hidden temporary
    there: the node leader's start-up cleanup removes that folder too."""
    from skylift.checkpoint.tiers import LocalTier

    tier = LocalTier(str(tmp_path / "disk"), open_store(str(tmp_path / "root")), node_leader=True)
    tier.store.write_bytes("step-5/manifest.json", b"{}")
    tier.store.write_bytes("step-6/model.safetensors", b"half-written")
    (tier.store.root / "step-7").mkdir()
    (tier.store.root / "step-7" / ".skylift-tmp-model.safetensors.89ab").write_bytes(b"half")
    tier.remove_uncommitted()
    assert sorted(path.name for path in tier.store.root.iterdir()) == ["step-5"]
