"""Disk full on a real tmpfs, and credentials that must never leak.

A single-process run here trains in this process (``train_here``): what it writes, keeps and
prints is under test, not its start; the two-process run stays torchrun."""

from __future__ import annotations

import subprocess
import uuid

import pytest
import torch

from skylift.checkpoint.manifest import committed_steps
from skylift.checkpoint.state import capture
from skylift.config import load_config
from skylift.recipes.image_classification import ImageClassification
from skylift.storage import open_store
from tests.checkpoint.runs import lean_train, lean_train_here, records, summary, train_here
from tests.servers import SENTINEL_KEY_ID, SENTINEL_SECRET, SENTINEL_TOKEN


def _checkpoint_bytes(world_size: int) -> int:
    """Bytes one quickstart checkpoint takes, measured with the real capture."""
    config = load_config("examples/quickstart.yaml")
    recipe = ImageClassification(config)
    model = recipe.build_model(recipe.build_datasets())
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(2, 1, 8, 8)).sum().backward()
    optimizer.step()
    files = capture(step=1, rank=0, model=model, optimizer=optimizer, scheduler=None, scaler=None,
                    counters={}).serialize()
    rng_bytes = sum(len(data) for name, data in files.items() if name.startswith("rng-"))
    pages = sum(-(-len(data) // 4096) * 4096 for data in files.values())
    return pages + (world_size - 1) * (rng_bytes + 8192) + 16384  # + manifest, LATEST, lease


@pytest.fixture
def small_disk(tmp_path):
    """A real tmpfs that holds two quickstart checkpoints and a half."""
    def mount(world_size: int):
        size = int(_checkpoint_bytes(world_size) * 2.5) // 4096 * 4096
        mount_point = tmp_path / "small-disk"
        mount_point.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
                                capture_output=True, text=True)
        if result.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root (CAP_SYS_ADMIN): {result.stderr.strip()}")
        mounted.append(mount_point)
        return mount_point

    mounted: list = []
    yield mount
    for mount_point in mounted:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_abandons_the_save_keeps_the_previous_and_continues(small_disk, tmp_path, cli_here):
    root = small_disk(world_size=1)
    run_dir = tmp_path / "run"
    result = lean_train_here(cli_here, run_dir, f"checkpoint.root={root}", "checkpoint.keep=2",
                             "checkpoint.on_failure=continue")
    # Training continues past the failed saves, but the final state is not committed: exit 1.
    assert result.returncode == 1, result.stderr[-3000:]
    assert committed_steps(open_store(str(root))) == [7, 14]
    failed = [record for record in records(run_dir, "checkpoint") if not record["committed"]]
    assert failed and all("no space left" in record["error"].lower() for record in failed)
    assert summary(run_dir)["steps"] == 60
    leftovers = [path.name for path in root.iterdir() if path.name.startswith("step-")]
    assert sorted(leftovers) == ["step-14", "step-7"], "abandoned folders are removed"


@pytest.mark.multiprocess
def test_disk_full_with_exit_policy_stops_every_rank(small_disk, tmp_path):
    root = small_disk(world_size=2)
    run_dir = tmp_path / "run"
    result = lean_train(run_dir, f"checkpoint.root={root}", "checkpoint.keep=2", "checkpoint.on_failure=exit",
                        "checkpoint.async_save=false", nproc=2, timeout_s=240)
    assert result.returncode == 1, result.stderr[-3000:]
    assert committed_steps(open_store(str(root))) == [7, 14]
    assert summary(run_dir)["stopped_early"] == "checkpoint save failed"
    failed_step = next(record["step"] for record in records(run_dir, "checkpoint") if not record["committed"])
    assert failed_step == 21
    # Requested after step 21's exchange; the exchange overlaps one step, so all ranks stop by 23.
    assert failed_step < summary(run_dir)["steps"] <= failed_step + 2


@pytest.mark.slow
def test_sentinel_credentials_never_appear_anywhere(moto_server, s3_bucket, tmp_path, cli_here):
    # train_here, not lean_train_here: the doctor's output and the HTML report are places to leak
    # too. In this process, with the sentinels in its environment for the call: what the run
    # prints and writes is under test, not its start.
    sentinels = [SENTINEL_KEY_ID, SENTINEL_SECRET, SENTINEL_TOKEN,
                 f"hf_sentinel_{uuid.uuid4().hex}", f"wandb_sentinel_{uuid.uuid4().hex}"]
    env = {"HF_TOKEN": sentinels[3], "WANDB_API_KEY": sentinels[4], "SKYLIFT_LOG_LEVEL": "DEBUG",
           "SKYLIFT_S3_ENDPOINT_URL": moto_server.endpoint_url}
    run_dir = tmp_path / "run"
    good = train_here(cli_here, run_dir, f"checkpoint.root=s3://{s3_bucket}/run", "schedule.max_steps=15", env=env)
    assert good.returncode == 0, good.stderr[-2000:]
    broken = train_here(cli_here, tmp_path / "broken", "checkpoint.root=s3://no-such-bucket/run",
                        "schedule.max_steps=15", env=env)
    assert broken.returncode == 1 and "no-such-bucket" in broken.stderr
    texts = [good.stdout, good.stderr, broken.stdout, broken.stderr]
    texts += [path.read_text(errors="replace") for path in tmp_path.rglob("*") if path.is_file()]
    store = open_store(f"s3://{s3_bucket}/run", endpoint_url=moto_server.endpoint_url)
    texts += [store.read_bytes(key).decode("latin-1") for key in store.list()]
    assert len(texts) > 10
    for sentinel in sentinels:
        assert not any(sentinel in text for text in texts), f"a credential leaked: {sentinel[:12]}..."
