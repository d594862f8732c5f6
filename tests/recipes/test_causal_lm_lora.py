"""LoRA adapters on the causal LM through PEFT (``recipe.lora``): what a checkpoint holds,
exact resume after a SIGKILL, ``skylift export`` to PEFT's adapter folder and merged,
and the refusals (an unknown layer name, a 4-bit base under FSDP or on a device without NF4).
LoRA under FSDP: test_causal_lm_lora_fsdp.py.

The runs are examples/lora-tiny-cpu.yaml (the built-in tiny Llama, frozen, rank-16
adapters on every decoder linear layer and a trained output head), shortened, with adapter
dropout on so that the resumed RNG streams matter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from safetensors.torch import load_file

from skylift.checkpoint.manifest import committed_steps
from skylift.config import load_config
from skylift.errors import SkyliftConfigError
from skylift.recipes.causal_lm import CausalLM
from skylift.recipes.tiny_lm import tiny_llama, tiny_tokenizer
from skylift.storage import open_store
from tests.checkpoint.runs import ONE_THREAD, losses_by_step, run_here, state_kept, summary
from tests.conftest import run_cli

PRESET = "examples/lora-tiny-cpu.yaml"
STEPS, EVERY, KILLED_AT = 12, 4, 8
SHORT = ("precision=fp32", "deterministic=true", f"schedule.max_steps={STEPS}", "schedule.warmup_steps=2",
         f"checkpoint.every_steps={EVERY}", "checkpoint.every_minutes=null", "monitor.log_every_steps=1",
         "monitor.tensorboard=false", "monitor.report=false", "monitor.progress_bar=false",
         "recipe.lora.dropout=0.1")  # fmt: skip


def _args(run_dir: Path, *overrides: str) -> list[str]:
    args = ["run", PRESET, "--json", "--no-doctor", "--set", f"run_dir={run_dir}"]
    for override in (*SHORT, *overrides):
        args += ["--set", override]
    return args


def _config(run_dir: Path, *overrides: str):
    return load_config(PRESET, [f"run_dir={run_dir}", *SHORT, *overrides])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, in this process on one thread (equal to a subprocess's)."""
    run_dir = tmp_path_factory.mktemp("lora-reference") / "run"
    result = run_here(*_args(run_dir))
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


def _trained(run_dir: Path) -> torch.nn.Module:
    """The run's model as it trained: the tiny Llama of its seed under the adapters, the
    final adapter weights loaded (strictly: every adapter, nothing else)."""
    model = CausalLM(_config(run_dir)).build_model()
    model.load_state_dict(load_file(run_dir / "model.safetensors"))
    return model.eval()


def test_checkpoint_holds_the_adapters_and_their_optimizer_state_only(reference):
    model = CausalLM(_config(reference)).build_model()
    trainable = {name for name, parameter in model.named_parameters() if parameter.requires_grad}
    frozen = sum(parameter.numel() for parameter in model.parameters() if not parameter.requires_grad)
    assert trainable and frozen > 0
    assert all("lora_" in name or "modules_to_save" in name for name in trainable)
    checkpoint = reference / "checkpoints" / f"step-{STEPS}"
    saved = load_file(checkpoint / "model.safetensors")
    assert set(saved) == trainable  # no frozen base weight, no buffer (the rotary table is not persistent)
    assert set(load_file(reference / "model.safetensors")) == trainable
    optimizer = load_file(checkpoint / "optimizer.safetensors")
    assert {key.split("/")[0] for key in optimizer} == {str(index) for index in range(len(trainable))}
    # AdamW: step, exp_avg and exp_avg_sq of each trainable parameter, nothing of the base.
    assert sum(tensor.numel() for tensor in optimizer.values()) == 2 * sum(
        saved[name].numel() for name in saved) + len(trainable)  # fmt: skip
    # Of the whole model's fp32 bytes, the checkpoint's weights are the trainable share only.
    total = sum(parameter.numel() for parameter in model.parameters())
    assert (checkpoint / "model.safetensors").stat().st_size < 4 * total * 0.5


@pytest.mark.slow
def test_killed_lora_run_resumes_exactly(reference, tmp_path):
    """SIGKILL right after step 8's manifest, then the same command: every step's loss
    and the final adapter weights equal the uninterrupted run's, bit for bit."""
    run_dir = tmp_path / "run"
    killed = run_cli(*_args(run_dir), env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": f"after_manifest:step={KILLED_AT}"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == KILLED_AT
    resumed = run_here(*_args(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == KILLED_AT
    assert losses_by_step(run_dir) == losses_by_step(reference)
    assert sorted(losses_by_step(run_dir)) == list(range(1, STEPS + 1))
    final, want = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == want.keys() and all(torch.equal(final[name], want[name]) for name in want)


def test_export_writes_a_peft_adapter_folder_and_the_merged_model(reference, tmp_path, cli_here):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tokens = torch.arange(1, 33).reshape(2, 16)
    trained = _trained(reference)
    with torch.no_grad():
        want = trained(input_ids=tokens).logits
    adapters = tmp_path / "adapters"
    with state_kept():
        result = cli_here("export", str(reference), "--to", "hf", str(adapters), "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["layout"] == "adapters"
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {p.name for p in adapters.iterdir()}
    adapter_config = json.loads((adapters / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (16, 32.0)
    assert set(adapter_config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                     "down_proj"}  # fmt: skip
    loaded = PeftModel.from_pretrained(tiny_llama(tiny_tokenizer(), seed=0), str(adapters)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, want)

    merged = tmp_path / "merged"
    with state_kept():
        result = cli_here("export", str(reference), "--to", "hf", str(merged), "--merged")
    assert result.returncode == 0, result.stderr
    assert "AutoModelForCausalLM.from_pretrained" in result.stdout
    plain = AutoModelForCausalLM.from_pretrained(str(merged)).eval()
    assert not any("lora" in name for name, _ in plain.named_parameters())
    with torch.no_grad():
        # W + s·BA computes W·x + s·B(A·x) in another order: fp32 rounding only.
        torch.testing.assert_close(plain(input_ids=tokens).logits, want, rtol=1e-4, atol=1e-5)


def test_merged_export_of_a_full_fine_tune_is_refused(tmp_path):
    recipe = CausalLM(_config(tmp_path / "run", "recipe.lora=null"))
    with pytest.raises(SkyliftConfigError, match="--merged: this run trained every weight"):
        recipe.export_pretrained({}, tmp_path, merged=True)


def test_a_target_that_matches_no_layer_lists_the_linear_layers(tmp_path):
    recipe = CausalLM(_config(tmp_path / "run", "recipe.lora.target_modules=[q_proj, qkv]"))
    with pytest.raises(SkyliftConfigError, match=r"recipe.lora.target_modules: qkv matches no linear layer of "
                       r"LlamaForCausalLM; its linear layers are named down_proj, gate_proj, k_proj, lm_head, "
                       r"o_proj, q_proj, up_proj, v_proj"):  # fmt: skip
        recipe.build_model()


def test_default_targets_are_every_linear_layer_but_the_head(tmp_path):
    model = CausalLM(_config(tmp_path / "run", "recipe.lora.modules_to_save=null")).build_model()
    adapted = {name.split(".lora_A")[0].rsplit(".", 1)[-1] for name, _ in model.named_parameters() if "lora_A" in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert all(parameter.requires_grad == ("lora_" in name) for name, parameter in model.named_parameters())


def test_a_4bit_base_is_checked_for_cuda_and_the_cpu_and_refused_elsewhere(cli_here):
    """bitsandbytes' NF4 runs on CUDA and the CPU (QLoRA: test_causal_lm_qlora.py); a
    device it has no 4-bit kernels for is refused, naming the fix."""
    from skylift.recipes.settings.causal_lm import LoraSettings

    result = cli_here("check", PRESET, "--set", "device=cpu", "--set", "recipe.lora.quantize_base=nf4")
    assert result.returncode == 0, result.stderr[-2000:]
    with pytest.raises(SkyliftConfigError, match="runs on CUDA and the CPU, and this run trains on mps") as refused:
        LoraSettings(quantize_base="nf4").check_device("mps")
    assert "remove recipe.lora.quantize_base" in refused.value.hint


def test_adapters_under_fsdp_pass_the_check_and_what_is_not_built_is_refused_with_the_fix(cli_here):
    """LoRA under FSDP trains (tests/recipes/test_causal_lm_lora_fsdp.py), DPO with adapters
    too (test_causal_lm_dpo.py), and so does DPO without adapters (its frozen reference copy
    sharded as the policy); a 4-bit base under FSDP is refused."""
    assert cli_here("check", PRESET, "--set", "distributed.strategy=fsdp").returncode == 0
    result = cli_here("check", PRESET, "--set", "distributed.strategy=fsdp", "--set", "recipe.lora.quantize_base=nf4")
    assert result.returncode == 2
    assert "recipe.lora.quantize_base: nf4 with distributed.strategy: fsdp is not built" in result.stderr
    assert "fsdp_pre_all_gather" in result.stderr and "distributed.strategy: ddp" in result.stderr
    assert cli_here("check", "examples/dpo-lora-cpu.yaml", "--set", "distributed.strategy=fsdp").returncode == 0
    result = cli_here("check", "examples/dpo-lora-cpu.yaml", "--set", "distributed.strategy=fsdp",
                      "--set", "recipe.lora=null", "--set", "recipe.dpo.reference=null")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reference: frozen_copy" in result.stdout


@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ddp_ranks_train_the_adapters_alike(tmp_path, cli):
    """2 gloo ranks: only the adapters' gradients are reduced; the replicas end equal and
    the checkpoint holds the adapters only."""
    run_dir = tmp_path / "run"
    result = cli(*_args(run_dir, "schedule.max_steps=6"), "--nproc", "2", env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    done = summary(run_dir)
    assert (done["world_size"], done["steps"], done["replicas_agree"]) == (2, 6, True)
    saved = load_file(run_dir / "checkpoints" / "step-6" / "model.safetensors")
    assert saved and all("lora_" in name or "modules_to_save" in name for name in saved)
    losses = losses_by_step(run_dir)
    assert losses[6] < losses[1]


def test_shipped_lora_preset_learns_in_a_few_steps(tmp_path):
    """The example as shipped, 22 steps (one epoch; 24 when packing ran across documents)
    in this process: the loss falls well below chance (measured: 6.18 -> about 2.3)."""
    run_dir = tmp_path / "run"
    result = run_here("run", PRESET, "--json", "--no-doctor", "--set", f"run_dir={run_dir}", "--set",
                      "schedule.epochs=1", "--set", "checkpoint.every_minutes=null", "--set", "monitor.report=false",
                      "--set", "monitor.tensorboard=false", "--set", "monitor.progress_bar=false")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    losses = losses_by_step(run_dir)
    last = max(losses)  # the epoch's last step
    assert last == 22 and losses[1] > 5.5 and max(losses[step] for step in (last - 2, last - 1, last)) < 3.5
    assert not any("base_layer" in name for name in load_file(run_dir / "model.safetensors"))
