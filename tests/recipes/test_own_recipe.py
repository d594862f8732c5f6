"""A user's recipe, named by import path in YAML, trained by ``skylift run``: streamed,
on 2 processes, killed and resumed exactly, with its report; a bad setting exits 2."""

from __future__ import annotations

import contextlib
import io
import json
import shutil

import pytest

from tests.checkpoint.runs import Background, assert_same_run, records, state_kept, summary
from tests.conftest import EXAMPLES, run_cli

EXACT = ("precision=fp32", "deterministic=true", "schedule.max_steps=30", "schedule.warmup_steps=5",
         "checkpoint.every_steps=7", "checkpoint.every_minutes=null", "monitor.log_every_steps=5",
         "monitor.tensorboard=false")


@pytest.fixture(scope="module")
def user_project(tmp_path_factory):
    """A folder of the user's own: the recipe file and a config next to it, plus digits shards."""
    folder = tmp_path_factory.mktemp("user-project")
    shutil.copy(EXAMPLES / "own_recipe" / "tasks.py", folder / "my_tasks.py")
    (folder / "run.yaml").write_text(
        "recipe:\n  name: ./my_tasks.py:DigitsMLP\n  hidden: 48\n"
        "data:\n  global_batch_size: 64\n  num_workers: 1\n"
    )
    shards = folder / "shards"
    # In this process: the shards are the input here, `skylift shard`'s own tests start it.
    from skylift.cli.main import main

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        code = main(["shard", "digits", str(shards), "--shard-size-mib", "0.05", "--json"])
    assert code == 0, printed.getvalue()
    return folder


def _arguments(project, run_dir, *overrides) -> list[str]:
    # --no-doctor: its checks are tested on their own; for a launcher of --nproc workers
    # its memory trace costs the import of torch._dynamo, which the launcher needs for nothing else.
    args = ["run", str(project / "run.yaml"), "--nproc", "2", "--json", "--no-doctor", "--set", f"run_dir={run_dir}",
            "--set", f"data.url={project / 'shards' / 'train'}", "--set", f"data.val_url={project / 'shards' / 'val'}",
            "--set", f"data.cache_dir={run_dir.parent / f'{run_dir.name}-cache'}"]  # one a job: they run at once
    for override in (*EXACT, *overrides):
        args += ["--set", override]
    return args


def _train(project, run_dir, *overrides, env=None):
    return run_cli(*_arguments(project, run_dir, *overrides), env=env)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_user_recipe_streams_on_two_processes_and_resumes_exactly_after_a_kill(user_project, tmp_path):
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    # The uninterrupted job runs beside the killed and resumed ones: their start-ups (one
    # core each) and steps overlap on the two cores.
    with Background.skylift(*_arguments(user_project, reference)) as uninterrupted:
        # The reference's report is checked below; the resumed run's is never read (~1.5 s of matplotlib).
        killed = _train(user_project, run_dir, "monitor.report=false",
                        env={"SKYLIFT_FAULT_INJECTION": "step_end:step=17"})
        assert killed.returncode != 0
        resumed = _train(user_project, run_dir, "monitor.report=false")
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        result = uninterrupted.result()
    assert result.returncode == 0, result.stderr[-3000:]
    finished = json.loads(result.stdout[result.stdout.index("{"):])
    assert finished["world_size"] == 2 and finished["steps"] == 30 and finished["replicas_agree"] is True
    assert (reference / "report" / "index.html").stat().st_size > 0 and finished["diagnosis"]
    resolved = (reference / "config.yaml").read_text()
    assert f"{user_project / 'my_tasks.py'}:DigitsMLP" in resolved and "hidden: 48" in resolved
    # Saves at 7 and 14 are asynchronous: at the kill (step 17) the one of step 14 may still be in
    # flight on two loaded cores, and then the newest complete checkpoint is step 7's.
    assert summary(run_dir)["resumed_from_step"] in (7, 14)
    assert_same_run(run_dir, reference)
    assert len(records(run_dir, "run_start")) == 2


# In this process (cli_here), the checks of what a command refuses or trains: its exit code,
# message and weights are under test, not a process start (seconds of imports each).
def test_a_bad_recipe_args_key_exits_2_naming_the_closest_one(user_project, cli_here):
    with state_kept():
        result = cli_here("run", str(user_project / "run.yaml"), "--set", "recipe.hiden=3")
    assert result.returncode == 2
    assert "recipe.hiden: unknown key. Did you mean 'recipe.hidden'?" in result.stderr
    assert "Valid keys here: hidden, layers" in result.stderr


def test_a_failing_import_names_the_path_the_search_path_and_the_error(tmp_path, cli_here):
    (tmp_path / "broken.py").write_text("import not_a_module_anywhere\n")
    (tmp_path / "run.yaml").write_text("recipe:\n  name: ./broken.py:Task\n")
    with state_kept():
        result = cli_here("run", str(tmp_path / "run.yaml"), "--dry-run")
    assert result.returncode == 2
    assert f"cannot import the file '{tmp_path / 'broken.py'}'" in result.stderr
    assert "ModuleNotFoundError: No module named 'not_a_module_anywhere'" in result.stderr
    assert "Module search path used:" in result.stderr
    with state_kept():
        module = cli_here("run", str(tmp_path / "run.yaml"), "--dry-run", "--set", "recipe.name=no_such_pkg.tasks:Task")
    assert module.returncode == 2 and "cannot import the module 'no_such_pkg.tasks'" in module.stderr


def test_a_user_model_by_import_path_and_any_torchvision_classifier(tmp_path, cli_here):
    (tmp_path / "models.py").write_text(
        "from torch import nn\n\ndef tiny(num_classes, width=16):\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), nn.ReLU(), nn.Linear(width, num_classes))\n")
    (tmp_path / "run.yaml").write_text("recipe:\n  model: ./models.py:tiny\n  model_args:\n    width: 24\n")
    with state_kept():
        result = cli_here("run", str(tmp_path / "run.yaml"), "--json", "--set", f"run_dir={tmp_path / 'run'}",
                          "--set", "schedule.max_steps=3", "--set", "schedule.warmup_steps=1",
                          "--set", "monitor.report=false")
    assert result.returncode == 0, result.stderr[-2000:]
    from safetensors.torch import load_file

    assert load_file(tmp_path / "run" / "model.safetensors")["1.weight"].shape == (24, 64)
    with state_kept():
        wrong = cli_here("check", str(tmp_path / "run.yaml"), "--set", "recipe.model=resnet51")
    assert wrong.returncode == 2 and "resnet50" in wrong.stderr  # the closest torchvision names
