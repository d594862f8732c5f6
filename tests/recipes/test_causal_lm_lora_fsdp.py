"""LoRA adapters under FSDP2: ``skylift run examples/lora-tiny-cpu.yaml --nproc 2 --set
distributed.strategy=fsdp``, the frozen tiny Llama sharded, the adapters (and the output
head's trained copy) learned, on 2 real gloo processes under torchrun.

FSDP2 shards each parameter by itself (a ``DTensor`` per parameter), so one unit (a
``LlamaDecoderLayer``) may hold frozen base weights and trainable adapters together: it
all-gathers both for the forward and reduce-scatters only the gradients that exist
(torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, ``post_backward``); the
uniform-dtype checks there look at the trainable parameters only (``_init_mp_dtypes``).
What the checkpoint holds comes from the adapters' state-dict hook
(:func:`skylift.recipes.adapters.keep_trainable_only`), which DCP's ``get_state_dict``
goes through: the sharded checkpoint holds the adapters' chunks and their AdamW state.

Checked here: a SIGKILL mid-epoch resumes bit for bit; a spot notice from the loopback
metadata server commits an adapter checkpoint and the run exits 143; the checkpoint's
size against the full FSDP fine-tune of the same model; ``skylift export`` of the sharded
checkpoint is a PEFT adapter folder with the trained model's logits.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from safetensors.torch import load_file

from skylift.checkpoint.consolidate import full_model_state
from skylift.checkpoint.manifest import committed_steps, read_manifest, read_verified
from skylift.config import load_config
from skylift.errors import EXIT_REQUEUE
from skylift.recipes.causal_lm import CausalLM
from skylift.recipes.tiny_lm import tiny_llama, tiny_tokenizer
from skylift.storage import open_store
from tests.checkpoint.runs import assert_same_run, losses_by_step, records, state_kept, summary
from tests.checkpoint.test_preemption import _environment, _latest_train_step
from tests.cloud.metadata_server import MetadataServer
from tests.conftest import REPO_ROOT, run_cli
from tests.process_family import ProcessFamily

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

PRESET = "examples/lora-tiny-cpu.yaml"
STEPS, EVERY, KILLED_AT = 48, 8, 16
"""24 steps an epoch (386 blocks, 16 a step): step 16 is mid-epoch."""
ARM_AFTER_STEP = EVERY + 2
"""The notice lands after step 8's periodic save: the emergency save is the one that counts."""
EXACT = ("precision=fp32", "deterministic=true", f"schedule.max_steps={STEPS}", "schedule.warmup_steps=2",
         f"checkpoint.every_steps={EVERY}", "checkpoint.every_minutes=null", "monitor.log_every_steps=1",
         "monitor.tensorboard=false", "monitor.report=false", "monitor.progress_bar=false",
         "preemption.poll_interval_s=0.05", "distributed.strategy=fsdp",
         "recipe.lora.dropout=0.1")  # dropout on: the resumed RNG streams matter  # fmt: skip


def _arguments(run_dir: Path, *overrides: str) -> list[str]:
    args = ["run", PRESET, "--no-doctor", "--json", "--nproc", "2", "--set", f"run_dir={run_dir}"]
    for override in (*EXACT, *overrides):
        args += ["--set", override]
    return args


def _train(run_dir: Path, *overrides: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run_cli(*_arguments(run_dir, *overrides), env={**_environment(), **(env or {})}, timeout_s=400)


def _trainable_names(run_dir: Path) -> set[str]:
    model = CausalLM(load_config(PRESET, [f"run_dir={run_dir}", *EXACT])).build_model()
    return {name for name, parameter in model.named_parameters() if parameter.requires_grad}


def _folder_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.iterdir() if path.is_file())


def _numel(path: Path) -> int:
    return sum(tensor.numel() for tensor in load_file(path).values())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted two-rank FSDP LoRA run."""
    run_dir = tmp_path_factory.mktemp("lora-fsdp-reference") / "run"
    result = _train(run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "sharded over 2 rank(s)" in result.stderr
    done = summary(run_dir)
    assert (done["world_size"], done["steps"]) == (2, STEPS)
    return run_dir


def test_the_sharded_checkpoint_holds_the_adapters_and_their_optimizer_state_only(reference):
    trainable = _trainable_names(reference)
    store = open_store(str(reference / "checkpoints"))
    manifest = read_manifest(store, STEPS)
    assert (manifest.layout, manifest.world_size) == ("sharded", 2)
    read_verified(store, STEPS, manifest)  # every rank's shards against their sha256
    folder = reference / "checkpoints" / f"step-{STEPS}"
    model_keys = {key.split("@")[0].removeprefix("model/") for rank in (0, 1)
                  for key in load_file(folder / f"model-rank{rank}.safetensors")}  # fmt: skip
    assert model_keys == trainable  # no frozen base weight
    optimizer_keys = {key.split("@")[0].removeprefix("optimizer/") for rank in (0, 1)
                      for key in load_file(folder / f"optimizer-rank{rank}.safetensors")}  # fmt: skip
    assert optimizer_keys == {f"{name}/{state}" for name in trainable for state in ("step", "exp_avg", "exp_avg_sq")}
    # The chunks assemble to the final adapters the run gathered and wrote.
    step, weights = full_model_state(str(reference / "checkpoints"))
    final = load_file(reference / "model.safetensors")
    assert step == STEPS and weights.keys() == final.keys() == trainable
    assert all(torch.equal(weights[name], final[name]) for name in final)
    losses = losses_by_step(reference)
    assert losses[STEPS] < losses[1] - 1.0  # the adapters learn: 6.18 at step 1


def test_a_sigkill_mid_epoch_resumes_exactly(reference, tmp_path):
    """Both ranks SIGKILLed right after step 16's manifest (mid-epoch), then the same
    command: every step's loss and the final adapters equal the uninterrupted run's, bit
    for bit (same ranks, same kernels, same order of every sum)."""
    run_dir = tmp_path / "run"
    killed = _train(run_dir, env={"SKYLIFT_FAULT_INJECTION": f"after_manifest:step={KILLED_AT}"})
    assert killed.returncode != 0, killed.stderr[-3000:]
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == KILLED_AT
    assert max(losses_by_step(run_dir)) == KILLED_AT
    resumed = _train(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == KILLED_AT
    assert sorted(losses_by_step(run_dir)) == list(range(1, STEPS + 1))
    assert_same_run(run_dir, reference)


def test_a_spot_notice_commits_the_adapters_and_exits_143(reference, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with MetadataServer() as server, (tmp_path / "stderr").open("w") as stderr:
        env = _environment("aws", server.url)
        family = ProcessFamily(subprocess.Popen([sys.executable, "-m", "skylift", *_arguments(run_dir)], cwd=REPO_ROOT,
                                                env=env, stdout=subprocess.DEVNULL, stderr=stderr,
                                                stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        try:
            deadline = time.monotonic() + 300
            while _latest_train_step(run_dir) < ARM_AFTER_STEP:
                if family.popen.poll() is not None:
                    raise AssertionError((tmp_path / "stderr").read_text()[-3000:])
                if time.monotonic() > deadline:
                    raise AssertionError("the run did not reach the arming step")
                family.remember_family(every_s=0.5)
                time.sleep(0.01)
            deadline_s = server.arm("aws", deadline_in_s=90)
            returncode = family.popen.wait(300)
        finally:
            family.kill()
    assert returncode == EXIT_REQUEUE, (tmp_path / "stderr").read_text()[-3000:]
    (record,) = records(run_dir, "preemption")
    stopped_at = _latest_train_step(run_dir)
    assert ARM_AFTER_STEP <= stopped_at < STEPS
    assert record["saved"] and record["checkpoint_step"] == stopped_at, record
    assert record["notice_to_commit_s"] < record["seconds_left_at_notice"], record
    print(f"notice -> commit {record['notice_to_commit_s']} s (of {record['seconds_left_at_notice']} s left), "
          f"step {stopped_at}")
    store = open_store(str(run_dir / "checkpoints"))
    manifest = read_manifest(store, stopped_at)
    assert (manifest.layout, manifest.world_size) == ("sharded", 2) and manifest.created_at < deadline_s
    read_verified(store, stopped_at, manifest)
    folder = run_dir / "checkpoints" / f"step-{stopped_at}"
    saved = {key.split("@")[0].removeprefix("model/") for rank in (0, 1)
             for key in load_file(folder / f"model-rank{rank}.safetensors")}  # fmt: skip
    assert saved == _trainable_names(run_dir)
    # The same command again continues from the noticed step to the uninterrupted run's end.
    resumed = _train(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == stopped_at
    assert_same_run(run_dir, reference)


def test_the_adapter_checkpoint_is_a_fraction_of_the_full_fine_tunes(reference, tmp_path):
    """The same tiny model fine-tuned whole under FSDP (8 steps), its checkpoint on disk,
    against the LoRA run's last (a checkpoint's size does not depend on its step): the
    frozen base and its optimizer state are not stored."""
    full = tmp_path / "full"
    result = _train(full, "recipe.lora=null", f"schedule.max_steps={EVERY}")
    assert result.returncode == 0, result.stderr[-3000:]
    full_bytes = _folder_bytes(full / "checkpoints" / f"step-{EVERY}")
    lora_bytes = _folder_bytes(reference / "checkpoints" / f"step-{STEPS}")
    model = CausalLM(load_config(PRESET, [f"run_dir={reference}", *EXACT])).build_model()
    trainable = sum(parameter.numel() for parameter in model.parameters() if parameter.requires_grad)
    base = sum(parameter.numel() for parameter in model.parameters() if not parameter.requires_grad)
    print(f"checkpoint: LoRA under FSDP {lora_bytes} bytes, full FSDP fine-tune {full_bytes} bytes "
          f"({lora_bytes / full_bytes:.3f}); parameters trained {trainable} of {trainable + base}")
    # Weights plus AdamW's two moments, fp32: 12 bytes a trained parameter, on either side.
    stored = sum(_numel(reference / "checkpoints" / f"step-{STEPS}" / f"{kind}-rank{rank}.safetensors")
                 for kind in ("model", "optimizer") for rank in (0, 1))  # fmt: skip
    assert stored == 3 * trainable + len(_trainable_names(reference))  # and one step count each
    assert lora_bytes < 0.6 * full_bytes


def test_export_of_the_sharded_checkpoint_is_a_peft_folder_with_the_trained_logits(reference, tmp_path, cli_here):
    from peft import PeftModel

    tokens = torch.arange(1, 33).reshape(2, 16)
    trained = CausalLM(load_config(PRESET, [f"run_dir={reference}", *EXACT])).build_model()
    trained.load_state_dict(load_file(reference / "model.safetensors"))  # strict: every adapter, nothing else
    with torch.no_grad():
        want = trained.eval()(input_ids=tokens).logits
    out = tmp_path / "adapters"
    with state_kept():
        result = cli_here("export", str(reference), "--to", "hf", str(out), "--source", "checkpoint", "--json")
    assert result.returncode == 0, result.stderr
    exported = json.loads(result.stdout)
    assert (exported["layout"], exported["source"], exported["step"]) == ("adapters", "checkpoint", STEPS)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {path.name for path in out.iterdir()}
    loaded = PeftModel.from_pretrained(tiny_llama(tiny_tokenizer(), seed=0), str(out)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, want)


# -- mixed requires_grad inside one FSDP2 unit, in 2 spawned gloo ranks ------------------


def _mixed_unit_worker(rank: int, world_size: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from tests.gloo_group import join

    join(rank, world_size, port)
    try:
        Path(out, f"rank{rank}.json").write_text(json.dumps(_one_step_on_a_mixed_unit(rank, world_size)))
    finally:
        dist.destroy_process_group()


def _one_step_on_a_mixed_unit(rank: int, world_size: int) -> dict:
    """The LoRA tiny Llama sharded as skylift shards it (each LlamaDecoderLayer a unit,
    then the root), one AdamW step on a batch per rank; against an unsharded copy that
    sums both ranks' gradients itself."""
    import copy

    from torch.distributed.tensor import DTensor, Shard

    from skylift.config.distributed import FsdpConfig
    from skylift.recipes.adapters import apply_lora
    from skylift.recipes.settings.causal_lm import LoraSettings
    from skylift.train.precision import PrecisionPolicy
    from skylift.train.sharding import Sharding

    torch.manual_seed(0)
    model = apply_lora(tiny_llama(tiny_tokenizer(), seed=0), LoraSettings(rank=4, modules_to_save=["lm_head"]), seed=0)
    with torch.no_grad():  # B starts at zero, which would leave A's gradient zero: give it values
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.normal_(std=0.02)
    whole = copy.deepcopy(model)
    sharding = Sharding(FsdpConfig(), PrecisionPolicy("fp32", None, False, False, "test"), torch.device("cpu"))
    sharding.apply(model)
    units = [sorted({parameter.requires_grad for parameter in block.parameters()}) for block in sharding.blocks]
    frozen_before = {name: parameter.to_local().clone() for name, parameter in model.named_parameters()
                     if not parameter.requires_grad}  # fmt: skip
    batches = [torch.arange(1 + 7 * index, 33 + 7 * index).reshape(2, 16) for index in range(world_size)]

    def loss_of(module: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        return module(input_ids=tokens, labels=tokens).loss

    loss_of(model, batches[rank]).backward()
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    torch.optim.AdamW(trainable, lr=1e-2).step()
    for tokens in batches:  # the unsharded model: the mean of both ranks' gradients
        (loss_of(whole, tokens) / world_size).backward()
    wanted = dict(whole.named_parameters())
    gradients = {name: parameter.grad for name, parameter in model.named_parameters()}
    sharded_gradients = [gradient for gradient in gradients.values() if gradient is not None]
    return {
        "units": units,
        "frozen_without_gradient": all(gradients[name] is None for name in frozen_before),
        "frozen_unchanged": all(torch.equal(parameter.to_local(), frozen_before[name])
                                for name, parameter in model.named_parameters() if name in frozen_before),
        "trainable": len(trainable),
        "gradients_sharded": all(isinstance(gradient, DTensor) and gradient.placements == (Shard(0),)
                                 for gradient in sharded_gradients),
        "largest_gradient_difference": max(
            float((gradient.full_tensor() - wanted[name].grad).abs().max())
            for name, gradient in gradients.items() if gradient is not None),
    }  # fmt: skip


def test_fsdp2_shards_a_unit_of_frozen_and_trainable_parameters_and_reduces_only_the_adapters(tmp_path):
    from tests.gloo_group import spawn_ranks

    spawn_ranks(_mixed_unit_worker, 2, str(tmp_path))
    for rank in range(2):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["units"] == [[False, True], [False, True]]  # each decoder layer: base and adapters together
        assert result["frozen_without_gradient"] and result["frozen_unchanged"], result
        assert result["trainable"] > 0 and result["gradients_sharded"], result
        # The reduce-scattered gradients are the unsharded model's mean over both batches, bit
        # for bit: the same full weights and kernels on each batch, and (g0 + g1) / 2 against
        # g0 / 2 + g1 / 2, where halving is exact and a sum of two addends commutes.
        assert result["largest_gradient_difference"] == 0.0, result
