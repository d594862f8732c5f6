"""The published workloads as skylift configs, traced on ``meta`` for their structure.

What carries from a bench to a GPU is the job's structure (FLOPs per sample, by op
class; memory traffic; kernels per micro-step), not the bench machine's speed. The
GPU model is calibrated on published rows through the same structure, traced from the
same model skylift would train: torchvision's ResNet-50 (v1.5: the stride in the 3x3
convolution) at 224 px and 1,000 classes, and BERT-large (24 layers, hidden 1,024, 16
heads, intermediate 4,096, vocabulary 30,522: Devlin et al. 2019) through
``AutoModelForSequenceClassification`` at the row's sequence length. SQuAD's head (two
logits per token) and pre-training's masked-LM head differ from a classifier's by
under 0.1% of the FLOPs: the encoder is the work. Llama 3.1 8B (torchtitan's rows) is
traced as transformers' ``LlamaForCausalLM`` with Meta's 8B architecture at the row's
sequence length, its loss the next-token cross-entropy over the 128,256-word vocabulary,
its attention one fused kernel (:func:`trace_decoder`).

Tracing needs torch (and transformers for BERT): ``python -m benchmarks.plan_published
--refresh-structure`` writes ``published_structure.csv`` from it; the plan reads the CSV.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from skylift.plan.published import WorkloadStructure

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.plan.traffic import StepTraffic

__all__ = ["BERT_LARGE", "LLAMA3_8B", "trace_decoder", "trace_structure", "workload_config", "write_structures"]

BERT_LARGE = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 4096,
              "vocab_size": 30522, "max_position_embeddings": 512, "type_vocab_size": 2}  # fmt: skip
"""BERT-large's architecture, as Google's ``bert_config.json`` for it gives it."""

_SEQUENCE = {"bert_large_squad_384": 384, "bert_large_pretraining_128": 128, "bert_large_pretraining_512": 512}

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
             "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}  # fmt: skip
"""Llama 3 / 3.1 8B's architecture, as Meta's ``config.json`` for it gives it (3.1 adds
rope scaling, which changes no shape)."""

_DECODERS = {"llama3.1_8b_8192": (LLAMA3_8B, 8192)}
"""Causal-LM workloads: the architecture and the tokens per sample."""


def workload_config(workload: str, batch_per_gpu: int, *, channels_last: bool = True,
                    folder: Path | None = None) -> RunConfig:  # fmt: skip
    """The skylift config of a published workload at ``batch_per_gpu`` (synthetic data:
    the structure does not depend on the pixels or tokens).

    Raises:
        ValueError: a workload skylift cannot express.
    """
    from skylift.config.load import load_config

    batch = f"data.global_batch_size={batch_per_gpu}"
    if workload == "resnet50_v1.5_224":
        return load_config(None, ["recipe.name=image_classification", "recipe.model=resnet50",
                                  "recipe.num_classes=1000", "recipe.dataset=synthetic_images",
                                  "recipe.image_size=224", "recipe.num_samples=64",
                                  f"channels_last={'true' if channels_last else 'false'}", batch])  # fmt: skip
    if workload in _SEQUENCE:
        folder = folder or _bert_folder()
        return load_config(None, ["recipe.name=text_classification", "recipe.model=transformers",
                                  f"recipe.model_path={folder}", "recipe.dataset=synthetic_text",
                                  "recipe.num_samples=64", f"recipe.max_length={_SEQUENCE[workload]}",
                                  "data.batching=fixed", batch])  # fmt: skip
    raise ValueError(f"skylift cannot express the workload {workload!r}")


def _bert_folder() -> Path:
    """A model folder holding only BERT-large's ``config.json``: the meta trace needs no weights."""
    folder = Path(tempfile.mkdtemp(prefix="skylift-bert-large-"))
    config = {"architectures": ["BertForMaskedLM"], "model_type": "bert", "hidden_act": "gelu",
              "hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1, "layer_norm_eps": 1e-12,
              "initializer_range": 0.02, "pad_token_id": 0, **BERT_LARGE}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def trace_decoder(architecture: dict[str, Any], sequence: int, batch_per_gpu: int, *,
                  half: bool) -> tuple[StepTraffic, int]:  # fmt: skip
    """A Llama-style decoder's traffic on meta, its attention as one fused kernel (as
    FlashAttention runs it on a GPU: queries, keys, values and output read and written
    once, no sequence-squared score matrix in memory; its FLOPs by PyTorch's formula for
    the flash kernel, forward and backward), and its parameter count.

    On meta, ``scaled_dot_product_attention`` takes the math path, whose score matrix
    (heads x sequence^2 per sample) the trace would count as traffic a GPU never moves:
    the call is routed to ``aten._scaled_dot_product_flash_attention`` instead, the
    key/value heads repeated to the query heads first (grouped-query attention)."""
    import torch
    from torch.nn import functional
    from transformers import LlamaConfig, LlamaForCausalLM

    from skylift.plan.traffic import trace_model_traffic

    def fused(query: Any, key: Any, value: Any, attn_mask: Any = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, **_: Any) -> Any:  # fmt: skip
        if attn_mask is not None:
            raise ValueError("the traced decoder passed an attention mask: the fused kernel takes is_causal only")
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                                   scale=scale)[0]  # fmt: skip

    with torch.device("meta"):
        model = LlamaForCausalLM(cast(Any, LlamaConfig)(**architecture, attn_implementation="sdpa"))
    model.train()
    ids = torch.zeros(batch_per_gpu, sequence, dtype=torch.long, device="meta")
    original = functional.scaled_dot_product_attention
    functional.scaled_dot_product_attention = cast(Any, fused)
    try:
        traffic = trace_model_traffic(model, ids, lambda module, batch: module(input_ids=batch, labels=batch).loss,
                                      batch_per_gpu, half=half)  # fmt: skip
    finally:
        functional.scaled_dot_product_attention = original
    return traffic, sum(parameter.numel() for parameter in model.parameters())


def trace_structure(workload: str, half: bool, batch_per_gpu: int, folder: Path | None = None) -> WorkloadStructure:
    """One published workload's structure from skylift's meta trace (seconds, any CPU)."""
    from skylift.doctor.memory import meta_model_and_batch
    from skylift.plan.traffic import trace_step_traffic

    if workload in _DECODERS:
        traffic, parameters = trace_decoder(*_DECODERS[workload], batch_per_gpu, half=half)
    else:
        config = workload_config(workload, batch_per_gpu, folder=folder)
        traffic = trace_step_traffic(config, batch_per_gpu, half=half)
        model, _, _ = meta_model_and_batch(config, 1)
        parameters = sum(parameter.numel() for parameter in model.parameters())
    return WorkloadStructure(
        workload=workload, half=half, batch_per_gpu=batch_per_gpu, flops_per_sample=traffic.flops_per_sample,
        conv_flops_per_sample=traffic.conv_flops_per_sample,
        memory_op_bytes_per_sample=traffic.memory_op_bytes_per_sample,
        compute_op_bytes_per_sample=traffic.compute_op_bytes_per_sample, ops_per_micro_step=traffic.ops,
        model_bytes=4.0 * parameters, intensity_bins=traffic.intensity_bins,
    )  # fmt: skip


def write_structures(path: Path, keys: list[tuple[str, bool, int]]) -> list[WorkloadStructure]:
    """Trace every ``(workload, half, batch per GPU)`` and write them as CSV to ``path``."""
    import csv

    folder = _bert_folder()
    structures = [trace_structure(workload, half, batch, folder) for workload, half, batch in keys]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(WorkloadStructure.model_fields), lineterminator="\n")
        writer.writeheader()
        for structure in structures:
            record = structure.model_dump()
            record["intensity_bins"] = json.dumps([list(group) for group in structure.intensity_bins])
            writer.writerow({key: repr(value) if isinstance(value, float) else value for key, value in record.items()})
    return structures
