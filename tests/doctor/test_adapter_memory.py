"""The memory model with adapters (``recipe.lora``) against real runs, and QLoRA's 4-bit base.

Frozen weights have no gradient and no optimizer state. The tiny Llama of the LoRA preset
trains two real AdamW steps, full fine-tune and LoRA, and what it holds is read off its
tensors (weights, gradients, moments, the checkpoint's state dict) and off the process's
resident set, and held to what ``skylift doctor`` estimates on meta for the same config.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from skylift.config.load import load_config
from skylift.doctor.memory import estimate_memory, nf4_quantized_parameters
from skylift.doctor.rules.resources import memory_fits_device
from skylift.machine.facts import Facts, GpuFacts, JobFacts, TorchFacts
from skylift.machine.memory import ModelMemory, nf4_bytes_per_parameter
from skylift.recipes import build_recipe
from tests.conftest import EXAMPLES

pytest.importorskip("peft")
import skylift.recipes.causal_lm  # noqa: F401 - transformers' import at collection, not in the first test

PRESET = EXAMPLES / "lora-tiny-cpu.yaml"
FULL = ["recipe.lora=null"]
ADAPTERS_ONLY = ["recipe.lora.modules_to_save=null"]
"""The default targets (every linear layer but the head), nothing trained whole."""
LLAMA_8B = {"vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "tie_word_embeddings": False}  # fmt: skip
GIB = 2**30


def _nbytes(tensors) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _two_steps(config) -> dict[str, int]:
    """Two AdamW steps of the recipe's real model; the bytes it then holds, part by part."""
    recipe = build_recipe(config)
    torch.manual_seed(0)
    model = recipe.build_model(None).train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ids = torch.randint(0, 200, (4, config.recipe.sequence_length), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the first step makes the optimizer state a steady step holds
        optimizer.zero_grad(set_to_none=False)
        recipe.training_loss(model, (ids, None, ids)).backward()
        optimizer.step()
    states = list(optimizer.state.values())
    return {
        "parameter_bytes": _nbytes(model.parameters()),
        "gradient_bytes": _nbytes(p.grad for p in model.parameters() if p.grad is not None),
        "moment_bytes": _nbytes(s[name] for s in states for name in ("exp_avg", "exp_avg_sq")),
        "step_counter_bytes": _nbytes(s["step"] for s in states),
        "state_dict_bytes": _nbytes(model.state_dict().values()),
    }


@pytest.mark.parametrize("overrides", [FULL, ADAPTERS_ONLY, []], ids=["full", "lora", "lora+head"])
def test_the_real_tiny_llama_holds_what_doctor_estimates_full_and_with_adapters(overrides):
    config = load_config(PRESET, overrides)
    measured = _two_steps(config)
    estimate = estimate_memory(config, 4, 1)
    assert measured["parameter_bytes"] == estimate.parameter_bytes  # frozen base and adapters, fp32
    assert measured["gradient_bytes"] == estimate.gradient_bytes == 4 * estimate.trainable_parameters
    # AdamW's two moments, exactly; its step counters (a 4-byte scalar per trainable tensor) the model leaves out.
    assert measured["moment_bytes"] == estimate.optimizer_bytes
    assert measured["step_counter_bytes"] < 4096
    # A checkpoint holds the trainable weights (keep_trainable_only) and the optimizer state.
    assert measured["state_dict_bytes"] + measured["moment_bytes"] == estimate.checkpoint_bytes
    if overrides == FULL:
        assert estimate.adapters is None and estimate.frozen_weight_bytes == 0
    else:
        assert estimate.adapters == "LoRA rank 16" and estimate.frozen_weight_bytes > 0
        assert estimate.parameter_bytes - estimate.frozen_weight_bytes == estimate.gradient_bytes


_RSS_SCRIPT = """
import json, sys, torch
from pathlib import Path
from skylift.config.load import load_config
from skylift.recipes import build_recipe

def resident():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024

recipe = build_recipe(load_config(sys.argv[1], json.loads(sys.argv[2])))
torch.manual_seed(0)
model = recipe.build_model(None).train()
optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
ids = torch.randint(0, 200, (4, 64)); batch = (ids, None, ids)
recipe.training_loss(model, batch).backward()  # warm-up: thread pools, the allocator's first pages
optimizer.zero_grad(set_to_none=True)
before = resident()
for _ in range(2):
    optimizer.zero_grad(set_to_none=False)
    recipe.training_loss(model, batch).backward()
    optimizer.step()
print(json.dumps({"state_bytes": resident() - before,
                  "tensors": sum(1 for p in model.parameters() if p.requires_grad)}))
"""


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    """A 19 M-parameter Llama (77 MB of fp32 weights) with the tiny Llama's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from skylift.recipes.tiny_lm import tiny_tokenizer

    folder = tmp_path_factory.mktemp("llama19m")
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1536,
                                         num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id))  # fmt: skip
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("overrides", [FULL, []], ids=["full", "lora"])
def test_the_resident_set_grows_by_the_modelled_gradients_and_moments(llama_folder, overrides):
    """The process's resident set after two steps, less before them: the gradients and AdamW's
    moments, as the model counts them (for the adapters only with LoRA: 5% of the full one's).

    glibc is told to map every allocation of 4 KiB or more on its own
    (``MALLOC_MMAP_THRESHOLD_``), so a freed activation goes back to the system and the resident
    set follows the live tensors. The tolerance is what that leaves: each mapping rounded up to
    whole 4 KiB pages plus glibc's header (a page a tensor at most, three tensors for each
    trainable one), and 2 MiB for the Python objects the steps make (the optimizer's state
    dicts, autograd's bookkeeping), and 2% of the modelled bytes for what the allocator and the
    kernels keep that no tensor names (not derived: measured full 234.1 MB for 232.2 modelled on
    one machine, 235.3 MB on another, 0.8% and 1.3% over; LoRA 12.7 MB for 11.2, 1.5 MB over:
    252 adapter tensors' pages and headers)."""
    arguments = [*ADAPTERS_ONLY, f"recipe.model_path={llama_folder}", *overrides]
    estimate = estimate_memory(load_config(PRESET, arguments), 4, 1)
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "4096", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(PRESET), json.dumps(arguments)], env=environment,
                            capture_output=True, text=True, timeout=300, check=True)  # fmt: skip
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    modelled = estimate.gradient_bytes + estimate.optimizer_bytes
    tolerance = 3 * measured["tensors"] * 4096 + 2 * 2**20 + 0.02 * modelled
    assert abs(measured["state_bytes"] - modelled) <= tolerance, (measured, modelled)
    if overrides != FULL:
        assert modelled < 0.06 * estimate.parameter_bytes * 3  # the full fine-tune's 12 bytes a parameter


def test_nf4_bytes_follow_bitsandbytes_defaults():
    # Two codes a byte, an fp32 absmax per 64 weights; double quantisation: an 8-bit absmax per 64
    # weights and an fp32 constant per 256 of those.
    assert nf4_bytes_per_parameter() == 0.5625
    assert nf4_bytes_per_parameter(double_quantization=True) == pytest.approx(0.5 + 1 / 64 + 4 / 16384)


def _qlora_config(tmp_path: Path, *extra: str):
    return load_config(PRESET, [*ADAPTERS_ONLY, "recipe.lora.quantize_base=nf4", f"run_dir={tmp_path}", *extra])


def test_qlora_holds_every_linear_weight_but_the_head_in_4bit(tmp_path):
    lora = estimate_memory(load_config(PRESET, [*ADAPTERS_ONLY, "precision=bf16"]), 4, 1)
    qlora = estimate_memory(_qlora_config(tmp_path, "precision=bf16"), 4, 1)
    from skylift.doctor.memory import meta_model_and_batch

    model, _, _ = meta_model_and_batch(_qlora_config(tmp_path), 4)
    linear = sum(module.weight.numel() for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear) and "lora_" not in name and not name.endswith("lm_head"))
    assert qlora.quantized_parameters == linear == sum(p.numel() for p in nf4_quantized_parameters(model))
    assert qlora.adapters == "QLoRA rank 16, base in 4-bit NF4"
    # The same adapters train: gradients and optimizer state do not change; the base shrinks to 0.5625 B.
    assert (qlora.gradient_bytes, qlora.optimizer_bytes) == (lora.gradient_bytes, lora.optimizer_bytes)
    assert lora.frozen_weight_bytes - qlora.frozen_weight_bytes == round(linear * (4 - 0.5625))
    # A 4-bit weight is dequantised per call: no autocast copy of it is kept.
    assert lora.autocast_weight_bytes - qlora.autocast_weight_bytes == 2 * linear
    assert qlora.checkpoint_bytes == lora.checkpoint_bytes  # the adapters and their moments only


def test_doctor_says_what_trains_and_what_the_frozen_base_takes(tmp_path):
    estimate = estimate_memory(_qlora_config(tmp_path), 4, 1)
    gpu = GpuFacts(index=0, name="NVIDIA H100 80GB HBM3", memory_total_bytes=80 * GIB)
    facts = Facts(torch=TorchFacts(cuda_available=True), gpus=[gpu],
                  job=JobFacts(device="cuda", nproc=1, micro_batch_size=4, memory=estimate))  # fmt: skip
    finding = memory_fits_device(facts)
    assert finding.status == "pass"
    assert f"QLoRA rank 16, base in 4-bit NF4: {estimate.trainable_parameters:,} trainable of " in finding.reason
    assert f"{estimate.quantized_parameters:,} of them in 4-bit NF4" in finding.reason


def test_checkpointed_blocks_keep_no_autocast_copy_of_their_frozen_weights():
    lora = load_config(PRESET, [*ADAPTERS_ONLY, "precision=bf16"])
    plain = estimate_memory(lora, 4, 1)
    recomputed = estimate_memory(lora.model_copy(update={"activation_checkpointing": lora.activation_checkpointing
                                                         .model_copy(update={"enabled": True})}), 4, 1)  # fmt: skip
    full = load_config(PRESET, [*FULL, "precision=bf16", "activation_checkpointing.enabled=true"])
    # Frozen decoder weights are cast again in backward; the head (outside every block) and the
    # adapters (trainable: autocast caches their casts) keep theirs; a full fine-tune keeps all.
    assert recomputed.autocast_weight_bytes < plain.autocast_weight_bytes == 2 * plain.parameters
    assert estimate_memory(full, 4, 1).autocast_weight_bytes == 2 * estimate_memory(full, 4, 1).parameters


@pytest.fixture(scope="module")
def llama_8b_adapters() -> dict[str, ModelMemory]:
    """Llama 3 8B on meta, whole and under rank-16 adapters on every linear layer but the head."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from skylift.recipes.adapters import apply_lora
    from skylift.recipes.settings.causal_lm import LoraSettings

    optim = load_config(None, []).optim
    with torch.device("meta"):
        whole = ModelMemory.of(LlamaForCausalLM(LlamaConfig(**LLAMA_8B)), optim)
        adapted = apply_lora(LlamaForCausalLM(LlamaConfig(**LLAMA_8B)), LoraSettings(rank=16), seed=0)
    return {"full": whole, "lora": ModelMemory.of(adapted, optim, adapters="LoRA rank 16"),
            "qlora": ModelMemory.of(adapted, optim, adapters="QLoRA", quantized=nf4_quantized_parameters(adapted))}


def test_the_plan_fits_llama_8b_adapters_on_one_h100_and_not_the_full_fine_tune(llama_8b_adapters):
    from skylift.plan.model import Target, predict_step
    from skylift.plan.ranking import Candidate
    from skylift.plan.render import _cells
    from tests.plan.test_model import measurement

    m = measurement(device="cuda", device_name="NVIDIA H100", configured_precision="bf16", precision="bf16",
                    global_batch_size=1, micro_batch_size=1, world_size=1, model_bytes=4 * 41_943_040)  # fmt: skip
    h100 = Target(name="1xH100", device="cuda", peak_flops_per_s=989e12, memory_bandwidth_bytes_per_s=3.35e12,
                  vcpus_per_rank=26, device_memory_bytes=80 * GIB)  # fmt: skip
    full, lora, qlora = (predict_step(m, h100, memory=llama_8b_adapters[name]) for name in ("full", "lora", "qlora"))
    assert full.dropped.startswith("does not fit: model state")  # 16 bytes a parameter: 120 GiB
    assert lora.dropped is None and qlora.dropped is None
    assert llama_8b_adapters["lora"].trainable_parameters == 41_943_040  # 1,310,720 a layer x 32
    # The base as built (fp32); with QLoRA its 6.98 B linear weights in 4-bit NF4 at 0.5625 bytes,
    # the embedding, the head and the norms (1.05 B) still at 4.
    linear = 6_979_321_856
    assert lora.memory.frozen_weight_bytes == 4 * 8_030_261_248
    assert qlora.memory.frozen_weight_bytes == round(linear * 0.5625) + 4 * (8_030_261_248 - linear)
    assert qlora.memory.total_bytes < 11 * GIB < 30 * GIB < lora.memory.total_bytes
    assert lora.memory.gradient_bytes == qlora.memory.gradient_bytes == 4 * 41_943_040
    from skylift.plan.planning import _memory_assumption

    said = _memory_assumption(llama_8b_adapters["qlora"], None)
    assert "gradients and optimizer state for the 41,943,040 trainable parameters only" in said
    assert "6,979,321,856 of its parameters in 4-bit NF4 at 0.5625 bytes each" in said
    note = _cells(1, Candidate(instance="p5", provider="aws", count=1, spot=False, prediction=qlora))[-1]
    assert f"{qlora.memory.total_bytes / GIB:.3g} GiB a GPU (frozen base 7.57 GiB)" in note


def test_micro_batch_auto_adds_only_the_adapters_optimizer_state():
    from skylift.train.micro_batch import pending_state_bytes

    config = load_config(PRESET, ADAPTERS_ONLY)
    model = build_recipe(config).build_model(None)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert trainable < 0.25 * sum(p.numel() for p in model.parameters())
    assert pending_state_bytes(model, config, 1) == 2 * 4 * trainable  # AdamW's two fp32 moments


LLAMA3_8B_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
                    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                    "bos_token_id": 128000, "eos_token_id": 128001, **LLAMA_8B}  # fmt: skip
"""Meta-Llama-3-8B's config.json (the fields the architecture takes)."""


@pytest.mark.parametrize("preset", ["llama3-8b-lora-1xh100.yaml", "llama3-8b-qlora-1xh100.yaml"])
def test_the_8b_adapter_presets_quote_what_doctor_estimates(preset, tmp_path):
    """The memory each preset's comment pastes is doctor's, on meta (no 8B model is built):
    a folder with Llama 3 8B's config.json and a stand-in tokenizer (only the architecture is read)."""
    from skylift.doctor.rules.resources import _memory_parts, format_bytes
    from skylift.recipes.tiny_lm import tiny_tokenizer

    folder = tmp_path / "Meta-Llama-3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA3_8B_CONFIG))
    tiny_tokenizer().save_pretrained(folder)
    config = load_config(EXAMPLES / preset, [f"recipe.model_path={folder}", "precision=bf16"])
    estimate = estimate_memory(config, config.data.micro_batch_size, 1)
    text = (EXAMPLES / preset).read_text()
    quoted = text.split("#   about ", 1)[1].split(")\n", 1)[0]
    quoted = " ".join(line.strip("# ").strip() for line in ("about " + quoted + ")").splitlines())
    assert quoted == f"about {format_bytes(estimate.total_bytes)} per rank ({_memory_parts(estimate)})"
    assert estimate.total_bytes < 0.9 * 80 * GIB / 2  # the state leaves more than half an H100 to activations
