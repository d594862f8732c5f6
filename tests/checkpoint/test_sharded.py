"""Sharded checkpoints (FSDP2 + DCP) inside skylift's commit protocol.

The runs are real: 2 gloo processes (torch.multiprocessing) train a tiny model under
``fully_shard`` and save through ``Checkpointing`` as the Runtime does
(tests/checkpoint/sharded_runs.py). One such run is shared by the fast tests here; the
resharding and kill runs start more processes and are in the slow lane. Comparisons are
bitwise: a restore copies the saved bytes, and a resumed run repeats the uninterrupted
run's arithmetic on the same ranks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
import random
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load, load_file

from skylift.checkpoint.consolidate import full_model_state
from skylift.checkpoint.manager import CheckpointManager
from skylift.checkpoint.manifest import (
    CorruptCheckpointError,
    Manifest,
    committed_steps,
    file_entry,
    read_manifest,
    read_verified,
)
from skylift.checkpoint.session import TrainingObjects
from skylift.checkpoint.sharded import capture_sharded, decode_metadata, encode_metadata
from skylift.checkpoint.state import Snapshot
from skylift.errors import SkyliftConfigError
from skylift.loop.events import TrainState
from skylift.storage import open_store
from tests.checkpoint.sharded_runs import build, checkpointing, full_state, spawn

SAVES = [2, 4, 6]


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """2 ranks, 6 steps, sharded saves at 2, 4 and 6 (async: copies deferred to the writer)."""
    base = tmp_path_factory.mktemp("sharded")
    spawn("train", 2, root=str(base / "checkpoints"), results=str(base / "results"), steps=6, save_at=SAVES)
    return base


@pytest.fixture
def root_copy(sharded_run, tmp_path):
    """A copy of the shared run's checkpoint root that a test may change."""
    return shutil.copytree(sharded_run / "checkpoints", tmp_path / "checkpoints")


def _saved(sharded_run, step: int | str) -> dict[str, torch.Tensor]:
    """The gathered full state the run recorded right after its save at ``step`` (or at its end: ``final``)."""
    name = f"full-step{step}" if isinstance(step, int) else f"full-{step}"
    return load_file(sharded_run / "results" / f"{name}.safetensors")


def _model_part(flat: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name.removeprefix("model/"): value for name, value in flat.items() if name.startswith("model/")}


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name} differs"


@contextlib.contextmanager
def _rng_kept():
    """A resume in this process restores the checkpoint's RNG streams: keep the session's."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


def _resume_here(root, *, resume: str = "auto"):
    """Resume ``root`` in this process, into a plain (unsharded) model: what a
    one-process run without sharding does with a sharded checkpoint (2 -> 1)."""
    session = checkpointing(root, 1, 0, resume=resume)
    model, optimizer, scheduler = build(None, seed=7)  # other initial weights: the restore must replace them
    state = TrainState(total_steps=6, steps_per_epoch=6, global_batch_size=16)
    try:
        with _rng_kept():
            session.open()
            step = session.resume(TrainingObjects(model, optimizer, scheduler, None), state)
    finally:
        session.close()
    return step, model, optimizer, scheduler, state


def test_every_rank_writes_its_shards_and_rank_0_commits_their_hashes(sharded_run):
    store = open_store(str(sharded_run / "checkpoints"))
    assert committed_steps(store) == SAVES
    manifest = read_manifest(store, 6)
    assert (manifest.layout, manifest.world_size) == ("sharded", 2)
    shards = {f"{kind}-rank{rank}.safetensors" for kind in ("model", "optimizer") for rank in (0, 1)}
    assert shards <= set(manifest.files)
    files = read_verified(store, 6, manifest)  # every file, each against its size and sha256
    metadata = json.loads(files["dcp-metadata.json"])
    # Each rank wrote its own rows of the first layer: fully_shard splits dim 0 over the ranks.
    first_layer = {chunk["file"]: chunk["offsets"] for chunk in metadata["storage"] if chunk["fqn"] == "model/0.weight"}
    assert set(first_layer) == {"model-rank0.safetensors", "model-rank1.safetensors"}
    assert first_layer["model-rank0.safetensors"] == [0, 0] and first_layer["model-rank1.safetensors"][0] > 0
    for name in shards:
        assert all(key.startswith(name.split("-")[0] + "/") for key in load(files[name]))


def test_saves_are_recorded_with_their_stall_and_the_deferred_copies_hold_the_saved_step(sharded_run):
    records = json.loads((sharded_run / "results" / "saves.json").read_text())
    assert [record["step"] for record in records] == SAVES
    assert all(record["committed"] and record["stall_s"] > 0 and record["write_s"] > 0 for record in records)
    # Training went on while the writer copied parameters and optimizer state; each
    # checkpoint still holds its own step's weights.
    for step in SAVES:
        saved_step, weights = full_model_state(str(sharded_run / "checkpoints"), step=step)
        assert saved_step == step
        _assert_equal(weights, _model_part(_saved(sharded_run, step)))


def test_consolidation_of_the_newest_checkpoint_equals_the_gathered_full_state(sharded_run):
    step, weights = full_model_state(str(sharded_run / "checkpoints"))
    assert step == 6
    _assert_equal(weights, _model_part(_saved(sharded_run, "final")))
    assert all(tensor.device.type == "cpu" and tensor.is_contiguous() for tensor in weights.values())


def test_a_sharded_checkpoint_resumes_into_one_unsharded_process_with_the_full_state(root_copy, sharded_run):
    step, model, optimizer, scheduler, state = _resume_here(root_copy)
    assert (step, state.step) == (6, 6)
    _assert_equal(full_state(model, optimizer), _saved(sharded_run, 6))
    # LambdaLR's own arithmetic at step 6 (base lr x 1 / (1 + step)), restored through JSON exactly.
    assert scheduler.last_epoch == 6 and optimizer.param_groups[0]["lr"] == 0.02 * (1.0 / (1 + 6))


def test_loading_never_unpickles(root_copy, sharded_run, monkeypatch):
    def refuse(*_, **__):
        raise AssertionError("a checkpoint load unpickled something")

    for module, name in ((pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")):
        monkeypatch.setattr(module, name, refuse)
    _, weights = full_model_state(str(root_copy))
    _assert_equal(weights, _model_part(_saved(sharded_run, 6)))
    _, model, optimizer, *_ = _resume_here(root_copy)
    monkeypatch.undo()
    _assert_equal(full_state(model, optimizer), _saved(sharded_run, 6))


class _Payload:
    """Unpickling this creates ``marker``: proof that a loader ran a pickle."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _forge(root, step: int, name: str, data: bytes) -> None:
    """Replace a committed file and its manifest entry: a writer that can forge both."""
    store = open_store(str(root))
    manifest = read_manifest(store, step)
    store.write_bytes(f"step-{step}/{name}", data)
    files = {**manifest.files, name: file_entry(data)}
    forged = Manifest(manifest.step, manifest.world_size, files, manifest.created_at, manifest.layout)
    store.write_bytes(f"step-{step}/manifest.json", forged.encode())


def test_a_pickled_metadata_file_is_refused_unread_and_auto_falls_back(root_copy, tmp_path, caplog):
    marker = tmp_path / "unpickled"
    _forge(root_copy, 6, "dcp-metadata.json", pickle.dumps(_Payload(marker)))
    with pytest.raises(CorruptCheckpointError, match="dcp-metadata.json is not JSON"):
        full_model_state(str(root_copy), step=6)
    with caplog.at_level(logging.WARNING, logger="skylift"):
        step, *_ = _resume_here(root_copy)
    assert step == 4 and "skipping checkpoint" in caplog.text and "step-6" in caplog.text
    assert not marker.exists()


def test_a_corrupt_shard_is_skipped_by_auto_and_refused_by_an_explicit_resume(root_copy, sharded_run, caplog):
    shard = root_copy / "step-6" / "model-rank1.safetensors"
    data = bytearray(shard.read_bytes())
    data[-3] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="model-rank1.safetensors does not match the manifest"):
        _resume_here(root_copy, resume=str(root_copy / "step-6"))
    with caplog.at_level(logging.WARNING, logger="skylift"):
        step, model, optimizer, *_ = _resume_here(root_copy)
    assert step == 4 and "step-6" in caplog.text
    _assert_equal(full_state(model, optimizer), _saved(sharded_run, 4))
    assert full_model_state(str(root_copy))[0] == 4


def test_metadata_survives_its_json_round_trip(sharded_run):
    store = open_store(str(sharded_run / "checkpoints"))
    document = json.loads(read_verified(store, 6, read_manifest(store, 6), ["dcp-metadata.json"])["dcp-metadata.json"])
    metadata = decode_metadata(json.dumps(document).encode(), "test")
    assert encode_metadata(metadata, metadata.storage_data) == document


OTHER_SHAPE = b'{"format": "skylift-dcp-metadata/1", "tensors": {"x": {}}, "storage": []}'


@pytest.mark.parametrize("damage", [b"{}", OTHER_SHAPE])
def test_metadata_of_another_shape_is_refused_naming_the_file(damage):
    with pytest.raises(CorruptCheckpointError, match="step-1/dcp-metadata.json: unreadable DCP metadata"):
        decode_metadata(damage, "step-1/dcp-metadata.json")


def test_a_model_that_is_not_the_checkpoints_is_refused_naming_its_parameters(root_copy):
    session = checkpointing(root_copy, 1, 0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainState(total_steps=6, steps_per_epoch=6, global_batch_size=16)
    with _rng_kept(), pytest.raises(SkyliftConfigError, match="is not this model and optimizer's state"):
        session.open()
        session.resume(TrainingObjects(model, optimizer, None, None), state)
    session.close()


def test_an_injected_fault_between_shard_writes_leaves_the_step_invisible(store, monkeypatch):
    """One process, any store (local, S3): a failed shard write abandons the step; the
    previous commit stays the newest and consolidates."""
    model, optimizer, _ = build(None)
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=True)

    def save(step):
        with torch.no_grad():
            model[0].weight.add_(1.0)  # each step's weights differ
        def take() -> Snapshot:
            return capture_sharded(step=step, rank=0, model=model, optimizer=optimizer, scheduler=None,
                                   scaler=None, counters={"step": step}, group=None, defer=True)
        result = manager.save(take, step)
        manager.wait()
        return result

    assert save(1).committed
    weights = {name: value.clone() for name, value in model.state_dict().items()}
    monkeypatch.setenv("SKYLIFT_FAULT_INJECTION", "during_payload:step=2:action=raise")
    failed = save(2)
    manager.close()
    assert not failed.committed and "injected fault" in failed.error
    assert committed_steps(store) == [1] and not store.list("step-2")
    step, consolidated = full_model_state(store.url, endpoint_url=getattr(store, "endpoint_url", None))
    assert step == 1
    _assert_equal(consolidated, weights)


def test_a_sharded_save_commits_on_the_node_disk_then_in_the_object_store(moto_server, s3_bucket, tmp_path):
    from skylift.checkpoint.tiers import LocalTier

    remote = open_store(f"s3://{s3_bucket}/run", endpoint_url=moto_server.endpoint_url)
    tier = LocalTier(str(tmp_path / "node-disk"), remote, node_leader=True)
    manager = CheckpointManager(remote, rank=0, world_size=1, keep=2, async_save=True, tier=tier)
    model, optimizer, _ = build(None)
    model(torch.randn(4, 5)).sum().backward()
    optimizer.step()
    result = manager.save(lambda: capture_sharded(step=1, rank=0, model=model, optimizer=optimizer, scheduler=None,
                                                  scaler=None, counters={"step": 1}, group=None, defer=True), 1)
    manager.close()
    assert result.committed and result.uploaded and result.local_commit_s is not None
    for copy in (tier.store, remote):
        manifest = read_manifest(copy, 1)
        assert manifest.layout == "sharded"
        read_verified(copy, 1, manifest)
    _, weights = full_model_state(remote.url, endpoint_url=moto_server.endpoint_url)
    _assert_equal(weights, model.state_dict())


class _WithUnused(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, batch):
        return self.used(batch)


def test_a_parameter_that_never_had_a_gradient_gets_no_optimizer_state_back(tmp_path):
    """AdamW keeps no state for a parameter without a gradient; DCP's set-up for the
    load gives it some (a step with zero gradients). The restore must drop it again."""
    from skylift.checkpoint.sharded import restore_sharded

    store = open_store(str(tmp_path / "root"))
    model = _WithUnused()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False)
    manager.save(lambda: capture_sharded(step=1, rank=0, model=model, optimizer=optimizer, scheduler=None,
                                         scaler=None, counters={"step": 1}, group=None), 1)
    manifest = read_manifest(store, 1)
    contents = read_verified(store, 1, manifest)
    fresh = _WithUnused()
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    restore_sharded(contents, contents.__getitem__, model=fresh, optimizer=fresh_optimizer, scheduler=None,
                    scaler=None, group=None, where="step-1")
    want, got = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert sorted(got["state"]) == sorted(want["state"]) == [0, 1], "only the used layer's weight and bias"
    for index, entries in want["state"].items():
        for name, value in entries.items():
            assert torch.equal(got["state"][index][name], value), (index, name)
    assert got["param_groups"] == want["param_groups"]
    _assert_equal(fresh.state_dict(), model.state_dict())


def test_consolidation_reads_a_replicated_checkpoint_too(tmp_path):
    from skylift.checkpoint.state import capture

    store = open_store(str(tmp_path / "root"))
    model, optimizer, _ = build(None)
    manager = CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False)
    manager.save(lambda: capture(step=3, rank=0, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                                 counters={"step": 3}), 3)
    step, weights = full_model_state(str(tmp_path / "root"))
    assert step == 3 and read_manifest(store, 3).layout == "replicated"
    _assert_equal(weights, model.state_dict())


def test_consolidation_of_a_root_without_a_complete_checkpoint_says_so(tmp_path):
    (tmp_path / "root" / "step-5").mkdir(parents=True)
    (tmp_path / "root" / "step-5" / "model-rank0.safetensors").write_bytes(b"torn")
    with pytest.raises(CorruptCheckpointError, match="holds no complete checkpoint"):
        full_model_state(str(tmp_path / "root"))


# -- resharding and kills: more processes, the slow lane ----------------------------------


@pytest.mark.slow
@pytest.mark.multiprocess
def test_resharding_2_to_1_under_fsdp_then_1_to_2_restores_the_saved_full_state(sharded_run, tmp_path):
    one = tmp_path / "one-rank"
    shutil.copytree(sharded_run / "checkpoints", one / "checkpoints")
    # 2 -> 1: one rank under fully_shard resumes step 4 of the 2-rank run, trains on, saves at 6.
    spawn("train", 1, root=str(one / "checkpoints"), results=str(one / "results"), steps=6, save_at=[6],
          resume=str(one / "checkpoints" / "step-4"))
    _assert_equal(load_file(one / "results" / "full-resumed-step4.safetensors"), _saved(sharded_run, 4))
    store = open_store(str(one / "checkpoints"))
    assert (read_manifest(store, 6).world_size, read_manifest(store, 6).layout) == (1, "sharded")
    # 1 -> 2: two ranks resume the one-rank checkpoint.
    two = tmp_path / "two-ranks"
    spawn("train", 2, root=str(one / "checkpoints"), results=str(two / "results"), steps=6, save_at=[])
    _assert_equal(load_file(two / "results" / "full-resumed-step6.safetensors"),
                  load_file(one / "results" / "full-step6.safetensors"))


@pytest.mark.slow
def test_a_replicated_checkpoint_is_refused_by_a_sharded_model_with_the_fix(tmp_path):
    from skylift.checkpoint.state import capture

    store = open_store(str(tmp_path / "checkpoints"))
    model, optimizer, _ = build(None)
    CheckpointManager(store, rank=0, world_size=1, keep=2, async_save=False).save(
        lambda: capture(step=2, rank=0, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                        counters={"step": 2, "epoch": 0, "samples_seen": 16}), 2)
    spawn("resume_replicated", 1, root=str(tmp_path / "checkpoints"), results=str(tmp_path / "refusal.txt"))
    refusal = (tmp_path / "refusal.txt").read_text()
    assert "step-2 holds a whole (replicated) model" in refusal
    assert "Resume it with distributed.strategy: ddp" in refusal


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_rank_killed_before_the_commit_leaves_the_step_invisible_and_the_resume_is_exact(sharded_run, tmp_path):
    run = tmp_path / "killed"
    with pytest.raises(torch.multiprocessing.ProcessExitedException, match="SIGKILL"):
        spawn("train", 2, root=str(run / "checkpoints"), results=str(run / "results-1"), steps=6, save_at=[2, 4],
              fault="after_payload:step=4:rank=1")
    store = open_store(str(run / "checkpoints"))
    assert committed_steps(store) == [2]
    assert {"model-rank0.safetensors", "model-rank1.safetensors"} <= {
        key.rpartition("/")[2] for key in store.list("step-4")}, "both ranks wrote their shards of step 4"
    spawn("train", 2, root=str(run / "checkpoints"), results=str(run / "results-2"), steps=6, save_at=[4, 6])
    _assert_equal(load_file(run / "results-2" / "full-resumed-step2.safetensors"), _saved(sharded_run, 2))
    reference = json.loads((sharded_run / "results" / "losses.json").read_text())
    resumed = json.loads((run / "results-2" / "losses.json").read_text())
    assert resumed == {step: loss for step, loss in reference.items() if int(step) > 2}
    _assert_equal(load_file(run / "results-2" / "full-final.safetensors"), _saved(sharded_run, "final"))
    assert committed_steps(store) == [2, 4, 6]
