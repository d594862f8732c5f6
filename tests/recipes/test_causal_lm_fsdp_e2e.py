"""The causal-LM fine-tune sharded end to end, as a user runs it: ``skylift run
examples/causal-lm-cpu.yaml --nproc 2 --set distributed.strategy=fsdp``, killed right
after a committed sharded checkpoint, resumed exactly on two ranks and resharded onto one,
then exported with ``skylift export --to hf`` and loaded by ``from_pretrained``.

The other parts have their own tests on smaller models (tests/checkpoint/test_sharded*.py,
tests/train/test_fsdp.py, tests/cli/test_export.py); this one holds them together on the
recipe the FSDP work is for.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from skylift.checkpoint.manifest import committed_steps, read_manifest
from skylift.storage import open_store
from tests.checkpoint.runs import losses_by_step, state_kept, summary
from tests.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

STEPS, EVERY = 12, 4
SEQUENCE_LENGTH, GLOBAL_BATCH = 64, 16
EXACT = ("precision=fp32", "deterministic=true", f"schedule.max_steps={STEPS}", "schedule.warmup_steps=2",
         f"checkpoint.every_steps={EVERY}", "checkpoint.every_minutes=null", "monitor.log_every_steps=1",
         "monitor.tensorboard=false", "monitor.report=false", "distributed.strategy=fsdp")


def _train(run_dir, *, nproc: int = 2, env: dict[str, str] | None = None, cli=None):
    """The run in a subprocess, or with ``cli`` (``cli_here`` inside state_kept) in this one."""
    args = ["run", "examples/causal-lm-cpu.yaml", "--no-doctor", "--json", "--set", f"run_dir={run_dir}"]
    for override in EXACT:
        args += ["--set", override]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    if cli is not None:
        return cli(*args, env=env)
    return run_cli(*args, env={**({"OMP_NUM_THREADS": "1"} if nproc == 1 else {}), **(env or {})}, timeout_s=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("reference-causal-fsdp")
    result = _train(run_dir)
    assert result.returncode == 0, result.stderr[-4000:]
    return run_dir


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Both ranks SIGKILLed right after step 8's manifest: a complete sharded checkpoint stands."""
    run_dir = tmp_path_factory.mktemp("killed-causal-fsdp") / "run"
    result = _train(run_dir, env={"SKYLIFT_FAULT_INJECTION": "after_manifest:step=8"})
    assert result.returncode != 0, result.stderr[-3000:]
    store = open_store(str(run_dir / "checkpoints"))
    assert committed_steps(store)[-1] == 8
    manifest = read_manifest(store, 8)
    assert (manifest.layout, manifest.world_size) == ("sharded", 2)
    return run_dir


def test_killed_sharded_run_resumes_exactly_and_exports_a_loadable_hugging_face_folder(
        reference, killed, tmp_path, cli_here):
    run_dir = tmp_path / "run"
    shutil.copytree(killed, run_dir)
    resumed = _train(run_dir)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert summary(run_dir)["resumed_from_step"] == 8
    # Same world size, same arithmetic: every step's loss and the final weights bit for bit.
    assert losses_by_step(run_dir) == losses_by_step(reference)
    final, want = load_file(run_dir / "model.safetensors"), load_file(reference / "model.safetensors")
    assert final.keys() == want.keys() and all(torch.equal(final[name], want[name]) for name in want)

    out = tmp_path / "hf"
    exported = cli_here("export", str(run_dir), "--to", "hf", str(out), "--source", "checkpoint", "--json")
    assert exported.returncode == 0, exported.stderr
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out).eval()
    loaded = {name: tensor for name, tensor in model.state_dict().items() if name in final}
    assert loaded.keys() == final.keys() and all(torch.equal(loaded[name], final[name]) for name in final)
    # The same logits as the trained weights in a model built from the config alone.
    trained = AutoModelForCausalLM.from_config(model.config).eval()
    missing, unexpected = trained.load_state_dict(final, strict=False)
    assert not unexpected and all("lm_head" in name for name in missing), (missing, unexpected)  # tied to the embedding
    trained.tie_weights()
    tokens = torch.arange(1, 33).reshape(2, 16)
    with torch.no_grad():
        assert torch.equal(trained(tokens).logits, model(tokens).logits)


def test_a_two_rank_sharded_checkpoint_continues_on_one_process(reference, killed, tmp_path, cli_here):
    one = tmp_path / "one"
    shutil.copytree(killed, one)
    # In this process, on one thread (state_kept): the resharding onto one rank is under test,
    # not a process start (~5 s of imports). Its one-rank process group is an in-memory one
    # the trainer ends when the run does (FSDPSharding.release).
    with state_kept():
        resumed = _train(one, nproc=1, cli=cli_here)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    done = summary(one)
    assert (done["resumed_from_step"], done["steps"], done["world_size"]) == (8, STEPS, 1)
    losses, want = losses_by_step(one), losses_by_step(reference)
    assert sorted(losses) == list(range(1, STEPS + 1))
    # Step 9 starts from the resharded step-8 state on the same 16 sequences (the global
    # order does not depend on the world size). Only the per-token mean's summation order
    # differs (two ranks' partial sums, or one process's): at most one rounding per added
    # token, so a relative error under N x 2^-24 for the N <= 16 x 64 labelled tokens.
    assert losses[9] == pytest.approx(want[9], rel=GLOBAL_BATCH * SEQUENCE_LENGTH * 2**-24)
