"""``skylift dockerfile``: an image for the user's project that runs ``skylift run``, or
``skylift launch`` on the project's own script (``skylift dockerfile -- python train.py``).

Choices, and why:

* The PyPI torch wheels bundle CUDA, cuDNN and NCCL (the ``nvidia-*`` wheels), so a
  slim Python base is enough; ``--base cuda`` takes NVIDIA's ``runtime`` image of the
  wheel's CUDA instead, for extensions that link the system CUDA libraries.
  (https://nvidia.github.io/container-wiki/toolkit/container-images.html)
* Dependencies install from the project's own files, pinned by its constraints file,
  before the source is copied, so a code change does not reinstall torch.
* skylift is on no package index yet: the image installs the wheel of the skylift that
  wrote the Dockerfile (:mod:`skylift.image.wheel`, written into ``skylift-wheel/`` of the
  build context), before the project's requirements, so a project that lists ``skylift``
  finds it installed. The skylift checkout itself installs from its own source.
* The entry point is exec-form so SIGTERM reaches skylift (preemption saves), and it
  accepts SageMaker's ``docker run IMAGE train``. On SageMaker
  (``/opt/ml/input/config/resourceconfig.json`` exists) checkpoints go to
  ``/opt/ml/checkpoints``, which SageMaker syncs to ``checkpoint_s3_uri``, and the run
  folder to ``/opt/ml/model``, which it uploads at the end
  (https://docs.aws.amazon.com/sagemaker/latest/dg/your-algorithms-training-algo.html).
* A script image runs ``skylift launch -- python train.py ARGS``: the platform's topology,
  SIGTERM forwarded with a grace period, and on SageMaker ``SKYLIFT_CHECKPOINT_ROOT`` and
  ``SKYLIFT_RUN_DIR`` pointing at the same two folders (unless already set). Arguments of
  ``docker run IMAGE ARGS`` are added to the script's.
* The last ``USER`` is not root (hadolint DL3002) and numeric (DL3066), with a uid
  above the 1000 that Ubuntu 24.04 images already give their ``ubuntu`` user.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from skylift.errors import SkyliftConfigError

__all__ = ["CUDA_RUNTIME_RELEASES", "DOCKERIGNORE", "ImageSpec", "image_spec", "render_dockerfile", "write_files"]

# The newest patch release of each CUDA minor in NVIDIA's release table
# (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/index.html); nvidia/cuda tags
# its images by release, e.g. nvidia/cuda:12.8.1-runtime-ubuntu24.04.
CUDA_RUNTIME_RELEASES: dict[str, str] = {
    "12.6": "12.6.3",
    "12.8": "12.8.1",
    "12.9": "12.9.1",
    "13.0": "13.0.2",
    "13.1": "13.1.1",
    "13.2": "13.2.1",
}
_UID = 10001
_CONSTRAINT_FILES = ("requirements/constraints.txt", "constraints.txt", "requirements-constraints.txt")
_REQUIREMENT_FILES = ("requirements.txt", "requirements/base.txt")

DOCKERIGNORE = """\
# Written by `skylift dockerfile`: keep the build context small and secrets out of the image.
.git
.venv
.venv-*
venv
**/__pycache__
**/*.pyc
.pytest_cache
.mypy_cache
.ruff_cache
*.egg-info
build
dist
runs
checkpoints
.env
.env.*
.aws
.ssh
.netrc
Dockerfile
.dockerignore
"""


@dataclass(frozen=True)
class ImageSpec:
    """What the Dockerfile is rendered from (read from the project by :func:`image_spec`)."""

    base: Literal["python", "cuda"] = "python"
    python_version: str = f"{sys.version_info.major}.{sys.version_info.minor}"
    torch_version: str = "2.14.1"
    torch_cuda: str | None = "13.0"
    constraint_file: str | None = None
    requirement_file: str | None = None
    has_pyproject: bool = False
    project_is_skylift: bool = False
    """The project is skylift's own checkout: ``pip install .`` installs it, no wheel needed."""
    skylift_version: str = "0.1.0"
    config_path: str | None = None
    shm_size_gib: int | None = None
    script: tuple[str, ...] | None = None
    """A script project's command in the image (``python train.py ARGS``): the entry point
    runs it under ``skylift launch`` instead of ``skylift run CONFIG``."""

    @property
    def skylift_wheel(self) -> str | None:
        """The skylift wheel's path in the build context; None for skylift's own checkout."""
        if self.project_is_skylift:
            return None
        from skylift.image.wheel import WHEEL_FOLDER, wheel_name

        return f"{WHEEL_FOLDER}/{wheel_name(self.skylift_version)}"

    @property
    def wheel_index(self) -> str | None:
        """The PyTorch index of the local torch's variant (``+cu130``); None for PyPI's default."""
        local = self.torch_version.partition("+")[2]
        return f"https://download.pytorch.org/whl/{local}" if local.startswith("cu") else None


def image_spec(project: Path, *, base: str = "python", config_path: str | None = None,
               script: list[str] | None = None) -> ImageSpec:
    """Read ``project`` (constraints, requirements, pyproject) and the local torch build.

    ``script`` (what follows ``--``: ``python train.py ARGS`` or ``-m pkg.module``) makes
    a script image; ``config_path`` then only sizes ``/dev/shm`` for its loader.

    Raises:
        SkyliftConfigError: an unknown ``base``, a config or script outside the project,
            or a ``--base cuda`` for a torch CUDA release skylift has no image tag for.
    """
    import torch

    from skylift import __version__
    from skylift.launch.launcher import image_script_command

    if base not in ("python", "cuda"):
        raise SkyliftConfigError(f"--base {base!r}: use python or cuda")
    if base == "cuda" and torch.version.cuda not in CUDA_RUNTIME_RELEASES:
        raise SkyliftConfigError(
            f"--base cuda: no nvidia/cuda tag known for torch's CUDA {torch.version.cuda}",
            hint="Use --base python: the torch wheels bundle CUDA.",
        )
    return ImageSpec(
        base=base,  # type: ignore[arg-type]
        torch_version=torch.__version__,
        torch_cuda=torch.version.cuda,
        constraint_file=_first_existing(project, _CONSTRAINT_FILES),
        requirement_file=_first_existing(project, _REQUIREMENT_FILES),
        has_pyproject=(project / "pyproject.toml").is_file(),
        project_is_skylift=_is_skylift(project),
        skylift_version=__version__,
        config_path=_inside(project, config_path) if config_path else None,
        shm_size_gib=_shm_size_gib(config_path),
        script=image_script_command(script, project) if script else None,
    )


def _first_existing(project: Path, names: tuple[str, ...]) -> str | None:
    return next((name for name in names if (project / name).is_file()), None)


def _is_skylift(project: Path) -> bool:
    """The project is skylift's own checkout (its pyproject names the project skylift)."""
    pyproject = project / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8") if pyproject.is_file() else ""
    return re.search(r"""^name\s*=\s*["']skylift["']""", text, re.MULTILINE) is not None


def _inside(project: Path, config_path: str) -> str:
    path = Path(config_path).resolve()
    try:
        return path.relative_to(project.resolve()).as_posix()
    except ValueError:
        raise SkyliftConfigError(
            f"--config {config_path} is outside the project {project}, so the image cannot contain it",
            hint="Copy the config into the project folder first.",
        ) from None


def _shm_size_gib(config_path: str | None) -> int | None:
    """``--shm-size`` the configured loader needs (as the doctor computes it), in GiB."""
    if config_path is None:
        return None
    import math

    from skylift.config.load import load_config
    from skylift.doctor.rules.resources import PREFETCH_FACTOR

    config = load_config(config_path)
    from skylift.doctor.job import sample_bytes

    size, workers = sample_bytes(config), config.data.num_workers
    if size is None or workers in (0, "auto"):
        return None
    batch = config.data.global_batch_size // config.accumulation.steps
    return max(1, math.ceil(2 * PREFETCH_FACTOR * int(workers) * batch * size / 1024**3))


def render_dockerfile(spec: ImageSpec) -> str:
    """The Dockerfile text for ``spec``."""
    lines = _header(spec) + _base(spec) + _environment(spec) + _install(spec) + _entry(spec)
    return "\n".join(lines) + "\n"


def _header(spec: ImageSpec) -> list[str]:
    sized = f"--shm-size={spec.shm_size_gib}g, twice what the configured loader needs"
    shm = sized if spec.shm_size_gib else "--shm-size=8g"
    return [
        "# syntax=docker/dockerfile:1",
        f"# Written by `skylift dockerfile` (skylift {spec.skylift_version}); edit freely.",
        "#   docker build -t my-training .",
        "#   docker run --gpus all --ipc=host my-training",
        f"#   (or {shm}): DataLoader workers pass batches",
        '#   through /dev/shm, and Docker\'s default of 64 MB ends in "Bus error".',
        "#   SageMaker runs `docker run IMAGE train`: the entry point accepts that.",
        f"# torch {spec.torch_version} bundles CUDA {spec.torch_cuda} in its wheels: the host needs only the NVIDIA",
        "# driver (check it with `skylift doctor` there) and the NVIDIA container toolkit.",
    ]


def _base(spec: ImageSpec) -> list[str]:
    if spec.base == "python":
        return [f"FROM python:{spec.python_version}-slim-bookworm", ""]
    release = CUDA_RUNTIME_RELEASES[spec.torch_cuda or ""]
    return [
        f"FROM nvidia/cuda:{release}-runtime-ubuntu24.04",
        'SHELL ["/bin/bash", "-o", "pipefail", "-c"]',
        "# DL3008 (pin apt versions) is ignored: Ubuntu replaces point releases in its archive,",
        "# so pinned versions stop installing; the python3 of 24.04 is what this base is for.",
        "# hadolint ignore=DL3008",
        "RUN apt-get update \\",
        "    && apt-get install -y --no-install-recommends python3 python3-venv \\",
        "    && rm -rf /var/lib/apt/lists/* \\",
        "    && python3 -m venv /opt/venv",
        "ENV PATH=/opt/venv/bin:$PATH",
        "",
    ]


def _environment(spec: ImageSpec) -> list[str]:
    variables = ["PYTHONDONTWRITEBYTECODE=1", "PYTHONUNBUFFERED=1", "PIP_DISABLE_PIP_VERSION_CHECK=1"]
    if spec.wheel_index:
        # the local torch came from PyTorch's index: the image gets the same variant
        variables.append(f"PIP_EXTRA_INDEX_URL={spec.wheel_index}")
    return [
        "ENV " + " \\\n    ".join(variables),
        f"RUN groupadd --gid {_UID} skylift \\",
        f"    && useradd --create-home --uid {_UID} --gid {_UID} --shell /usr/sbin/nologin skylift \\",
        "    && mkdir -p /app /opt/ml/checkpoints /opt/ml/model \\",
        f"    && chown -R {_UID}:{_UID} /app /opt/ml",
        "WORKDIR /app",
        "",
    ]


def _install(spec: ImageSpec) -> list[str]:
    pin = f"-c {spec.constraint_file} " if spec.constraint_file else ""
    lines = ["# Dependencies before the source, so editing code does not reinstall them."]
    if spec.constraint_file:
        lines.append(f"COPY {spec.constraint_file} {spec.constraint_file}")
    # torch is most of the image: its own layer survives changes to the project and to skylift.
    lines.append(f"RUN pip install --no-cache-dir {pin}torch=={spec.torch_version.split('+')[0]}")
    wheel = spec.skylift_wheel
    if wheel:
        lines += [
            "# skylift from the wheel `skylift dockerfile` wrote into the build context (skylift is on",
            "# no package index yet), before the project's requirements, which may list skylift.",
            f"COPY {wheel} {wheel}",
            f"RUN pip install --no-cache-dir {pin}{wheel}",
        ]
    if spec.requirement_file:
        lines.append(f"COPY {spec.requirement_file} {spec.requirement_file}")
        lines.append(f"RUN pip install --no-cache-dir {pin}-r {spec.requirement_file}")
    lines.append(f"COPY --chown={_UID}:{_UID} . .")
    if spec.has_pyproject:
        lines.append(f"RUN pip install --no-cache-dir {pin}.")
    return [*lines, ""]


def _entry(spec: ImageSpec) -> list[str]:
    if spec.script:
        return _script_entry(spec.script)
    config = spec.config_path or "config.yaml"
    script = (
        'if [ "${1:-}" = train ]; then shift; fi; '
        "if [ -f /opt/ml/input/config/resourceconfig.json ]; then "
        'set -- --set checkpoint.root=/opt/ml/checkpoints --set run_dir=/opt/ml/model "$@"; fi; '
        'exec skylift run "$SKYLIFT_CONFIG" --nproc "$SKYLIFT_NPROC" "$@"'
    )
    return [
        f"USER {_UID}:{_UID}",
        f"ENV SKYLIFT_CONFIG={config} \\",
        "    SKYLIFT_NPROC=1",
        "# Exec form: SIGTERM reaches skylift, which saves before the machine goes.",
        _shell_entrypoint(script),
        "CMD []",
    ]


def _script_entry(command: tuple[str, ...]) -> list[str]:
    script = (
        'if [ "${1:-}" = train ]; then shift; fi; '
        "if [ -f /opt/ml/input/config/resourceconfig.json ]; then "
        'export SKYLIFT_CHECKPOINT_ROOT="${SKYLIFT_CHECKPOINT_ROOT:-/opt/ml/checkpoints}" '
        'SKYLIFT_RUN_DIR="${SKYLIFT_RUN_DIR:-/opt/ml/model}"; fi; '
        f'exec skylift launch ${{SKYLIFT_NPROC:+--nproc "$SKYLIFT_NPROC"}} -- {shlex.join(command)} "$@"'
    )
    return [
        f"USER {_UID}:{_UID}",
        "# skylift launch takes the processes per node from the platform (one elsewhere);",
        "# SKYLIFT_NPROC fixes the count. `docker run IMAGE ARGS` adds ARGS to the script's.",
        "# Exec form: SIGTERM reaches skylift, which gives the script its grace period to save.",
        _shell_entrypoint(script),
        "CMD []",
    ]


def _shell_entrypoint(script: str) -> str:
    """``ENTRYPOINT`` running ``script`` with ``sh -c``; the container's arguments are its ``"$@"``."""
    quoted = script.replace("\\", "\\\\").replace('"', '\\"')
    return f'ENTRYPOINT ["/bin/sh", "-c", "{quoted}", "skylift-entrypoint"]'


def write_files(text: str, out: Path, *, force: bool = False) -> list[Path]:
    """Write the Dockerfile to ``out`` and a .dockerignore beside it (kept if present).

    Raises:
        SkyliftConfigError: ``out`` exists and ``force`` is not set.
    """
    if out.exists() and not force:
        raise SkyliftConfigError(f"--out {out} exists", hint="Pass --force to replace it, or choose another --out.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    written = [out]
    ignore = out.parent / ".dockerignore"
    if not ignore.exists():
        ignore.write_text(DOCKERIGNORE)
        written.append(ignore)
    return written
