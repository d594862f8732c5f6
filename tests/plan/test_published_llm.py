"""Causal-LM rows of the published table: the decoder's trace, the row conditions the
model reads (tokens, recomputation, a stated bandwidth, float8) and their predictions."""

from __future__ import annotations

import pytest

from skylift.plan.calibration import predict_row, shipped_gpu_model
from skylift.plan.published import PublishedRow, load_published, load_structures

TINY = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rope_theta": 500000.0,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip


def _row(row_id: str) -> PublishedRow:
    return next(row for row in load_published() if row.row_id == row_id)


def test_the_decoder_trace_counts_attention_as_one_fused_kernel():
    from skylift.plan.published_trace import trace_decoder

    short, parameters = trace_decoder(TINY, 1024, 1, half=True)
    long, _ = trace_decoder(TINY, 2048, 1, half=True)
    # The math path's score matrix (heads x sequence^2) would make the traffic per token grow
    # with the sequence; the fused kernel's (and everything else's) is per token.
    assert long.memory_op_bytes_per_sample / 2048 == pytest.approx(short.memory_op_bytes_per_sample / 1024, rel=0.02)
    # FLOPs: 6 per matmul weight per token, and the attention's two products (4 x sequence x
    # width per token and layer in forward, 2.5 times that in backward: PyTorch's flash formula).
    matmul_weights = parameters - TINY["vocab_size"] * TINY["hidden_size"] - (2 * 2 + 1) * TINY["hidden_size"]
    expected = 1024 * (6 * matmul_weights + 3.5 * 4 * TINY["num_hidden_layers"] * 1024 * TINY["hidden_size"])
    assert short.flops_per_sample == pytest.approx(expected, rel=1e-3)


def test_the_shipped_llama_structure_is_meta_llama3_8b():
    structure = load_structures()[("llama3.1_8b_8192", True, 2)]
    assert structure.model_bytes / 4 == pytest.approx(8.03e9, rel=1e-3)
    per_token = structure.flops_per_sample / 8192  # torchtitan's 6N + 12 L d S, with flash's backward at 2.5x
    assert per_token == pytest.approx(6 * (8.030e9 - 128256 * 4096) + 3.5 * 4 * 32 * 8192 * 4096, rel=2e-3)


def test_a_tokens_row_needs_its_sequence_length_and_predicts_sequences():
    row = _row("tt-llama31-8b-h100-8x-fsdp")
    assert row.per_gpu == 5762 and row.samples_per_gpu == pytest.approx(5762 / 8192)
    with pytest.raises(ValueError, match="sequence_length"):
        PublishedRow.model_validate({**row.model_dump(), "sequence_length": None})
    assert row.spec.memory_bandwidth_bytes_per_s == 2.4e12  # the page's figure, not the SXM data sheet's


def test_recomputation_and_float8_are_read_from_the_row():
    model = shipped_gpu_model()
    selective = _row("tt-llama31-8b-h100-8x-fsdp")
    none = selective.model_copy(update={"activation_checkpointing": ""})
    full = selective.model_copy(update={"activation_checkpointing": "full"})
    base = predict_row(none, model)
    assert base is not None and predict_row(full, model) < predict_row(selective, model) < base
    assert predict_row(_row("tt-llama31-8b-h100-8x-fsdp-compile-float8"), model) is None  # no fp8 peak: not guessed


def test_the_llama_row_is_predicted_within_the_target_without_seeing_it():
    from benchmarks.plan_published import cross_validate

    rows = list(load_published())
    for by in ("workload", "gpu"):
        error = cross_validate(rows, by)["tt-llama31-8b-h100-8x-fsdp"]["error"]
        assert abs(error) <= 0.15, (by, error)


def test_an_unknown_parallelism_names_the_field():
    row = _row("tt-llama31-8b-h100-8x-fsdp").model_dump()
    with pytest.raises(ValueError, match="parallelism"):
        PublishedRow.model_validate({**row, "parallelism": "zero3"})


def test_a_plan_of_the_llama_job_prints_the_row_it_stands_on_and_its_error():
    from skylift.plan.calibration import standing_row

    structure = load_structures()[("llama3.1_8b_8192", True, 2)]
    # What a bench of the 8B preset traces: attention on meta's math path counts 12, not 14,
    # x sequence x width a token and layer (3.6 % fewer FLOPs): still this workload.
    flops = structure.flops_per_sample - 2 * 32 * 8192 * 8192 * 4096
    line = standing_row(flops, structure.model_bytes)
    assert line is not None and line.startswith("the published row this job stands on: tt-llama31-8b-h100-8x-fsdp ")
    assert "published 5,762.0 tokens/s a GPU, the GPU model 6,049.5 (+5.0%; the model was never fitted on it)" in line
    assert "pytorch/torchtitan@b5bcd76c:benchmarks/llama3_h100_202412_torchtitan.md" in line
    resnet = load_structures()[("resnet50_v1.5_224", True, 256)]
    assert "dle-rn50-2103-a100-80-1x-amp" in standing_row(resnet.flops_per_sample, resnet.model_bytes)
    assert "fitted on it" in standing_row(resnet.flops_per_sample, resnet.model_bytes)
    assert standing_row(flops / 2, structure.model_bytes) is None  # another sequence length: no row


def test_a_bench_with_activation_checkpointing_is_planned_with_the_recomputed_forward():
    from skylift.plan.gpu_compute import calibrated_compute
    from tests.plan.test_published import structured

    plain = structured("bert_large_squad_384", 32, True, activation_checkpointing=False)
    checkpointed = plain.model_copy(update={"activation_checkpointing": True})
    unknown = plain.model_copy(update={"activation_checkpointing": None})
    base = calibrated_compute(plain, "a100-sxm-80gb", "bf16", 1, (1, 32))
    again = calibrated_compute(checkpointed, "a100-sxm-80gb", "bf16", 1, (1, 32))
    assert base is not None and again is not None and not base.recomputed
    assert again.seconds == pytest.approx(base.seconds * 4 / 3) and "recomputed forward (33% more" in again.recomputed
    said = calibrated_compute(unknown, "a100-sxm-80gb", "bf16", 1, (1, 32))
    assert said is not None and said.seconds == base.seconds and "did not record" in said.recomputed


def test_a_run_folder_records_whether_it_checkpointed_activations(tmp_path):
    import json

    from skylift.plan.measurement import measurement_from_run_dir

    records = [{"kind": "run_start", "time": 0.0, "world_size": 1, "device": "cpu", "device_name": "test CPU",
                "precision": "fp32", "cpu_count": 2, "peak_flops_per_s": 1e10}]  # fmt: skip
    records += [{"kind": "train", "time": float(step), "step": step, "samples_seen": 8 * step, "step_time_s": 1.0}
                for step in range(1, 7)]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    for text, expected in (("activation_checkpointing:\n  enabled: true\n", True), ("", False)):
        (tmp_path / "config.yaml").write_text("data:\n  global_batch_size: 8\n" + text)
        assert measurement_from_run_dir(tmp_path, config_path="c.yaml").activation_checkpointing is expected
