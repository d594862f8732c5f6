"""``skylift export RUN_DIR --to hf OUT``: a trained causal LM leaves as a Hugging Face
folder that ``from_pretrained`` loads and that gives the trained model's logits, bit for
bit; which weights it takes (final or newest checkpoint) and its refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from safetensors import safe_open
from safetensors.torch import load_file

from skylift.checkpoint.consolidate import full_model_state
from skylift.config import load_config
from skylift.recipes import build_recipe
from tests.recipes.tiny_lm import PRESET, QUIET

PROMPTS = ["colour of a lemon:", "count from 3: 3 4 5", "after 12 comes"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The CPU preset trained for 6 steps by the Trainer in this process (torch and
    transformers are loaded already), on one thread (a model this small is fastest on
    one): a checkpoint at step 4, the end's at 6, and the final weights."""
    from skylift.train.trainer import Trainer

    run_dir = tmp_path_factory.mktemp("export") / "run"
    config = load_config(PRESET, [f"run_dir={run_dir}", *QUIET, "schedule.max_steps=6", "schedule.warmup_steps=2",
                                  "checkpoint.every_steps=4", "checkpoint.every_minutes=null",
                                  "checkpoint.async_save=false"])  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(config).fit()
    finally:
        torch.set_num_threads(threads)
    return run_dir


def _logits(model, tokenizer) -> torch.Tensor:
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        return model.eval()(**batch).logits


def _trained_model(run_dir, weights):
    """The recipe's own model (what the run trained), holding ``weights``."""
    recipe = build_recipe(load_config(run_dir / "config.yaml"))
    model = recipe.build_model()
    model.load_state_dict(weights)
    return model, recipe.tokenizer


def _exported(out):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(out))


def _export(cli_here, *args):
    result = cli_here("export", *args, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_export_loads_in_transformers_and_gives_the_trained_logits(cli_here, trained, tmp_path):
    out = tmp_path / "hf"
    report = _export(cli_here, str(trained), "--to", "hf", str(out))
    assert (report["source"], report["step"], report["dtype"]) == ("final", 6, "fp32")
    assert "newest checkpoint is of step 6" in report["reason"]
    assert {path.rsplit("/", 1)[1] for path in report["files"]} >= {"config.json", "model.safetensors",
                                                                     "tokenizer.json", "tokenizer_config.json"}
    model, tokenizer = _exported(out)
    trained_model, trained_tokenizer = _trained_model(trained, load_file(trained / "model.safetensors"))
    assert tokenizer(PROMPTS)["input_ids"] == trained_tokenizer(PROMPTS)["input_ids"]
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    # The same fp32 weights in the same architecture: the same arithmetic, so equal bits.
    assert torch.equal(_logits(model, tokenizer), _logits(trained_model, trained_tokenizer))


def test_export_takes_the_newest_checkpoint_when_no_final_weights_are_newer(cli_here, trained, tmp_path):
    """A run still training (or killed) has no summary.json of its last step: its newest
    complete checkpoint is the newest model."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / "summary.json").unlink()
    report = _export(cli_here, str(run_dir), "--to", "hf", str(tmp_path / "hf"))
    assert (report["source"], report["step"]) == ("checkpoint", 6)
    assert "no summary.json" in report["reason"]
    step, weights = full_model_state(str(run_dir / "checkpoints"))
    model, tokenizer = _exported(tmp_path / "hf")
    assert torch.equal(_logits(model, tokenizer), _logits(*_trained_model(run_dir, weights)))
    older = _export(cli_here, str(run_dir), "--to", "hf", str(tmp_path / "hf4"), "--source", "checkpoint")
    assert older["source"] == "checkpoint" and older["step"] == step == 6


def test_bf16_export_and_the_written_dtype(cli_here, trained, tmp_path):
    out = tmp_path / "hf"
    report = _export(cli_here, str(trained), "--to", "hf", str(out), "--dtype", "bf16")
    assert report["dtype"] == "bf16"
    with safe_open(str(out / "model.safetensors"), "pt") as weights:
        names = weights.keys()  # a safe_open handle is not a mapping
        assert {weights.get_slice(name).get_dtype() for name in names} == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_export_refusals_name_the_problem(cli_here, trained, tmp_path):
    result = cli_here("export", str(tmp_path / "nowhere"), "--to", "hf", str(tmp_path / "out"))
    assert result.returncode == 2 and "does not exist, so it is not a run folder" in result.stderr
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    result = cli_here("export", str(trained), "--to", "hf", str(tmp_path / "taken"))
    assert result.returncode == 2 and "exists and is not empty" in result.stderr and "--force" in result.stderr
    assert _export(cli_here, str(trained), "--to", "hf", str(tmp_path / "taken"), "--force")["source"] == "final"
    assert not (tmp_path / "taken" / "file").exists()

    empty = tmp_path / "empty-run"
    empty.mkdir()
    shutil.copy(trained / "config.yaml", empty / "config.yaml")
    result = cli_here("export", str(empty), "--to", "hf", str(tmp_path / "out"))
    assert result.returncode == 2 and "no committed checkpoint" in result.stderr
    assert not (tmp_path / "out").exists()

    images = tmp_path / "image-run"
    images.mkdir()
    (images / "config.yaml").write_text("recipe: {name: image_classification}\n")
    result = cli_here("export", str(images), "--to", "hf", str(tmp_path / "out"))
    assert result.returncode == 2 and "image_classification" in result.stderr and "does not export" in result.stderr


def test_a_checkpoint_that_cannot_be_read_stops_the_export_in_one_line(cli_here, trained, tmp_path):
    """Step 6's weights cannot be read (a folder where the file should be: the local
    store's permanent error, as a 403 is S3's): exporting step 4 instead would quietly
    give older weights, so the export stops, naming the file."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    (run_dir / "summary.json").unlink()
    weights = run_dir / "checkpoints" / "step-6" / "model.safetensors"
    weights.unlink()
    weights.mkdir()
    result = cli_here("export", str(run_dir), "--to", "hf", str(tmp_path / "hf"))
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("skylift export: cannot export: "), result.stderr
    assert "step-6 could not be read" in lines[0] and "step-6/model.safetensors" in lines[0]
    assert not (tmp_path / "hf").exists()
