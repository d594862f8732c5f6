"""QLoRA (``recipe.lora.quantize_base: nf4``) on the CPU: bitsandbytes' 4-bit NF4 base
through transformers, PEFT's adapters over it, the memory model's 0.5625 bytes a weight
against the real layers', what a checkpoint holds, exact resume after a SIGKILL, and the
exported adapter folder loaded over the 4-bit base giving the trained logits.

The runs are examples/lora-tiny-cpu.yaml with the base in 4-bit, shortened as in
test_causal_lm_lora.py (adapter dropout on, so that the resumed random streams matter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")
bitsandbytes = pytest.importorskip("bitsandbytes", reason="needs the llm extra (bitsandbytes)")

from safetensors.torch import load_file

from skylift.checkpoint.manifest import committed_steps
from skylift.machine.memory import nf4_bytes_per_parameter
from skylift.recipes.causal_lm import CausalLM
from skylift.storage import open_store
from tests.checkpoint.runs import ONE_THREAD, losses_by_step, run_here, summary
from tests.conftest import run_cli
from tests.recipes.test_causal_lm_lora import KILLED_AT, STEPS, _args, _config

QLORA = "recipe.lora.quantize_base=nf4"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted QLoRA run, in this process on one thread."""
    run_dir = tmp_path_factory.mktemp("qlora-reference") / "run"
    result = run_here(*_args(run_dir, QLORA))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir, result.stderr


def _trained(run_dir: Path, *overrides: str) -> torch.nn.Module:
    model = CausalLM(_config(run_dir, *overrides)).build_model()
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    return model.eval()


def test_the_base_is_4bit_nf4_and_weighs_what_the_memory_model_counts(tmp_path):
    """Every adapted linear layer's frozen base is bitsandbytes' Linear4bit holding NF4
    codes two a byte and one fp32 absmax per 64 weights: 0.5625 bytes a weight, the
    figure doctor and plan count; the output head and embeddings keep fp32; only the
    adapters (and modules_to_save) train."""
    model = CausalLM(_config(tmp_path / "run", QLORA)).build_model()
    quantized = [module for module in model.modules() if isinstance(module, bitsandbytes.nn.Linear4bit)]
    assert len(quantized) == 7 * 2  # the 7 projections of each of the tiny Llama's 2 decoder layers
    held = weights = 0
    for layer in quantized:
        state = layer.weight.quant_state
        assert state.quant_type == "nf4" and layer.weight.dtype == torch.uint8 and not state.nested
        weights += state.shape.numel()
        held += layer.weight.numel() * layer.weight.element_size() + state.absmax.numel() * state.absmax.element_size()
    assert held == weights * nf4_bytes_per_parameter()
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name or "modules_to_save" in name for name in trainable)
    head = model.get_base_model().lm_head
    assert head.original_module.weight.dtype == torch.float32


def test_a_run_trains_and_checkpoints_the_adapters_only(uninterrupted, tmp_path):
    """The loss falls; a checkpoint and the final weights hold exactly what the plain LoRA
    run's hold (the adapters and the trained head), none of the 4-bit base or its scales."""
    run_dir, log = uninterrupted
    assert "over the base in 4-bit NF4" in log
    losses = losses_by_step(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1)) and losses[STEPS] < losses[1]
    plain = CausalLM(_config(tmp_path / "plain")).build_model()
    trainable = {name for name, parameter in plain.named_parameters() if parameter.requires_grad}
    assert set(load_file(run_dir / "checkpoints" / f"step-{STEPS}" / "model.safetensors")) == trainable
    assert set(load_file(run_dir / "model.safetensors")) == trainable


@pytest.mark.slow
def test_a_killed_run_resumes_exactly(uninterrupted, tmp_path):
    """SIGKILL right after step 8's manifest, then the same command: the base is quantized
    again as it was, and every step's loss and the final adapters equal the uninterrupted
    run's, bit for bit."""
    reference, _ = uninterrupted
    run_dir = tmp_path / "run"
    killed = run_cli(*_args(run_dir, QLORA), env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": f"after_manifest:step={KILLED_AT}"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == KILLED_AT
    resumed = run_here(*_args(run_dir, QLORA))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == KILLED_AT
    assert losses_by_step(run_dir) == losses_by_step(reference)
    final, want = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == want.keys() and all(torch.equal(final[name], want[name]) for name in want)


def test_the_exported_adapters_over_the_4bit_base_give_the_trained_logits(uninterrupted, tmp_path, cli_here):
    """``skylift export``'s adapter folder, loaded by ``PeftModel.from_pretrained`` over the
    base quantized as the run quantized it, gives the trained model's logits bit for bit;
    ``--merged`` folds the adapters into the full-precision base, a plain folder whose
    logits equal the same merge done here."""
    from peft import PeftModel

    from skylift.recipes.adapters import load_quantized
    from skylift.recipes.tiny_lm import tiny_llama

    run_dir, _ = uninterrupted
    adapter, merged = tmp_path / "adapter", tmp_path / "merged"
    assert cli_here("export", str(run_dir), "--to", "hf", str(adapter)).returncode == 0
    assert cli_here("export", str(run_dir), "--to", "hf", str(merged), "--merged").returncode == 0
    recipe = CausalLM(_config(run_dir, QLORA))
    assert recipe.settings.lora is not None
    base = load_quantized(None, lambda: tiny_llama(recipe.tokenizer, 0), recipe.settings.lora, "cpu", "fp32")
    loaded = PeftModel.from_pretrained(base, str(adapter)).eval()
    tokens = torch.tensor([[1, 17, 42, 99, 7, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, _trained(run_dir, QLORA)(input_ids=tokens).logits)
        from transformers import AutoModelForCausalLM

        folded = AutoModelForCausalLM.from_pretrained(str(merged), local_files_only=True).eval()
        full_precision = _trained(run_dir).merge_and_unload()
        assert torch.equal(folded(input_ids=tokens).logits, full_precision(input_ids=tokens).logits)


def test_bf16_compute_runs_forward_and_backward_to_the_adapters():
    """QLoRA's compute dtype on a GPU: bf16 (``precision: bf16``, or ``auto`` on CUDA).
    This CPU refuses bf16 as a run's precision (it would be emulated), so the layers are
    built and stepped here directly: the 4-bit layers compute in bf16 and the adapters
    get finite gradients."""
    from skylift.recipes.adapters import apply_lora, load_quantized
    from skylift.recipes.settings.causal_lm import LoraSettings
    from skylift.recipes.tiny_lm import tiny_llama, tiny_tokenizer

    tokenizer = tiny_tokenizer()
    lora = LoraSettings(rank=4, quantize_base="nf4")
    base = load_quantized(None, lambda: tiny_llama(tokenizer, 0), lora, "cpu", "bf16")
    layers = [module for module in base.modules() if isinstance(module, bitsandbytes.nn.Linear4bit)]
    assert layers and all(layer.compute_dtype == torch.bfloat16 for layer in layers)
    model = apply_lora(base, lora, seed=0)
    tokens = torch.tensor([[1, 17, 42, 99, 7, 3]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    gradients = [parameter.grad for name, parameter in model.named_parameters() if "lora_B" in name]
    assert gradients and all(grad is not None and torch.isfinite(grad).all() for grad in gradients)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ddp_ranks_each_build_the_4bit_base_and_their_replicas_agree(tmp_path, cli):
    """Every rank quantizes its own copy of the base (the tiny Llama written to a folder of
    its own on each rank: transformers' save_pretrained writes nothing on a rank other
    than 0 once torch.distributed is up); DDP all-reduces the adapters' gradients and the
    ranks' weights agree at the end."""
    run_dir = tmp_path / "run"
    result = cli(*_args(run_dir, QLORA, "distributed.strategy=ddp", "schedule.max_steps=6", "checkpoint.every_steps=3"),
                 "--nproc", "2", env=ONE_THREAD)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert summary(run_dir)["steps"] == 6 and summary(run_dir)["replicas_agree"] is True
    assert set(load_file(run_dir / "model.safetensors")) == set(load_file(run_dir / "checkpoints/step-6/model.safetensors"))
