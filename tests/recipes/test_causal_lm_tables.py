"""causal_lm on table sources: a Parquet chat dataset in moto's S3 on 127.0.0.1, read a
row group at a time, trained through the real CLI; a SIGKILL mid-epoch and the rerun
reproduce the uninterrupted run exactly; the settings a table source cannot run with."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from skylift.config import load_config
from skylift.data.jsonl_text import IGNORE_INDEX
from skylift.data.loaders import build_loaders
from skylift.errors import SkyliftConfigError
from skylift.loop.distributed import DistributedContext
from skylift.recipes import check_recipe_settings
from skylift.recipes.causal_lm import CausalLM
from skylift.recipes.tiny_lm import tiny_chats
from skylift.storage import open_store
from tests.checkpoint.runs import assert_same_run, losses_by_step, records, state_kept, summary
from tests.data.test_table_sources import parquet_bytes
from tests.recipes.tiny_lm import PRESET, QUIET, run_args

FILES, ROWS_PER_FILE, ROWS_PER_GROUP, GLOBAL_BATCH = 3, 32, 8, 8
STEPS_PER_EPOCH = (FILES * ROWS_PER_FILE - ROWS_PER_GROUP) // GLOBAL_BATCH  # one row group held out: 11
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
EXACT = ("recipe.packing=false", "recipe.sequence_length=64", f"data.global_batch_size={GLOBAL_BATCH}",
         "data.shuffle_block_shards=2", "data.prefetch_shards=1", "schedule.epochs=2", "schedule.warmup_steps=0",
         "deterministic=true", "precision=fp32", "monitor.log_every_steps=1", "checkpoint.every_minutes=null",
         "checkpoint.save_at_end=false", "checkpoint.async_save=false")  # fmt: skip


@pytest.fixture
def s3_chats(moto_server, s3_bucket) -> tuple[str, str]:
    """(the URL of a Parquet chat dataset of 3 files in row groups of 8, the endpoint)."""
    store = open_store(f"s3://{s3_bucket}/chats", endpoint_url=moto_server.endpoint_url)
    rows = tiny_chats(FILES * ROWS_PER_FILE)
    for number in range(FILES):
        chunk = rows[number * ROWS_PER_FILE : (number + 1) * ROWS_PER_FILE]
        store.write_bytes(f"data/train-{number:05d}-of-{FILES:05d}.parquet", parquet_bytes(chunk, ROWS_PER_GROUP))
    return f"s3://{s3_bucket}/chats/data/train-*.parquet", moto_server.endpoint_url


def _arguments(run_dir, url: str, endpoint: str, *overrides: str) -> list[str]:
    sets = [f"recipe.train_path={url}", f"data.endpoint_url={endpoint}", *EXACT, *overrides]
    return run_args(run_dir, *sets)


def test_the_recipe_streams_a_local_parquet_folder_as_padded_chat_batches(tmp_path):
    folder = tmp_path / "chats"
    store = open_store(str(folder))
    rows = tiny_chats(FILES * ROWS_PER_FILE)
    for number in range(FILES):
        store.write_bytes(f"part-{number}.parquet", parquet_bytes(rows[number * ROWS_PER_FILE:][:ROWS_PER_FILE],
                                                                   ROWS_PER_GROUP))  # fmt: skip
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", *QUIET, f"recipe.train_path={folder}", *EXACT])
    recipe = CausalLM(config)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    loaders = build_loaders(config, recipe, context, pin_memory=False)
    assert loaders.order is loaders.data.train and loaders.order.steps_per_epoch == STEPS_PER_EPOCH
    input_ids, attention_mask, labels = next(iter(loaders.train))
    assert input_ids.shape[0] == GLOBAL_BATCH and input_ids.shape == labels.shape == attention_mask.shape
    assert (labels != IGNORE_INDEX).any() and (labels[attention_mask == 0] == IGNORE_INDEX).all()
    held_out = [batch[0].shape[0] for batch in loaders.val]
    assert held_out == [ROWS_PER_GROUP]  # one row group of 12, scored once


@pytest.mark.slow
def test_a_run_trains_on_a_parquet_chat_dataset_in_s3(cli_here, s3_chats, tmp_path):
    url, endpoint = s3_chats
    run_dir = tmp_path / "run"
    with state_kept():
        result = cli_here(*_arguments(run_dir, url, endpoint, "schedule.epochs=1", "checkpoint.enabled=false",
                                      "checkpoint.save_final_model=false"), env=ONE_THREAD)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"{url} (parquet: 96 rows in 12 units of 3 files, columns ['messages']), 88 rows in 11 units read on demand" in result.stderr
    assert summary(run_dir)["steps"] == STEPS_PER_EPOCH
    assert summary(run_dir)["samples_seen"] == STEPS_PER_EPOCH * GLOBAL_BATCH
    losses = losses_by_step(run_dir)
    assert losses[STEPS_PER_EPOCH] < losses[1]
    assert records(run_dir, "eval")[-1]["loss"] > 0  # the held-out row group, scored


@pytest.mark.slow
def test_kill_mid_epoch_and_rerun_equals_the_uninterrupted_run(cli, cli_here, s3_chats, tmp_path):
    url, endpoint = s3_chats
    # A save in the second epoch, a SIGKILL two steps later: the rerun starts its stream
    # mid-epoch; every row of the epoch must be trained once, in the same steps.
    overrides = (f"checkpoint.every_steps={STEPS_PER_EPOCH + 2}",)
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    with state_kept():
        uninterrupted = cli_here(*_arguments(reference, url, endpoint, *overrides), env=ONE_THREAD)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    killed = cli(*_arguments(run_dir, url, endpoint, *overrides),
                 env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": f"step_end:step={STEPS_PER_EPOCH + 4}"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    with state_kept():
        resumed = cli_here(*_arguments(run_dir, url, endpoint, *overrides), env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == STEPS_PER_EPOCH + 2
    assert summary(run_dir)["steps"] == summary(reference)["steps"] == 2 * STEPS_PER_EPOCH
    assert summary(run_dir)["samples_seen"] == summary(reference)["samples_seen"] == 2 * STEPS_PER_EPOCH * GLOBAL_BATCH
    assert_same_run(run_dir, reference)


@pytest.mark.parametrize(("overrides", "message"), [
    ((), "recipe.packing: recipe.train_path .* is read a row group at a time"),
    (("recipe.packing=false", "data.batching=token_budget"), "data.batching: token_budget sorts every document"),
])  # fmt: skip
def test_settings_a_table_source_cannot_run_with_are_named(tmp_path, overrides, message):
    config = load_config(PRESET, [f"run_dir={tmp_path / 'run'}", *QUIET, "recipe.train_path=s3://bucket/chats",
                                  *overrides])  # fmt: skip
    with pytest.raises(SkyliftConfigError, match=message):
        check_recipe_settings(config)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_two_process_run_killed_mid_epoch_resumes_on_one(cli, cli_here, s3_chats, tmp_path):
    url, endpoint = s3_chats
    overrides = (f"checkpoint.every_steps={STEPS_PER_EPOCH + 2}",)
    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    with state_kept():
        uninterrupted = cli_here(*_arguments(reference, url, endpoint, *overrides), env=ONE_THREAD)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    killed = cli(*_arguments(run_dir, url, endpoint, *overrides), "--nproc", "2",
                 env={**ONE_THREAD, "SKYLIFT_FAULT_INJECTION": f"step_end:step={STEPS_PER_EPOCH + 4}"})
    assert killed.returncode != 0 and not (run_dir / "summary.json").exists(), killed.stderr[-2000:]
    with state_kept():
        resumed = cli_here(*_arguments(run_dir, url, endpoint, *overrides), env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == STEPS_PER_EPOCH + 2
    assert summary(run_dir)["samples_seen"] == summary(reference)["samples_seen"] == 2 * STEPS_PER_EPOCH * GLOBAL_BATCH
    # The same rows in the same steps: the losses agree with the one-process run's up to the
    # rounding of two ranks' gradients averaged instead of one batch's.
    got, want = losses_by_step(run_dir), losses_by_step(reference)
    assert got.keys() == want.keys()
    assert all(got[step] == pytest.approx(want[step], rel=1e-4) for step in want), (got, want)


# -- preference pairs from a table (recipe.objective: dpo) -----------------------------------------------------

DPO_PRESET = "examples/dpo-lora-cpu.yaml"
PAIR_FILES, PAIRS_PER_FILE, PAIRS_PER_GROUP, PAIR_BATCH = 2, 32, 8, 8
PAIR_STEPS_PER_EPOCH = (PAIR_FILES * PAIRS_PER_FILE - PAIRS_PER_GROUP) // PAIR_BATCH  # one row group held out: 7
DPO_EXACT = (f"data.global_batch_size={PAIR_BATCH}", "data.shuffle_block_shards=2", "data.prefetch_shards=1",
             "schedule.epochs=2", "schedule.warmup_steps=0", "deterministic=true", "precision=fp32",
             "monitor.log_every_steps=1", "checkpoint.every_minutes=null", "checkpoint.save_at_end=false",
             "checkpoint.async_save=false", "recipe.lora.dropout=0.1")  # fmt: skip


def _write_pairs(store) -> None:
    from skylift.recipes.tiny_lm import tiny_preferences

    rows = tiny_preferences(PAIR_FILES * PAIRS_PER_FILE, seed=3)
    for number in range(PAIR_FILES):
        store.write_bytes(f"pairs-{number}.parquet",
                          parquet_bytes(rows[number * PAIRS_PER_FILE:][:PAIRS_PER_FILE], PAIRS_PER_GROUP))


def test_preference_pairs_stream_from_parquet_as_whole_pairs(tmp_path):
    folder = tmp_path / "pairs"
    _write_pairs(open_store(str(folder)))
    config = load_config(DPO_PRESET, [f"run_dir={tmp_path / 'run'}", *QUIET, f"recipe.train_path={folder}",
                                      "recipe.val_path=null", *DPO_EXACT])  # fmt: skip
    recipe = CausalLM(config)
    context = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend=None)
    loaders = build_loaders(config, recipe, context, pin_memory=False)
    assert loaders.order.steps_per_epoch == PAIR_STEPS_PER_EPOCH
    input_ids, attention_mask, labels = next(iter(loaders.train))
    assert input_ids.shape[:2] == (PAIR_BATCH, 2) and input_ids.shape == labels.shape == attention_mask.shape
    # Each pair: the same prompt on both sides (unlabelled), then two different completions.
    for chosen, rejected in labels:
        assert (chosen != IGNORE_INDEX).any() and (rejected != IGNORE_INDEX).any()
    assert int(recipe.loss_count((input_ids, attention_mask, labels))) == PAIR_BATCH


def test_a_table_without_preference_columns_under_dpo_names_them(tmp_path):
    folder = tmp_path / "chats"
    open_store(str(folder)).write_bytes("part-0.parquet", parquet_bytes(tiny_chats(16), 8))
    config = load_config(DPO_PRESET, [f"run_dir={tmp_path / 'run'}", *QUIET, f"recipe.train_path={folder}",
                                      "recipe.val_path=null"])  # fmt: skip
    with pytest.raises(SkyliftConfigError, match=r"has the columns \['messages'\]; recipe.objective: dpo needs"):
        CausalLM(config).build_datasets()


@pytest.mark.slow
def test_dpo_from_parquet_in_s3_killed_mid_epoch_equals_the_uninterrupted_run(cli, cli_here, moto_server, s3_bucket,
                                                                               tmp_path):  # fmt: skip
    _write_pairs(open_store(f"s3://{s3_bucket}/pairs", endpoint_url=moto_server.endpoint_url))

    def arguments(run_dir):
        sets = [f"recipe.train_path=s3://{s3_bucket}/pairs/pairs-*.parquet", "recipe.val_path=null",
                f"data.endpoint_url={moto_server.endpoint_url}", *DPO_EXACT,
                f"checkpoint.every_steps={PAIR_STEPS_PER_EPOCH + 2}"]  # fmt: skip
        args = ["run", DPO_PRESET, "--json", "--no-doctor", "--set", f"run_dir={run_dir}"]
        for override in (*QUIET, *sets):
            args += ["--set", override]
        return args

    reference, run_dir = tmp_path / "reference", tmp_path / "run"
    with state_kept():
        uninterrupted = cli_here(*arguments(reference), env=ONE_THREAD)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    killed = cli(*arguments(run_dir), env={**ONE_THREAD,
                                           "SKYLIFT_FAULT_INJECTION": f"step_end:step={PAIR_STEPS_PER_EPOCH + 4}"})
    assert killed.returncode == -9, killed.stderr[-2000:]
    with state_kept():
        resumed = cli_here(*arguments(run_dir), env=ONE_THREAD)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert summary(run_dir)["resumed_from_step"] == PAIR_STEPS_PER_EPOCH + 2
    assert summary(run_dir)["samples_seen"] == summary(reference)["samples_seen"] == 2 * PAIR_STEPS_PER_EPOCH * PAIR_BATCH
    assert_same_run(run_dir, reference)
    assert records(run_dir, "train")[-1]["rewards/margins"] == records(reference, "train")[-1]["rewards/margins"]
