"""What a run config asks of the machine, as :class:`~skylift.machine.facts.JobFacts`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from skylift.errors import SkyliftConfigError
from skylift.machine.facts import JobFacts

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig

__all__ = ["job_facts", "sample_bytes"]

_GIB = 1024**3
_LABEL_BYTES = 8  # one int64 class index


def job_facts(
    config: RunConfig, *, config_path: str | None, nproc: int = 1, nnodes: int = 1, memory: bool = True
) -> JobFacts:
    """The job's shape, loader, disk and memory needs (the memory from a meta trace, left
    out without ``memory``: the trace is most of a start-up's cost, and only the checks
    read it).

    Raises:
        SkyliftConfigError: the batch does not divide over the ranks (naming the fields).
    """
    from skylift.doctor.memory import estimate_memory
    from skylift.doctor.system import gather_disks

    world_size = nproc * nnodes
    token_budget = config.data.batching == "token_budget"
    try:
        micro_batch = None if token_budget else config.micro_batch_size(world_size)
    except ValueError as error:
        raise SkyliftConfigError(str(error)) from None
    if config.data.micro_batch_size == "auto":
        micro_batch = 1  # the trials go down to 1: the job fits if one sample does
    rows = micro_batch or max(1, config.data.max_tokens // _longest_sequence(config))
    local = any(disk.purpose == "checkpoint_local" for disk in gather_disks(config))
    return JobFacts(
        source="config",
        config_path=config_path,
        device=config.device,
        precision=config.precision,
        backend=config.distributed.backend,
        nproc=nproc,
        nnodes=nnodes,
        num_workers=config.data.num_workers,
        micro_batch_size=rows,
        sample_bytes=sample_bytes(config),
        streaming=bool(config.data.url),
        cache_bytes=int(config.data.cache_limit_gib * _GIB) if config.data.url else 0,
        checkpoint_local=config.checkpoint.enabled and local,
        checkpoint_keep=config.checkpoint.keep,
        memory=estimate_memory(config, rows, world_size) if memory else None,
    )


def sample_bytes(config: RunConfig) -> int | None:
    """Bytes of one collated training sample; None for streamed data (shape unknown)."""
    from skylift.doctor.memory import sample_shape

    if config.recipe.name == "text_classification":
        # input ids (int64) and attention mask (bool) per token, plus the label
        return _longest_sequence(config) * (8 + 1) + _LABEL_BYTES
    shape = sample_shape(config)
    if shape is None:
        return None
    channels, height, width = shape[1]
    return channels * height * width * 4 + _LABEL_BYTES


def _longest_sequence(config: RunConfig) -> int:
    """Tokens of the recipe's longest sample (``recipe.max_length``, ``recipe.sequence_length``);
    1 for a recipe without either, whose samples' length skylift cannot know."""
    from skylift.recipes import check_recipe_settings

    settings = check_recipe_settings(config)
    return int(getattr(settings, "max_length", None) or getattr(settings, "sequence_length", None) or 1)
