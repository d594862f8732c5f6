"""Resuming with a changed config: a change that the saved state cannot take is refused
before anything loads (exit 2, one problem line naming every field as ``field: checkpoint
value -> this run's value``, and the fix); a change it can take applies from the resumed
step, said in one line; a checkpoint whose files verify but do not load is passed over
for the previous complete one, as a hash mismatch is.

Every run is the quickstart in this process (:func:`~tests.checkpoint.runs.lean_train_here`):
one run to step 6 (checkpoints at steps 3 and 6) is copied for each test, which resumes
it to step 9.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from skylift.checkpoint.compatibility import RULES, OptimizerSettings, recorded_config, rule_for, schema_fields
from skylift.checkpoint.manifest import file_entry
from skylift.cloud.redact import REDACTED
from skylift.config.optim import OptimConfig, ScheduleConfig
from skylift.config.schema import RunConfig
from skylift.train.optim import build_lr_schedule, build_optimizer
from tests.checkpoint.runs import lean_train_here, lean_train_in_fixture, records

SAVED = ("schedule.max_steps=6", "schedule.warmup_steps=2", "checkpoint.every_steps=3")
RESUMED = ("schedule.max_steps=9", "schedule.warmup_steps=2", "checkpoint.every_steps=3")


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("saved") / "run"
    result = lean_train_in_fixture(run_dir, *SAVED)
    assert result.returncode == 0, result.stderr[-3000:]
    return run_dir


@pytest.fixture
def run_dir(saved_run, tmp_path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(saved_run, copy)
    return copy


def _resume(cli_here, run_dir: Path, *changes: str):
    return lean_train_here(cli_here, run_dir, *RESUMED, *changes)


def _steps(run_dir: Path) -> list[str]:
    return sorted(path.name for path in (run_dir / "checkpoints").glob("step-*"))


@pytest.mark.parametrize(("changes", "named"), [
    pytest.param(["precision=fp16"], ["precision: fp32 -> fp16"], id="fp16"),
    pytest.param(["recipe.width=16"], ["recipe.width: 32 -> 16"], id="width"),
    pytest.param(["optim.name=sgd"], ["optim.name: adamw -> sgd"], id="sgd"),
    pytest.param(["data.val_fraction=0.3"], ["data.val_fraction: 0.2 -> 0.3"], id="val_fraction"),
    pytest.param(["recipe.width=16", "optim.name=sgd", "optim.lr=0.01"],
                 ["recipe.width: 32 -> 16", "optim.name: adamw -> sgd"], id="several"),
])
def test_a_change_the_state_cannot_take_is_refused_in_one_line(changes, named, cli_here, run_dir):
    """Before: fp16, width and SGD gave tracebacks after "resumed from" (exit 1); the
    changed val_fraction resumed silently on another split (exit 0)."""
    result = _resume(cli_here, run_dir, *changes)
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output[-3000:]
    assert result.returncode == 2, output[-3000:]
    assert "resumed from" not in output
    problems = [line for line in result.stderr.splitlines() if line.startswith("  - ")]
    assert len(problems) == 1, result.stderr
    for field in named:
        assert field in problems[0], problems
    assert "optim.lr" not in problems[0]  # a change the state can take is not refused
    fix = result.stderr.strip().splitlines()[-1]
    assert "--set " + named[0].split(":")[0] + "=" in fix and "checkpoint.root" in fix, fix
    assert _steps(run_dir) == ["step-3", "step-6"]  # nothing trained, nothing saved


def test_a_longer_schedule_is_the_one_change_said_and_an_unchanged_resume_says_none(cli_here, run_dir):
    unchanged = lean_train_here(cli_here, run_dir, *SAVED)  # resumes at its last step: trains nothing
    assert unchanged.returncode == 0, unchanged.stderr[-3000:]
    assert "resumed from" in unchanged.stderr and "changed settings" not in unchanged.stderr
    result = _resume(cli_here, run_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "changed settings" in line]
    assert len(lines) == 1 and lines[0].endswith("trains: schedule.max_steps: 6 -> 9"), result.stderr


def test_a_changed_lr_applies_from_the_resumed_step_and_says_so(cli_here, run_dir, saved_run, tmp_path):
    """Before: the optimizer's saved learning rate (and the schedule's base) overwrote the
    run's optim.lr without a word."""
    same = tmp_path / "same"
    shutil.copytree(saved_run, same)
    assert _resume(cli_here, same).returncode == 0
    result = _resume(cli_here, run_dir, "optim.lr=0.006")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if "changed settings" in line]
    assert len(lines) == 1, result.stderr
    assert "optim.lr: 0.003 -> 0.006" in lines[0] and "step 7" in lines[0], lines
    kept = {record["step"]: record["lr"] for record in records(same, "train") if record["step"] > 6}
    changed = {record["step"]: record["lr"] for record in records(run_dir, "train") if record["step"] > 6}
    assert kept and kept.keys() == changed.keys()
    for step, lr in kept.items():
        assert changed[step] == pytest.approx(2 * lr, rel=1e-9), (step, lr, changed[step])
    manifest = json.loads((run_dir / "checkpoints" / "step-9" / "manifest.json").read_text())
    assert manifest["config"]["optim"]["lr"] == 0.006


def _rewrite(run_dir: Path, step: int, name: str, data: bytes) -> None:
    """Replace a checkpoint file and record its new hash: the files verify, but may not load."""
    folder = run_dir / "checkpoints" / f"step-{step}"
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = file_entry(data)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def _renamed_key(data: bytes) -> bytes:
    tensors = load(data)
    first = min(tensors)
    tensors["renamed." + first] = tensors.pop(first)
    return save(tensors)


def _corrupt_header(data: bytes) -> bytes:
    length = struct.unpack("<Q", data[:8])[0]
    return data[:8] + b"{" * length + data[8 + length:]


@pytest.mark.parametrize("damage", [_renamed_key, _corrupt_header], ids=["key_mismatch", "corrupt_header"])
def test_a_checkpoint_that_verifies_but_does_not_load_falls_back(damage, cli_here, run_dir):
    """Before: a traceback (exit 1), step 3 never tried."""
    model = run_dir / "checkpoints" / "step-6" / "model.safetensors"
    _rewrite(run_dir, 6, "model.safetensors", damage(model.read_bytes()))
    result = _resume(cli_here, run_dir)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Traceback" not in output
    warnings = [line for line in result.stderr.splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and "step-6" in warnings[0] and "does not load" in warnings[0], result.stderr
    assert "resumed from" in result.stderr and "step-3" in result.stderr
    assert json.loads(result.stdout)["resumed_from_step"] == 3


def test_no_checkpoint_that_loads_stops_instead_of_starting_over(cli_here, run_dir):
    for step in (3, 6):
        model = run_dir / "checkpoints" / f"step-{step}" / "model.safetensors"
        _rewrite(run_dir, step, "model.safetensors", _renamed_key(model.read_bytes()))
    result = _resume(cli_here, run_dir)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "Traceback" not in output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("skylift run: ") and "step-6" in last and "step-3" in last, last
    assert _steps(run_dir) == ["step-3", "step-6"]  # not abandoned, not retrained from step 0


def test_a_checkpoint_without_a_recorded_config_still_resumes(cli_here, run_dir):
    """Checkpoints of an earlier skylift record no config: nothing to compare, they load as before."""
    path = run_dir / "checkpoints" / "step-6" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest.pop("config")["recipe"]["width"] == 32
    path.write_text(json.dumps(manifest))
    result = _resume(cli_here, run_dir, "optim.lr=0.006")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout)["resumed_from_step"] == 6
    assert "records no config" in result.stderr


def test_every_config_field_has_one_rule():
    """The table in skylift.checkpoint.compatibility covers every field, so a new field
    cannot slip through uncompared by accident."""
    for field in schema_fields(RunConfig()):
        assert rule_for(field) is not None, field
    assert all(prefix.split(".")[0] in RunConfig.model_fields for prefix in RULES)


def test_the_recorded_config_has_no_secrets_and_the_resolved_precision():
    config = RunConfig(submit={"envs": {"HF_TOKEN": "hf_abcdefghijklmnop"}}, precision="auto")
    recorded = recorded_config(config, "bf16")
    assert recorded["submit"]["envs"]["HF_TOKEN"] == REDACTED
    assert recorded["precision"] == "bf16"


def _optimizer(name: str, lr: float, weight_decay: float, momentum: float = 0.9):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    config = OptimConfig(name=name, lr=lr, weight_decay=weight_decay, momentum=momentum)
    optimizer = build_optimizer(model, config, torch.device("cpu"))
    scheduler = build_lr_schedule(optimizer, ScheduleConfig(warmup_steps=2, max_steps=20), 20)
    return model, optimizer, scheduler


def test_the_run_s_optimizer_settings_replace_the_loaded_ones():
    """A load puts the saved parameter groups back (lr, weight decay, momentum): the
    changed ones are the run's again, the schedule at the resumed step with the run's base."""
    model, optimizer, scheduler = _optimizer("sgd", 0.1, 0.01, momentum=0.9)
    for _ in range(5):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        scheduler.step()
    saved_lr = optimizer.param_groups[0]["lr"]
    _, resumed, resumed_scheduler = _optimizer("sgd", 0.2, 0.05, momentum=0.5)
    built = OptimizerSettings(resumed, resumed_scheduler)
    resumed.load_state_dict(optimizer.state_dict())
    resumed_scheduler.load_state_dict(scheduler.state_dict())
    assert resumed.param_groups[0]["lr"] == saved_lr and resumed.param_groups[0]["momentum"] == 0.9
    built.put_back(["optim.lr", "optim.weight_decay", "optim.momentum"], resumed, resumed_scheduler)
    assert [group["weight_decay"] for group in resumed.param_groups] == [0.05, 0.0]  # biases stay undecayed
    assert [group["momentum"] for group in resumed.param_groups] == [0.5, 0.5]
    assert resumed.param_groups[0]["lr"] == pytest.approx(2 * saved_lr)
    assert resumed_scheduler.base_lrs == [0.2, 0.2]
    assert resumed_scheduler.get_last_lr()[0] == pytest.approx(2 * saved_lr)
    resumed_scheduler.step()
    optimizer.step()
    scheduler.step()
    assert resumed.param_groups[0]["lr"] == pytest.approx(2 * optimizer.param_groups[0]["lr"])



@pytest.mark.slow
@pytest.mark.multiprocess
def test_two_ranks_decide_a_refusal_and_a_load_failure_together(tmp_path):
    """Rank 0 judges the configs for both (one refusal, raised on every rank alike); a
    checkpoint that loads on rank 0 but not on rank 1 is passed over by both, so neither
    waits in a collective the other left."""
    from tests.gloo_group import spawn_ranks

    root = str(tmp_path / "root")
    spawn_ranks(_two_ranks, 2, "save", root, str(tmp_path))
    spawn_ranks(_two_ranks, 2, "refused", root, str(tmp_path))
    outcomes = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith("SkyliftConfigError") and "optim.name: adamw -> sgd" in outcomes[0], outcomes
    spawn_ranks(_two_ranks, 2, "rank_1_model_differs", root, str(tmp_path))
    outcomes = [(tmp_path / f"rank-{rank}.txt").read_text() for rank in (0, 1)]
    for outcome in outcomes:
        assert outcome.startswith("CheckpointLoadError: cannot resume: no checkpoint"), outcomes
        assert "step-4" in outcome and "step-2" in outcome, outcomes


def _two_ranks(rank: int, world_size: int, port: int, task: str, root: str, results: str) -> None:
    """One rank of a two-process job: ``save`` steps 2 and 4 with AdamW, or resume (with
    SGD: ``refused``; with another model on rank 1: ``rank_1_model_differs``) and write what
    happened to ``results/rank-<R>.txt``."""
    import torch.distributed as dist

    from skylift.checkpoint.session import Checkpointing, TrainingObjects
    from skylift.config.checkpoint import CheckpointConfig
    from skylift.loop.agreement import StepAgreement
    from skylift.loop.distributed import DistributedContext
    from skylift.loop.events import TrainState
    from tests.gloo_group import join

    torch.set_num_threads(1)
    join(rank, world_size, port)
    group = dist.new_group(backend="gloo")
    run_config = RunConfig(optim={"name": "sgd" if task == "refused" else "adamw"}, precision="fp32")
    session = Checkpointing(
        CheckpointConfig(root=root, every_steps=None, every_minutes=None, async_save=False),
        run_dir=Path(results), context=DistributedContext(rank, world_size, rank, torch.device("cpu"), "gloo"),
        agreement=StepAgreement(group, distributed=True), control_group=group, run_config=run_config,
        precision="fp32")
    width = 3 if task == "rank_1_model_differs" and rank == 1 else 2
    model = torch.nn.Linear(3, width)
    optimizer = build_optimizer(model, run_config.optim, torch.device("cpu"))
    state = TrainState(total_steps=10, steps_per_epoch=10, global_batch_size=4)
    try:
        session.open()
        try:
            outcome = f"resumed {session.resume(TrainingObjects(model, optimizer, None, None), state)}"
            if task == "save":
                for step in (2, 4):
                    state.step = step
                    assert session.save(state).committed
        except Exception as error:
            outcome = f"{type(error).__name__}: {error}"
        Path(results, f"rank-{rank}.txt").write_text(outcome)
        session.close()
    finally:
        dist.destroy_process_group()
