"""docs/chat-lora-from-a-bucket.md, run as written: a Parquet chat dataset in a bucket (moto's
S3 on 127.0.0.1), ``skylift run`` of the page's preset until an AWS spot notice from a
loopback metadata server stops it, the same command again to the end, ``skylift export``
of the adapter, and the page's Python loading it with PEFT.

Each ``console`` block's command runs in a fresh project folder; every line the page
shows (``...`` stands for lines left out) is in the real output, in order, with each
number read as any number: step counts, seconds and losses are a run's own (the page's
figures carry their date and version). The Python block runs as shown, and the model it
loads gives the trained run's logits, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft", reason="needs the llm extra (peft)")

from safetensors.torch import load_file

from skylift.storage import open_store
from tests.cloud.metadata_server import MetadataServer
from tests.data.test_table_sources import parquet_bytes
from tests.process_family import ProcessFamily

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "chat-lora-from-a-bucket.md"
PRESET = "examples/sft-lora-chat-s3.yaml"
BUCKET = "my-training-bucket"
FILES, ROWS_PER_GROUP = 3, 100
NOTICE_AFTER_STEP = 40
_CONSOLE = re.compile(r"```console\n(.*?)```", re.DOTALL)
_PYTHON = re.compile(r"```python\n(.*?)```", re.DOTALL)
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def steps() -> list[tuple[str, list[str]]]:
    """(command, the lines the page shows it printing), in page order."""
    found = []
    for block in _CONSOLE.findall(PAGE.read_text(encoding="utf-8")):
        command, _, output = block.partition("\n")
        assert command.startswith("$ "), command
        found.append((command[2:], output.splitlines()))
    return found


def _shape(line: str) -> str:
    """A line with each number read as any number and each run of spaces as one (a
    table's column widths follow its longest cell)."""
    return " ".join(_NUMBER.sub("#", line).split())


def assert_shows(shown: list[str], printed: str) -> None:
    """Every shown line but ``...`` is a printed line, numbers aside, in the page's order."""
    lines = [_shape(line) for line in printed.splitlines()]
    position = 0
    for line in shown:
        if line.strip() == "...":
            continue
        wanted = _shape(line)
        try:
            position = lines.index(wanted, position) + 1
        except ValueError:
            raise AssertionError(f"the page shows {line!r}, which the run did not print:\n{printed[-4000:]}") from None


def test_the_page_runs_the_preset_twice_then_exports():
    commands = [command for command, _ in steps()]
    assert commands == [f"skylift run {PRESET}", f"skylift run {PRESET}",
                        "skylift export runs/sft-lora-chat-s3 --to hf runs/chat-adapter"]  # fmt: skip


@pytest.fixture
def project(tmp_path, moto_server):
    """A project folder holding the preset, and the bucket holding the chats as Parquet."""
    moto_server.reset()
    moto_server.create_bucket(BUCKET)
    store = open_store(f"s3://{BUCKET}/chats", endpoint_url=moto_server.endpoint_url)
    rows = [json.loads(line) for line in (ROOT / "examples/data/tiny-chat.jsonl").read_text().splitlines()]
    per_file = len(rows) // FILES
    for number in range(FILES):
        chunk = rows[number * per_file : (number + 1) * per_file]
        store.write_bytes(f"train-{number:05d}-of-{FILES:05d}.parquet", parquet_bytes(chunk, ROWS_PER_GROUP))
    folder = tmp_path / "project"
    (folder / "examples").mkdir(parents=True)
    shutil.copy(ROOT / PRESET, folder / PRESET)
    return folder


def _environment(moto_server, metadata_url: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items()
           if not key.startswith("SKYLIFT_") or key.startswith("SKYLIFT_NETGUARD_")}  # fmt: skip
    # boto3's own endpoint variable: the page's commands stay as written.
    env.update(AWS_ENDPOINT_URL_S3=moto_server.endpoint_url, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               SKYLIFT_METADATA_ENDPOINT=metadata_url, SKYLIFT_CLOUD="aws",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))  # fmt: skip
    return env


def _latest_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps_seen = [json.loads(line).get("step", 0) for line in path.read_text().splitlines() if '"train"' in line]
    return max(steps_seen, default=0)


def _skylift(command: str, project: Path, env: dict[str, str], server: MetadataServer | None = None):
    """Run the page's ``command``; with ``server``, arm an AWS notice once the run passes
    :data:`NOTICE_AFTER_STEP`."""
    argv = [sys.executable, "-m", "skylift", *shlex.split(command)[1:]]
    with (project / "stderr").open("w") as stderr, (project / "stdout").open("w") as stdout:
        family = ProcessFamily(subprocess.Popen(argv, cwd=project, env=env, stdout=stdout, stderr=stderr,
                                                stdin=subprocess.DEVNULL, start_new_session=True))  # fmt: skip
        try:
            deadline = time.monotonic() + 600
            while server is not None and _latest_step(project / "runs/sft-lora-chat-s3") < NOTICE_AFTER_STEP:
                if family.popen.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError((project / "stderr").read_text()[-3000:])
                family.remember_family(every_s=0.5)
                time.sleep(0.02)
            if server is not None:
                server.arm("aws", deadline_in_s=120)
            code = family.popen.wait(600)
        finally:
            family.kill()
    # The log (stderr) as it streams, then the summary (stdout) the run ends with: a terminal's order.
    return code, (project / "stderr").read_text() + (project / "stdout").read_text()


@pytest.mark.slow
def test_every_command_prints_what_the_page_shows(project, moto_server, tmp_path):
    (notice_run, notice_shown), (rerun, rerun_shown), (export, export_shown) = steps()
    with MetadataServer() as server:
        code, printed = _skylift(notice_run, project, _environment(moto_server, server.url), server)
    (tmp_path / "first.log").write_text(printed)
    assert code == 143, printed[-3000:]
    assert_shows(notice_shown, printed)
    with MetadataServer() as server:  # the rerun's instance: a new one, no notice on it
        env = _environment(moto_server, server.url)
        code, printed = _skylift(rerun, project, env)
    (tmp_path / "second.log").write_text(printed)
    assert code == 0, printed[-3000:]
    assert_shows(rerun_shown, printed)
    code, printed = _skylift(export, project, env)
    (tmp_path / "export.log").write_text(printed)
    assert code == 0, printed[-3000:]
    assert_shows(export_shown, printed)

    [python] = _PYTHON.findall(PAGE.read_text(encoding="utf-8"))
    namespace: dict = {}
    cwd = os.getcwd()
    try:
        os.chdir(project)
        exec(compile(python, str(PAGE), "exec"), namespace)  # the page's code, as a reader runs it
    finally:
        os.chdir(cwd)
    # The adapter folder loaded with PEFT gives the trained model's logits: the run's final
    # weights (adapters, head and embeddings) on the same base, built again.
    from skylift.config import load_config
    from skylift.recipes.causal_lm import CausalLM

    recipe = CausalLM(load_config(str(project / PRESET), [f"run_dir={project / 'runs/sft-lora-chat-s3'}"]))
    trained = recipe.build_model()
    trained.load_state_dict(load_file(project / "runs/sft-lora-chat-s3/model.safetensors"))
    tokens = namespace["inputs"]["input_ids"]
    with torch.no_grad():
        assert torch.equal(namespace["model"](input_ids=tokens).logits, trained.eval()(input_ids=tokens).logits)
