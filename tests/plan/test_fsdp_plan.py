"""The plan under ``distributed.strategy: fsdp``: sharded memory fits, and the all-gathers and
reduce-scatters FSDP2 adds, overlapped as it overlaps them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from skylift.catalog import load_catalog
from skylift.cli.main import main
from skylift.config.load import load_config
from skylift.doctor.memory import _saved_tensors
from skylift.machine.memory import MEMORY_HEADROOM, ModelMemory, Sharding
from skylift.plan.model import Target, predict_step
from skylift.plan.ranking import PlanRequest, local_target, plan_candidates, row_target
from skylift.train.sharding import select_blocks
from tests.plan.test_model import RECORDED, measurement

GIB = 2**30
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"
LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip
"""Llama 3 8B's architecture (its config.json), built on meta: shapes only, no weights."""
SEQUENCE = 2048


@pytest.fixture(scope="module")
def llama_8b() -> ModelMemory:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**LLAMA_8B)).train()
        ids = torch.zeros(1, SEQUENCE, dtype=torch.long)
    saved, note = _saved_tensors(model, ids, lambda net, batch: net(input_ids=batch, labels=batch).loss)
    assert note is None
    return ModelMemory.of(model, load_config(None, []).optim, blocks=select_blocks(model, []),
                          saved_float_elements_per_sample=saved[0], saved_other_bytes_per_sample=saved[1])  # fmt: skip


def _h100_node(nodes: int = 1):
    return next(row for row in load_catalog() if row.instance_type == "p5.48xlarge")  # 8x H100 80 GB, 900 GB/s


def _gpu_measurement(**changes):
    """One sample per rank per step on 8 GPUs, measured (as a bench would) on an H100."""
    fields = {"device": "cuda", "device_name": "NVIDIA H100", "configured_precision": "bf16", "precision": "bf16",
              "global_batch_size": 8, "micro_batch_size": 1, "world_size": 8}  # fmt: skip
    return measurement(**{**fields, **changes})


def test_an_8b_model_fits_8_h100s_sharded_and_not_replicated(llama_8b):
    assert llama_8b.parameters == 8_030_261_248 and llama_8b.block_count == 32  # Llama 3 8B, LlamaDecoderLayer
    m = _gpu_measurement(model_bytes=llama_8b.parameters * 4)
    target = row_target(_h100_node(), m, nodes=1, efficiency=None)
    replicated = predict_step(m, target, memory=llama_8b)
    # 16 bytes a parameter before activations (weights, gradients, two AdamW moments) is 120 GiB.
    assert replicated.dropped.startswith("does not fit: model state")
    sharded = predict_step(m, target, memory=llama_8b, sharding=Sharding(shard_count=1))
    assert sharded.dropped is None and sharded.memory.shard_count == 8
    assert sharded.memory.total_bytes <= MEMORY_HEADROOM * 80 * GIB
    assert sharded.memory.parameter_bytes == llama_8b.parameters * 4 // 8  # fp32 master shards
    assert sharded.memory.bucket_bytes == 0 and sharded.memory.autocast_weight_bytes == 0


def test_the_plan_ranks_the_8b_job_on_h100s_only_sharded_and_says_so(llama_8b):
    m = _gpu_measurement(model_bytes=llama_8b.parameters * 4)
    rows = [_h100_node()]
    ddp = plan_candidates(m, rows, PlanRequest(epochs=1, node_counts=(1,), memory=llama_8b))
    fsdp = plan_candidates(m, rows, PlanRequest(epochs=1, node_counts=(1,), memory=llama_8b,
                                                sharding=Sharding(shard_count=1)))  # fmt: skip
    assert all(candidate.dropped for candidate in ddp)
    assert not any(candidate.dropped for candidate in fsdp)
    assert {candidate.as_dict()["sharding"] for candidate in fsdp} == {"sharded over 8 ranks (FSDP2)"}


def _small_model(blocks: int = 8) -> ModelMemory:
    """26 M parameters (100 MiB in fp32, the measurement's model_bytes): a root group of 2 M
    and ``blocks`` equal blocks of the rest."""
    parameters = 100 * 2**20 // 4
    root = 2 * 2**20
    return ModelMemory(parameters=parameters, trainable_parameters=parameters, optimizer_state_copies=2,
                       saved_float_elements_per_sample=2**16, block_count=blocks,
                       largest_block_parameters=(parameters - root) // blocks, root_parameters=root)  # fmt: skip


def _without_optimizer():
    """The measurement with its optimizer time moved to "other": a step both strategies
    take alike, so what differs is the collectives alone."""
    m = measurement()
    return measurement(breakdown_s={**m.breakdown_s, "optimizer": 0.0, "other": m.breakdown_s["other"] + 0.2})


@pytest.mark.parametrize("where", ["local_cpu", "two_gpu_nodes"])
def test_where_both_fit_fsdp_moves_more_bytes_and_its_step_is_no_faster(where):
    m = _without_optimizer()  # fp32: FSDP gathers fp32 weights
    if where == "local_cpu":  # gloo on the cores the compute uses: nothing overlaps
        target = local_target(m, 2)
    else:  # across 400 Gb/s between nodes a block's collectives take longer than its compute
        row = next(row for row in load_catalog() if row.instance_type == "p4d.24xlarge")
        target = row_target(row, m, nodes=2, efficiency=None)
    memory = _small_model()
    ddp = predict_step(m, target, memory=memory)
    fsdp = predict_step(m, target, memory=memory, sharding=Sharding(shard_count=1))
    assert ddp.dropped is None and fsdp.dropped is None
    # Two all-gathers of the fp32 weights and a reduce-scatter of the gradients, against an
    # all-reduce (a reduce-scatter plus an all-gather): ZeRO stage 3's 1.5x.
    assert fsdp.communication_bytes == 3 * memory.parameters * 4
    assert ddp.communication_bytes == 2 * memory.parameters * 4
    assert fsdp.parts_s["communication"] > ddp.parts_s["communication"]
    assert fsdp.step_time_s > ddp.step_time_s
    assert fsdp.parts_s["compute"] == ddp.parts_s["compute"]


def test_each_rank_steps_the_optimizer_on_its_shard():
    # Which is why FSDP's step can be the shorter one where the optimizer costs more than
    # the collectives FSDP adds: with the 0.2 s optimizer measured here, on this machine.
    m = measurement()
    target = local_target(m, 2)
    ddp = predict_step(m, target, memory=_small_model())
    fsdp = predict_step(m, target, memory=_small_model(), sharding=Sharding(shard_count=1))
    assert fsdp.parts_s["memory_bound"] == pytest.approx(ddp.parts_s["memory_bound"] / 2)
    extra = fsdp.parts_s["communication"] - ddp.parts_s["communication"]
    saved = ddp.parts_s["memory_bound"] - fsdp.parts_s["memory_bound"]
    assert fsdp.step_time_s == pytest.approx(ddp.step_time_s + extra - saved)


def _link_target(**changes) -> Target:
    """GPUs on a 1 GB/s link (two unless ``changes`` say otherwise)."""
    fields = {"name": "link", "device": "cuda", "ranks_per_node": 2, "peak_flops_per_s": 1e14,
              "memory_bandwidth_bytes_per_s": 1e12, "vcpus_per_rank": 8, "intra_node_bus_bytes_per_s": 1e9}  # fmt: skip
    return Target(**{**fields, **changes})


def _communicate(compute_s: float, **changes):
    """Two GPUs on a 1 GB/s link; 4 blocks of 1e6 fp32 parameters and a root group of 1e6:
    an all-gather or reduce-scatter of one block, or of the root, takes 1/2 x 4e6 B / 1e9 B/s
    = 2 ms."""
    from skylift.plan.fsdp import sharded_communication

    memory = ModelMemory(parameters=5_000_000, trainable_parameters=5_000_000, optimizer_state_copies=2,
                         block_count=4, largest_block_parameters=1_000_000, root_parameters=1_000_000)  # fmt: skip
    options = {"sharding": Sharding(shard_count=2), "accumulation_steps": 1, "half_precision": False,
               "overlaps": True, **changes}  # fmt: skip
    return sharded_communication(parameters=5_000_000, memory=memory, links=((2, 1e9),), compute_s=compute_s,
                                 **options)  # fmt: skip


def test_exposed_time_is_the_first_gathers_plus_what_each_block_does_not_hide():
    one = 0.002
    # Compute-bound: 5 ms of forward per block (a third of 4 blocks' 60 ms) hides a 2 ms
    # gather, 10 ms of backward a gather and a reduce-scatter. Left: the root's and the first
    # block's gathers in forward and again in backward, the first block's and the root's
    # reduce-scatters.
    bound = _communicate(0.060)
    assert bound.total_s == pytest.approx(one * (2 + 4 + 4 + 4 + 1))
    assert bound.exposed_s == pytest.approx(one * 2 + one * 4)
    # Communication-bound: 1 ms of forward per block, 2 ms of backward.
    forward = 2 * one + 3 * (one - 0.001)
    backward = 2 * one + 3 * (2 * one - 0.002) + 2 * one
    assert _communicate(0.012).exposed_s == pytest.approx(forward + backward)
    # On a CPU nothing overlaps.
    assert _communicate(0.060, overlaps=False).exposed_s == pytest.approx(bound.total_s)
    # bf16 gathers half the bytes; the fp32 reduce-scatters stay.
    assert _communicate(0.0, half_precision=True).total_s == pytest.approx(one / 2 * (2 + 4 + 4) + one * (4 + 1))
    # No reshard after forward: no gathers in backward.
    kept = _communicate(0.0, sharding=Sharding(shard_count=2, reshard_after_forward=False))
    assert kept.total_s == pytest.approx(one * (1 + 4 + 4 + 1))
    # Four micro-steps gather four times and reduce-scatter once.
    assert _communicate(0.0, accumulation_steps=4).total_s == pytest.approx(4 * one * (2 + 4 + 4) + one * (4 + 1))


def test_accumulating_keeps_the_unsharded_gradients_and_can_stop_a_fit():
    # 1 GiB of fp32 weights over 8 GPUs, 0.25 GiB of activations a sample: the shards
    # (0.5 GiB) and the gathers (0.5 GiB) with all 8 samples (2 GiB) fit a 4 GiB GPU in one
    # micro-step. A 2.2 GiB GPU (1.98 usable) needs micro-steps, and accumulating them
    # holds every unsharded fp32 gradient (1 GiB) besides: 2.25 GiB at even one sample.
    memory = ModelMemory(parameters=2**28, trainable_parameters=2**28, optimizer_state_copies=2,
                         saved_float_elements_per_sample=2**26, block_count=8,
                         largest_block_parameters=2**25, root_parameters=0)  # fmt: skip
    m = measurement(device="cuda", device_name="NVIDIA A100", global_batch_size=64, micro_batch_size=8, world_size=8)
    target = _link_target(ranks_per_node=8)
    sharding = Sharding(shard_count=1)
    fits = predict_step(m, replace(target, device_memory_bytes=4 * GIB), memory=memory, sharding=sharding)
    assert fits.dropped is None and fits.accumulation_steps == 1 and fits.memory.total_bytes == 3 * GIB
    small = replace(target, device_memory_bytes=2.2 * GIB)
    assert "accumulating holds every unsharded gradient (1.0 GiB)" in predict_step(
        m, small, memory=memory, sharding=sharding).dropped  # fmt: skip
    # A reduce-scatter every micro-step keeps only the shards: 4 micro-steps of 2 fit.
    reduced = predict_step(m, small, memory=memory, sharding=replace(sharding, reduce_every_micro_step=True))
    assert reduced.dropped is None and (reduced.accumulation_steps, reduced.micro_batch_size) == (4, 2)


def test_cpu_offload_fits_one_gpu_until_the_nodes_ram_is_short(llama_8b):
    m = _gpu_measurement(model_bytes=llama_8b.parameters * 4, world_size=1, global_batch_size=1)
    one_h100 = replace(row_target(_h100_node(), m, nodes=1, efficiency=None), ranks_per_node=1,
                       intra_node_bus_bytes_per_s=None)  # fmt: skip
    sharding = Sharding(shard_count=1)
    # Unsharded on one GPU: the 120 GiB of state do not fit 80 GB.
    assert predict_step(m, one_h100, memory=llama_8b, sharding=sharding).dropped.startswith("does not fit: model state")
    offload = replace(sharding, cpu_offload=True)
    plenty = predict_step(m, replace(one_h100, host_memory_bytes=1024 * GIB), memory=llama_8b, sharding=offload)
    assert plenty.dropped is None and plenty.memory.host_bytes == 16 * llama_8b.parameters
    assert plenty.memory.total_bytes == plenty.memory.unsharded_bytes + plenty.memory.activation_bytes
    assert any("cpu_offload" in text for text in plenty.assumptions)
    short = predict_step(m, replace(one_h100, host_memory_bytes=64 * GIB), memory=llama_8b, sharding=offload)
    assert "offloaded state" in short.dropped and "node's RAM" in short.dropped



def test_the_memory_tier_counts_its_copies_against_the_nodes_ram(llama_8b):
    """checkpoint.memory on 2 nodes of 8 H100s under FSDP: each node holds 3 steps of its
    ranks' shards and of its peer's (weights and 2 AdamW moments, fp32: 12 B a parameter)."""
    m = _gpu_measurement(model_bytes=llama_8b.parameters * 4, world_size=1, global_batch_size=16)
    node = row_target(_h100_node(), m, nodes=2, efficiency=None)
    sharding = Sharding(shard_count=node.world_size)
    tiered = replace(llama_8b, checkpoint_in_memory=True)
    node_share = 12 * llama_8b.parameters // 2
    assert predict_step(m, replace(node, host_memory_bytes=8 * node_share), memory=tiered,
                        sharding=sharding).dropped is None  # fmt: skip
    short = predict_step(m, replace(node, host_memory_bytes=5 * node_share), memory=tiered, sharding=sharding)
    assert "checkpoint.memory's copies" in short.dropped and "node's RAM" in short.dropped
    assert predict_step(m, replace(node, host_memory_bytes=5 * node_share), memory=llama_8b,
                        sharding=sharding).dropped is None  # fmt: skip

def test_plan_command_reports_the_sharding(tmp_path, capsys):
    common = ["plan", str(QUICKSTART), "--epochs", "1", "--bench", str(RECORDED), "--set",
              "distributed.strategy=fsdp", "--machine", "local", "--nproc", "2"]  # fmt: skip
    assert main([*common, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    (candidate,) = plan["candidates"]
    assert candidate["sharding"] == "sharded over 2 ranks (FSDP2)" and candidate["communication_bytes"] > 0
    assert any("FSDP moves" in text for text in plan["assumptions"])
    assert main(common) == 0
    assert "sharded over 2 ranks" in capsys.readouterr().out
