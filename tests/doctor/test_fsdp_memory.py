"""The memory model under FSDP against a real sharded run, and doctor's sharded estimate.

Two real processes over gloo shard a small Llama (built from its config class, about
40 MB of fp32 weights) with ``fully_shard`` per decoder layer then the root, bf16
parameters and fp32 reduction, as skylift's FSDP path does, and train two AdamW steps.
Each rank reports what it really holds: the bytes of its local shards of the weights,
gradients and optimizer moments, and, from PyTorch's own FSDP memory tracker
(``torch.distributed._tools.fsdp2_mem_tracker``, which sees every tensor allocated and
names it: sharded or unsharded parameter, all-gather buffer, reduce-scatter input),
what it had gathered before and after each group's forward and backward.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from skylift.config.load import load_config
from skylift.doctor.memory import estimate_memory
from skylift.doctor.rules.resources import memory_fits_device
from skylift.machine.facts import Facts, JobFacts, MemoryFacts
from skylift.machine.memory import ModelMemory, Sharding, training_memory
from skylift.train.sharding import select_blocks
from tests.gloo_group import join, spawn_ranks

WORLD_SIZE = 2
GATHERED = ("Unsharded Param", "All Gather", "Reduce Scatter", "Unsharded Grad")
"""The tracker's categories of what FSDP materialises beside the shards."""
MICRO_BATCH, SEQUENCE = 2, 64
LLAMA = {"vocab_size": 4096, "hidden_size": 384, "intermediate_size": 1024, "num_hidden_layers": 4,
         "num_attention_heads": 6, "num_key_value_heads": 2, "tie_word_embeddings": False}  # fmt: skip
"""About 10 M parameters: embeddings and head 3.1 M (the root group), four decoder layers of 1.8 M."""


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**LLAMA)).train()


def _local_bytes(tensors) -> int:
    return sum(t.to_local().numel() * t.to_local().element_size() for t in tensors)


def _worker(rank: int, world_size: int, port: int, folder: str) -> None:
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    join(rank, world_size, port)
    model = _llama()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in select_blocks(model, []):
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, LLAMA["vocab_size"], (MICRO_BATCH, SEQUENCE), generator=generator)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()

    step()  # the first step creates the optimizer state a steady step holds
    optimizer.step()
    optimizer.zero_grad()
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs((ids,))
    with tracker:
        step()
        gradients = _local_bytes(p.grad for p in model.parameters())
        optimizer.step()
    states = optimizer.state.values()
    report = {
        "parameter_bytes": _local_bytes(model.parameters()),
        "parameter_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "gradient_bytes": gradients,
        "moment_bytes": _local_bytes(s[name] for s in states for name in ("exp_avg", "exp_avg_sq")),
        "step_counters": sum(1 for s in states if "step" in s),
        **_gathered(tracker),
    }
    Path(folder, f"rank{rank}.json").write_text(json.dumps(report, default=str))
    dist.destroy_process_group()


def _gathered(tracker) -> dict:
    """What the tracker saw gathered: the most over every snapshot it took (before and
    after each group's pre/post forward and backward, and their peaks), and, just after
    each decoder layer's pre-forward (its all-gather and copy-out), the unsharded
    parameters and the all-gather buffers."""
    gathered_most, after_gather = 0, []
    for stats in tracker.memory_tracking.values():
        for state, snapshots in stats.snapshots.items():
            for snapshot in snapshots:
                parts = snapshot[torch.device("cpu")]
                gathered_most = max(gathered_most, sum(parts.get(name, 0) for name in GATHERED))
                if state.name == "AFT_PRE_FW" and ".layers." in stats.mod_fqn:
                    after_gather.append({name: parts.get(name, 0) for name in ("Unsharded Param", "All Gather")})
    return {"gathered_most_bytes": gathered_most, "after_layer_gather": after_gather}


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("fsdp_memory")
    spawn_ranks(_worker, WORLD_SIZE, str(folder))
    return [json.loads((folder / f"rank{rank}.json").read_text()) for rank in range(WORLD_SIZE)]


@pytest.fixture(scope="module")
def predicted() -> tuple[ModelMemory, object, int]:
    model = _llama()
    memory = ModelMemory.of(model, load_config(None, []).optim, blocks=select_blocks(model, []))
    breakdown = training_memory(memory, MICRO_BATCH, half_precision=True, world_size=WORLD_SIZE,
                                sharding=Sharding(shard_count=WORLD_SIZE))  # fmt: skip
    # Each parameter is cut along its first dimension, so a rank's shard differs from
    # 1/world of it by less than one row: that is the tolerance, summed over parameters.
    rows = sum(p.numel() // p.shape[0] for p in model.parameters())
    return memory, breakdown, rows * 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_each_rank_holds_the_predicted_shards_of_weights_gradients_and_moments(measured, predicted):
    memory, breakdown, one_row_each = predicted
    assert memory.block_count == LLAMA["num_hidden_layers"]  # LlamaDecoderLayer, from _no_split_modules
    for rank in measured:
        assert rank["parameter_dtypes"] == ["torch.float32"]  # fp32 master shards; bf16 only when gathered
        assert abs(rank["parameter_bytes"] - breakdown.parameter_bytes) < one_row_each
        assert abs(rank["gradient_bytes"] - breakdown.gradient_bytes) < one_row_each
        # AdamW's two moments are shards of the same shape; its step counters (one 4-byte
        # scalar per parameter) are the model's to leave out.
        assert abs(rank["moment_bytes"] - breakdown.optimizer_state_bytes) < 2 * one_row_each
        assert rank["step_counters"] == len(list(_llama().parameters()))
    # Both ranks together hold every byte exactly once.
    assert sum(rank["parameter_bytes"] for rank in measured) == memory.parameters * 4


@pytest.mark.slow
@pytest.mark.multiprocess
def test_what_a_rank_gathers_is_the_root_group_and_two_blocks_and_the_model_bounds_it(measured, predicted):
    memory, breakdown, _ = predicted
    root, block = memory.root_parameters * 2, memory.largest_block_parameters * 2  # bf16 bytes, exact
    for rank in measured:
        assert len(rank["after_layer_gather"]) == LLAMA["num_hidden_layers"]
        for gathered in rank["after_layer_gather"]:
            # The root group stays gathered while each layer computes, beside that layer...
            assert gathered["Unsharded Param"] == root + block
            # ...and one more block: the all-gather buffer FSDP2 frees only at the next copy-out.
            assert gathered["All Gather"] == block
        assert rank["gathered_most_bytes"] <= breakdown.unsharded_bytes


def test_doctor_divides_the_state_by_the_ranks_and_says_so():
    config = load_config(None, ["recipe.dataset=synthetic_images", "recipe.model=resnet18", "recipe.image_size=32",
                                "distributed.strategy=fsdp", "precision=bf16"])  # fmt: skip
    replicated = estimate_memory(config.model_copy(update={"distributed": config.distributed.model_copy(
        update={"strategy": "ddp"})}), 8, 4)  # fmt: skip
    sharded = estimate_memory(config, 8, 4)
    assert (sharded.shard_count, sharded.sharding) == (4, "sharded over 4 ranks (FSDP2)")
    assert sharded.parameter_bytes == replicated.parameter_bytes // 4
    assert sharded.optimizer_bytes == replicated.optimizer_bytes // 4
    assert sharded.bucket_bytes == 0 and replicated.bucket_bytes == replicated.parameter_bytes
    assert sharded.autocast_weight_bytes == 0 < replicated.autocast_weight_bytes  # bf16 parameters are gathered
    assert sharded.unsharded_bytes > 0 and sharded.checkpoint_bytes == pytest.approx(replicated.checkpoint_bytes,
                                                                                     abs=8)  # fmt: skip
    facts = Facts(memory=MemoryFacts(available_bytes=64 * 2**30),
                  job=JobFacts(device="cpu", nproc=4, micro_batch_size=8, memory=sharded))  # fmt: skip
    finding = memory_fits_device(facts)
    assert finding.status == "pass" and "sharded over 4 ranks (FSDP2)" in finding.reason


def test_cpu_offload_moves_the_shards_to_host_memory_and_doctor_checks_the_ram():
    config = load_config(None, ["recipe.dataset=synthetic_images", "recipe.model=resnet18", "recipe.image_size=32",
                                "distributed.strategy=fsdp", "distributed.fsdp.cpu_offload=true"])  # fmt: skip
    offloaded = estimate_memory(config, 8, 2)
    assert offloaded.host_bytes == offloaded.parameter_bytes + offloaded.gradient_bytes + offloaded.optimizer_bytes
    # On the GPU: only what is gathered for the step and the activations.
    assert offloaded.total_bytes == offloaded.unsharded_bytes + offloaded.activation_bytes
    from skylift.machine.facts import GpuFacts, TorchFacts

    gpu = GpuFacts(index=0, name="NVIDIA H200", memory_total_bytes=140 * 2**30)
    tight_ram = MemoryFacts(available_bytes=offloaded.host_bytes)  # one rank's state; the job has two
    facts = Facts(torch=TorchFacts(cuda_available=True), gpus=[gpu], memory=tight_ram,
                  job=JobFacts(device="cuda", nproc=2, micro_batch_size=8, memory=offloaded))  # fmt: skip
    finding = memory_fits_device(facts)
    assert finding.status == "fail" and "out of host memory" in finding.reason
    assert "distributed.fsdp.cpu_offload" in finding.fix


def test_micro_batch_auto_refuses_a_model_already_sharded(tmp_path):
    # The trials carry an unsharded trial over to a sharded rank; a model that is already
    # sharded would have its weights taken off twice.
    from skylift.errors import SkyliftConfigError
    from skylift.train.micro_batch import choose_micro_batch
    from skylift.train.runtime import Runtime

    overrides = ["device=cpu", "precision=fp32", "distributed.strategy=fsdp", f"run_dir={tmp_path}",
                 "checkpoint.enabled=false", "preemption.cloud=off", "monitor.report=false"]  # fmt: skip
    runtime = Runtime.from_config(load_config(None, overrides))
    try:
        model = runtime.prepare(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)))
        auto = load_config(None, [*overrides, "data.micro_batch_size=auto"])
        with pytest.raises(SkyliftConfigError, match="already is"):
            choose_micro_batch(model, lambda: None, lambda net, batch: net(batch).sum(), runtime=runtime, config=auto,
                               batch_size=len)  # fmt: skip
    finally:
        runtime.sharding.release()


@pytest.mark.slow
@pytest.mark.multiprocess
def test_micro_batch_auto_under_fsdp_carries_the_trial_to_a_sharded_rank(cli, tmp_path):
    run_dir = tmp_path / "run"
    settings = ["distributed.strategy=fsdp", "data.micro_batch_size=auto", "schedule.max_steps=2",
                "schedule.warmup_steps=1", "checkpoint.enabled=false", "monitor.report=false", f"run_dir={run_dir}"]
    result = cli("run", "examples/causal-lm-cpu.yaml", "--nproc", "2", "--no-doctor",
                 *[part for setting in settings for part in ("--set", setting)])
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(record for record in records if record["kind"] == "run_start")
    choice = start["micro_batch"]
    assert choice["chosen"] == 8 and sum(record["kind"] == "train" for record in records) >= 1  # it trained
    (trial,) = choice["trials"]  # 16 over 2 ranks: the whole per-rank batch fits, one trial
    from skylift.machine.memory import unsharded_bytes
    from skylift.recipes import build_recipe

    config = load_config("examples/causal-lm-cpu.yaml", ["distributed.strategy=fsdp"])
    model = build_recipe(config).build_model(None)
    weight_bytes = sum(p.numel() for p in model.parameters()) * 4
    # Still to come after the trial: AdamW's two fp32 moments of every weight, each rank
    # holding half of them: one weight's worth.
    assert choice["pending_state_bytes"] == weight_bytes
    # Carried from the unsharded trial to the rank: the whole weights off; the rank's half
    # of the weights and of the gradients on, and what it gathers for its blocks (which,
    # for two decoder layers and a root group of a third of the model, is more than all
    # of it: FSDP does not pay at this size).
    memory = ModelMemory.of(model, config.optim, blocks=select_blocks(model, []))
    gathered = unsharded_bytes(memory, Sharding(shard_count=2), half_precision=start["precision"] in ("bf16", "fp16"))
    shards = weight_bytes // 2 + weight_bytes // 2  # the rank's half of the weights and of the gradients
    carried = -weight_bytes + shards + gathered
    assert trial["needed_bytes"] - trial["peak_bytes"] == carried + choice["pending_state_bytes"]
