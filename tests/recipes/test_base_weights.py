"""An adapter checkpoint resumed over another base is refused: the manifest records the
frozen base's fingerprint (the checkpoint holds the adapters only), and a resume whose
model folder holds other weights stops before anything loads, naming it and the fix."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from safetensors.torch import load_file, save_file

from skylift.checkpoint.manifest import committed_steps
from skylift.recipes.base_weights import weights_fingerprint
from skylift.recipes.tiny_lm import write_tiny_lm
from skylift.storage import open_store
from tests.checkpoint.runs import ONE_THREAD, run_here, summary
from tests.conftest import run_cli
from tests.recipes.test_causal_lm_lora import _args


def _resave_with_other_weights(folder) -> None:
    [weights] = folder.glob("*.safetensors")
    tensors = load_file(weights)
    name = min(name for name in tensors if "q_proj" in name)
    tensors[name] = tensors[name] + 0.01  # one projection fine-tuned a little: the same shapes and names
    save_file(tensors, str(weights), metadata={"format": "pt"})


def test_the_fingerprint_follows_the_weights_not_the_copy(tmp_path):
    folder = write_tiny_lm(tmp_path / "base")
    copied = tmp_path / "copied"
    shutil.copytree(folder, copied)  # another machine's copy: new time stamps, the same bytes
    assert weights_fingerprint(copied) == weights_fingerprint(folder)
    _resave_with_other_weights(copied)
    assert weights_fingerprint(copied) != weights_fingerprint(folder)


@pytest.mark.slow
def test_a_resume_over_a_re_saved_base_is_refused_and_over_the_same_base_goes_on(tmp_path):
    folder = write_tiny_lm(tmp_path / "base")
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)
    run_dir = tmp_path / "run"
    model = f"recipe.model_path={folder}"
    killed = run_cli(*_args(run_dir, model), env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": "after_manifest:step=4"})
    assert killed.returncode != 0 and committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == 4
    _resave_with_other_weights(folder)
    refused = run_here(*_args(run_dir, model))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert "recipe.model_path's weights:" in refused.stderr and "Resume with the base the checkpoint was trained over" in refused.stderr
    assert committed_steps(open_store(str(run_dir / "checkpoints")))[-1] == 4  # nothing written over it
    shutil.rmtree(folder)
    shutil.copytree(pristine, folder)  # the base as it was
    resumed = run_here(*_args(run_dir, model))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == 4
    assert torch.isfinite(torch.tensor(summary(run_dir)["eval_metrics"]["loss"]))


def test_a_recorded_fact_that_differs_is_refused_with_its_own_fix(tmp_path):
    from skylift.checkpoint import compatibility
    from skylift.config import load_config

    config = load_config("examples/lora-tiny-cpu.yaml", [f"run_dir={tmp_path}"])
    saved = compatibility.recorded_config(config, "fp32", {"base_weights": "aaa"})
    assert compatibility.compare(saved, config, "fp32", {"base_weights": "aaa"}) == []
    [difference] = compatibility.compare(saved, config, "fp32", {"base_weights": "bbb"})
    problem, fix = compatibility.refusal([difference], "step-4")
    assert "recipe.model_path's weights: aaa -> bbb" in problem and fix.startswith("Resume with the base")
    # A checkpoint of an earlier skylift records no facts: nothing to compare.
    assert compatibility.compare(compatibility.recorded_config(config, "fp32"), config, "fp32",
                                 {"base_weights": "bbb"}) == []
