"""Everything a submit request lacks, found at once, each with its fix.

A new user's first ``skylift submit`` lacks several things (an image, an object-store
checkpoint root, the platform's own fields); naming them one per attempt turns that
into a maze. The common checks here and each platform module's ``problems()`` see the
whole request, and :func:`require` raises one error listing every problem with the
arguments that fix it, then the one command that would pass (``<...>``: a value only
the user knows). No value of the request is echoed beyond the field at fault, so no
credential reaches the message.
"""

from __future__ import annotations

import itertools
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from skylift.errors import SkyliftConfigError
from skylift.submit.base import platform_info, platform_module

if TYPE_CHECKING:
    from skylift.config.submit import SubmitConfig

__all__ = ["Problem", "common_problems", "parse_store_url", "request_problems", "require", "store_problem"]


@dataclass(frozen=True)
class Problem:
    """One missing or wrong field of a submit request."""

    field: str
    """The config field or flag at fault, e.g. ``submit.sagemaker.role_arn``."""
    message: str
    """What is missing or wrong, and why the platform needs it."""
    fix: tuple[str, ...]
    """Command-line arguments that fix it (``<...>``: a value only the user knows)."""
    drop: tuple[str, ...] = ()
    """What the fix replaces, taken out of the command that would pass: a flag and its value
    (``--region``), or one ``FLAG KEY=...`` (``--input train``, ``--set submit.envs.HF_TOKEN``)."""

    def line(self) -> str:
        # No fix on the command line (the message says what to do instead): no empty "fix:".
        fix = f"; fix: {' '.join(self.fix)}" if self.fix else ""
        return f"{self.field}: {self.message}{fix}"


def require(problems: Sequence[Problem], command: Sequence[str] | None = None) -> None:
    """Raise one error listing ``problems`` (nothing when empty); with the ``command``
    that was run, the hint is that command with every fix added."""
    if not problems:
        return
    if command is None:
        hint = "Add the fixes above, then submit again."
    else:
        fixes = [part for problem in problems for part in problem.fix]
        # A script job's command ends with `-- SCRIPT ARGS`: the fixes are submit's, before it.
        split = list(command).index("--") if "--" in command else len(command)
        own, script = command[:split], command[split:]
        drops = [flag for problem in problems for flag in problem.drop]
        kept = _without(own, [flag for flag in drops if " " not in flag],
                        {*_set_keys(fixes), *(flag.replace(" ", "=", 1) for flag in drops if " " in flag)})
        # The user's own values quoted as a shell needs them; the fixes' <placeholders> left bare.
        hint = "With the fixes above, this would pass:\n  " + " ".join(
            [*map(shlex.quote, kept), *fixes, *map(shlex.quote, script)])
    raise SkyliftConfigError([problem.line() for problem in problems], hint=hint)


def _set_keys(arguments: Sequence[str]) -> set[str]:
    """``--set KEY=...`` and ``--input NAME=...`` of ``arguments`` as ``--set=KEY``, ``--input=NAME``."""
    return {f"{flag}={value.partition('=')[0]}" for flag, value in itertools.pairwise(arguments)
            if flag in ("--set", "--input")}


def _without(command: Sequence[str], flags: Sequence[str], set_keys: set[str]) -> list[str]:
    """``command`` less each ``FLAG VALUE`` of ``flags`` and each ``FLAG KEY=...`` whose
    ``FLAG=KEY`` is in ``set_keys``: the fixes replace them, and a wrong value left beside
    its fix would read as part of the command that passes."""
    kept: list[str] = []
    skip = False
    for index, part in enumerate(command):
        if skip:
            skip = False
            continue
        following = command[index + 1] if index + 1 < len(command) else ""
        if part in flags or f"{part}={following.partition('=')[0]}" in set_keys:
            skip = True
            continue
        kept.append(part)
    return kept


def parse_store_url(url: str) -> tuple[str, str, str]:
    """``scheme://bucket/key`` -> (scheme, bucket, key without slashes at the ends)."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key.strip("/")


def store_problem(url: str | None, schemes: Sequence[str], field_name: str, platform: str) -> Problem | None:
    """A problem when ``url`` is not on one of ``schemes`` (the platform's object store)."""
    if url is None:
        return None
    scheme, bucket, _ = parse_store_url(url)
    if scheme in schemes and bucket:
        return None
    wanted = " or ".join(f"{item}://BUCKET/PREFIX" for item in schemes)
    copy = " (copy the data there)" if field_name.startswith("data.") else ""
    return Problem(field_name, f"is {url!r}; {platform} reads it from its own object store: {wanted}{copy}",
                   ("--set", f"{field_name}={schemes[0]}://<bucket>/<prefix>"))


def common_problems(image: str | None, *, checkpoint_enabled: bool, checkpoint_root: str | None,
                    data_urls: Mapping[str, str | None], stores: Sequence[str] | None = None,
                    platform: str = "the platform") -> list[Problem]:
    """What every platform needs: an image and a checkpoint root on an object store
    (``stores``: the schemes the platform reads; ``None``: any object store)."""
    found: list[Problem | None] = []
    if not image:
        found.append(Problem("--image (submit.image)", "no container image; build one with: skylift dockerfile "
                             "--config CONFIG (a script: skylift dockerfile -- python SCRIPT), then push it",
                             ("--image", "<your-image>")))
    found.append(_checkpoint_problem(checkpoint_enabled, checkpoint_root, stores, platform))
    for field_name, url in data_urls.items():
        found.append(store_problem(url, stores, field_name, platform) if stores else None)
    return [problem for problem in found if problem is not None]


def _checkpoint_problem(enabled: bool, root: str | None, stores: Sequence[str] | None, platform: str) -> Problem | None:
    local = not root or "://" not in root or root.startswith("file://")
    if enabled and not local:
        return store_problem(root, stores, "checkpoint.root", platform) if stores else None
    fix = ("--set", f"checkpoint.root={stores[0] if stores else 's3'}://<bucket>/<prefix>")
    now = f"is {root!r}" if root else "is not set"
    return Problem("checkpoint.root", f"{now}{'' if enabled else ' (checkpoint.enabled: false)'}: a job on rented "
                   "machines must checkpoint to an object store, or a reclaimed job cannot resume",
                   fix if enabled else ("--set", "checkpoint.enabled=true", *fix))


def request_problems(platform: str, options: SubmitConfig, *, checkpoint_enabled: bool = True,
                     checkpoint_root: str | None, data_urls: Mapping[str, str | None]) -> list[Problem]:
    """Every problem of a request to ``platform``: the common ones, then the platform's own."""
    module = platform_module(platform)
    stores = getattr(module, "OBJECT_STORES", None)
    return [*common_problems(options.image, checkpoint_enabled=checkpoint_enabled, checkpoint_root=checkpoint_root,
                             data_urls=data_urls, stores=stores, platform=platform_info(platform).title),
            *module.problems(options, checkpoint_root)]
