"""/dev/shm, disk, memory and CPU rules on recorded machines."""

from __future__ import annotations

from skylift.machine.facts import DiskFacts
from tests.doctor.recorded import load_facts, only, verdicts_of


def test_docker_default_shm_fails_a_config_with_workers_with_the_docker_flags():
    verdict = only(load_facts("container_shm64"), "shm")
    assert verdict.status == "fail" and "Bus error" in verdict.reason
    assert "--ipc=host" in verdict.fix and "--shm-size=" in verdict.fix


def test_small_shm_without_a_config_warns():
    facts = load_facts("container_shm64", job=None)
    assert only(facts, "shm").status == "warn"


def test_no_workers_need_no_shm():
    facts = load_facts("container_shm64")
    facts.job.num_workers = 0
    assert only(facts, "shm").status == "pass"


def test_big_shm_passes_the_same_loader():
    assert only(load_facts("a100_bf16"), "shm").status == "pass"


def test_disk_without_room_for_two_checkpoints_fails():
    facts = load_facts("a100_bf16")
    for disk in facts.disks:
        disk.free_bytes = 400 * 1024**2  # two 292 MiB checkpoints do not fit
    verdict = only(facts, "disk")
    assert verdict.status == "fail" and "checkpoint_local" in verdict.reason
    assert "checkpoint.root" in verdict.fix


def test_disk_cache_and_checkpoints_on_one_file_system_add_up():
    facts = load_facts("a100_bf16")
    facts.job.cache_bytes = 100 * 1024**3
    facts.disks.append(DiskFacts(purpose="cache", path="/cache", free_bytes=107374182400, device=1))
    verdict = only(facts, "disk")
    assert verdict.status == "fail" and "cache" in verdict.reason and "checkpoint_local" in verdict.reason
    facts.disks[-1].device = 2  # the cache on its own disk: both fit
    assert {verdict.status for verdict in verdicts_of(facts, "disk")} == {"pass"}


def test_memory_estimate_against_the_gpu():
    facts = load_facts("a100_bf16")
    assert only(facts, "memory").status == "pass"  # 20.4 GiB of 40 GiB
    facts.job.memory.total_bytes = 40 * 1024**3
    assert only(facts, "memory").status == "warn"
    facts.job.memory.total_bytes = 50 * 1024**3
    verdict = only(facts, "memory")
    assert verdict.status == "fail" and "activation_checkpointing.enabled: true" in verdict.fix


def test_workers_beyond_the_cpus_warn():
    facts = load_facts("container_shm64")
    facts.job.nproc, facts.job.num_workers = 2, 8
    verdict = only(facts, "cpus")
    assert verdict.status == "warn" and verdict.fix == "set data.num_workers: 3 (or auto)"


def test_the_memory_tier_counts_three_steps_of_its_share_against_the_tmpfs():
    facts = load_facts("a100_bf16")
    checkpoint = facts.job.memory.checkpoint_bytes  # DDP: the node writes the whole state itself
    facts.disks.append(DiskFacts(purpose="checkpoint_memory", path="/dev/shm/skylift", device=9,
                                 free_bytes=3 * checkpoint - 1))  # fmt: skip
    [verdict] = [verdict for verdict in verdicts_of(facts, "disk") if verdict.status != "pass"]
    assert verdict.status == "fail" and "checkpoint_memory" in verdict.reason
    assert "mount -o remount,size=" in verdict.fix and "checkpoint.memory.enabled: false" in verdict.fix
    facts.disks[-1].free_bytes = 3 * checkpoint
    assert {verdict.status for verdict in verdicts_of(facts, "disk")} == {"pass"}
    # FSDP over two nodes: the node's shards and its peer's, three steps of each.
    facts.job.memory.shard_count, facts.job.nnodes = facts.job.nproc * 2, 2
    facts.disks[-1].free_bytes = 3 * checkpoint  # a node's share is half the checkpoint: 3 x (1/2 + 1/2)
    assert {verdict.status for verdict in verdicts_of(facts, "disk")} == {"pass"}
    facts.disks[-1].free_bytes = 3 * checkpoint - 2 * facts.job.nproc
    assert "fail" in {verdict.status for verdict in verdicts_of(facts, "disk")}
