"""The ``data`` section: how samples are streamed, split, batched and loaded, for every
recipe (which dataset is a recipe's own setting, ``recipe.dataset``)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from skylift.config.section import Section

__all__ = ["DataConfig"]


class DataConfig(Section):
    batching: Literal["fixed", "token_budget"] = "fixed"
    """How training batches are formed. ``fixed``: ``global_batch_size`` samples per
    step (texts padded to ``recipe.max_length``). ``token_budget`` (``text_classification``,
    ``causal_lm``): each rank's micro-batch holds as many length-sorted texts as fit
    ``max_tokens`` padded tokens, so steps hold varying sample counts and little padding."""

    max_tokens: int = Field(default=4096, ge=8)
    """Padded tokens per micro-batch on each rank with ``batching: token_budget`` (at
    least the recipe's longest sequence, ``recipe.max_length`` or ``recipe.sequence_length``,
    so the longest text fits)."""

    global_batch_size: int = Field(default=64, ge=1)
    """Samples per optimizer step across all ranks and accumulation micro-steps. Must
    divide by ``world_size * accumulation.steps``; the per-rank micro-batch is the
    quotient, so a run gives the same result on any number of processes."""

    micro_batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] | None = None
    """Samples per rank per micro-step. Unset: ``global_batch_size / (world_size x
    accumulation.steps)``. A number: ``accumulation.steps`` follows from it, so the global
    batch stays. ``auto``: the largest that fits this device, found at start by real
    forward/backward trials of the divisors of the per-rank batch (agreed across ranks);
    accumulation rises to keep ``global_batch_size``, so convergence does not change.
    Leave ``accumulation.steps`` at 1 when this is set."""

    micro_batch_memory_gib: float | None = Field(default=None, gt=0)
    """Memory one rank may use with ``micro_batch_size: auto``, GiB: the trials' measured
    peak plus the optimizer state (and EMA copy, DDP buckets) still to come. Unset: the
    GPU's free memory plus what this process already holds; on CPU, this node's
    available RAM shared by its ranks plus this process's resident memory."""

    eval_batch_size: int = Field(default=256, ge=1)
    """Samples per rank per evaluation batch."""

    val_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    """Share of the dataset held out (stratified, seeded) for validation."""

    num_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = 0
    """DataLoader worker processes per rank (0 to 64). 0 loads in the training process,
    which is fastest for small in-memory datasets. ``auto`` measures the loader with
    0, 1, 2, 4, ... workers (up to the usable CPUs) for about
    ``autotune_s_per_setting`` each at start and takes the fastest."""

    autotune_s_per_setting: float = Field(default=1.0, gt=0.0, le=60.0)
    """Seconds each setting is timed for by ``num_workers: auto``."""

    pin_memory: bool = True
    """Pin host batches for faster, asynchronous copies to a GPU (ignored on CPU)."""

    url: str | None = None
    """Stream training data from a sharded dataset written by ``skylift shard`` (a local
    folder or ``s3://``, ``oss://``, ``cos://`` URL holding ``index.json``) instead of
    loading the recipe's ``recipe.dataset`` into memory."""

    val_url: str | None = None
    """Sharded validation set to stream (every sample scored once); ``null``: none."""

    endpoint_url: str | None = None
    """S3 API endpoint for ``url``/``val_url`` on S3-compatible stores (else from the
    environment, as for checkpoints)."""

    cache_dir: str = "~/.cache/skylift/shards"
    """Node-wide cache of downloaded shards, shared by all ranks and workers."""

    cache_limit_gib: float = Field(default=20.0, gt=0.0)
    """Bound of the shard cache; least recently used shards are evicted past it."""

    prefetch_shards: int = Field(default=4, ge=0, le=64)
    """Shards each data worker downloads ahead of the one it reads."""

    shuffle_block_shards: int = Field(default=4, ge=1, le=1024)
    """Shards whose samples are shuffled together each epoch (more: better mixing,
    more memory)."""

    @model_validator(mode="after")
    def _token_budget_in_memory(self) -> DataConfig:
        if self.batching == "token_budget" and self.url:
            raise ValueError("data.batching: token_budget works on in-memory datasets, not data.url; use fixed")
        return self
