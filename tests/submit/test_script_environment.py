"""The variables a script job reads: ``skylift launch``'s flags set them, and
``script_environment.apply_to`` turns them into a run config's folder and checkpoint root."""

from __future__ import annotations

import logging
from pathlib import Path

from skylift.config.load import load_config
from skylift.config.script_environment import apply_to


def test_the_variables_replace_the_configs_folder_and_root_and_say_so(caplog):
    config = load_config("examples/own_loop.yaml")
    environ = {"SKYLIFT_RUN_DIR": "/opt/ml/model", "SKYLIFT_CHECKPOINT_ROOT": "s3://bucket/runs/own-loop",
               "SKYLIFT_PLATFORM": "sagemaker"}
    with caplog.at_level(logging.INFO, logger="skylift"):
        applied = apply_to(config, environ)
    assert (applied.run_dir, applied.checkpoint.root) == (Path("/opt/ml/model"), "s3://bucket/runs/own-loop")
    assert (config.run_dir, config.checkpoint.root) == (Path("runs/own_loop"), None)  # the given one is left alone
    assert "run_dir: /opt/ml/model from SKYLIFT_RUN_DIR (the config says runs/own_loop)" in caplog.text
    assert "checkpoint.root: s3://bucket/runs/own-loop from SKYLIFT_CHECKPOINT_ROOT" in caplog.text
    untouched = applied.model_dump(exclude={"run_dir", "checkpoint"})
    assert untouched == config.model_dump(exclude={"run_dir", "checkpoint"})


def test_without_the_variables_the_config_stands_and_nothing_is_logged(caplog):
    config = load_config("examples/own_loop.yaml")
    with caplog.at_level(logging.INFO, logger="skylift"):
        assert apply_to(config, {"SKYLIFT_RUN_DIR": ""}) == config
    assert caplog.text == ""


def test_launch_sets_the_variables_from_its_flags(cli_here):
    result = cli_here("launch", "--dry-run", "--checkpoint-root", "s3://bucket/runs/own-loop", "--run-dir", "runs/x",
                      "--", "python", "examples/own_loop.py")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == ["SKYLIFT_RUN_DIR=runs/x", "SKYLIFT_CHECKPOINT_ROOT=s3://bucket/runs/own-loop"]
    # The startup folder first on the workers' PYTHONPATH: the attach hook reaches the processes they start.
    assert lines[2].startswith("PYTHONPATH=") and lines[2].split("=", 1)[1].split(":")[0].endswith(
        "skylift/integrations/startup")
    assert lines[3].startswith("torchrun ") and lines[3].endswith("-m skylift.cli.shim examples/own_loop.py")


def test_runtime_from_config_takes_the_folder_and_root_the_launcher_set(tmp_path, monkeypatch):
    import torch

    from skylift.loop.distributed import DistributedContext
    from skylift.train.runtime import Runtime

    monkeypatch.setenv("SKYLIFT_RUN_DIR", str(tmp_path / "platform-run"))
    monkeypatch.setenv("SKYLIFT_CHECKPOINT_ROOT", str(tmp_path / "platform-checkpoints"))
    runtime = Runtime.from_config("examples/own_loop.yaml", DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None))
    assert runtime.config.run_dir == tmp_path / "platform-run"
    assert runtime.config.checkpoint.root == str(tmp_path / "platform-checkpoints")
    assert runtime.services.run_dir.root == tmp_path / "platform-run"
