"""Real gloo processes that train a tiny model under FSDP2 ``fully_shard`` and checkpoint
it through :class:`~skylift.checkpoint.session.Checkpointing`, wired as the Runtime wires
it (``open``, ``resume(TrainingObjects, TrainState)``, ``save``, ``finish``, ``close``).

Each rank draws its batches from its own global RNG (seeded by rank), so an exact resume
needs the RNG streams, the model, the optimizer and the LR schedule back bit for bit.
Results come back as files: the gathered full state at each save (safetensors) and the
losses (JSON), written by rank 0.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from tests.gloo_group import join, spawn_ranks

WIDTH = 12
"""Layer width: small, and not a multiple of 2 in its 5-wide input, so shards are uneven."""


def spawn(task: str, world_size: int, **kwargs: Any) -> None:
    """Run ``task`` (a function of this module) on ``world_size`` real processes over gloo.

    Raises:
        torch.multiprocessing.ProcessExitedException: a rank died (the others are stopped).
    """
    spawn_ranks(_worker, world_size, task, kwargs)


def build(world_size: int | None, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """Model, AdamW and LR schedule; ``fully_shard`` per block then the root when
    ``world_size`` is given (a process group exists), a plain model otherwise."""
    torch.manual_seed(seed)
    # No BatchNorm: FSDP2 leaves buffers unsynchronised, so its statistics differ by rank
    # and a checkpoint (like the gathered full state) keeps rank 0's.
    model = nn.Sequential(nn.Linear(5, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH),
                          nn.Linear(WIDTH, 3))
    if world_size is not None:
        from torch.distributed.fsdp import fully_shard

        for block in (model[0], model[2], model[4]):
            fully_shard(block)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    return model, optimizer, scheduler


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The unsharded model and optimizer state as flat CPU tensors (on rank 0; collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    flat = {f"model/{name}": value.clone() for name, value in model_state.items()}
    for fqn, entries in optimizer_state.get("state", {}).items():  # empty off rank 0
        flat.update({f"optimizer/{fqn}/{name}": value.clone() for name, value in entries.items()})
    return flat


def checkpointing(root: Path, world_size: int, rank: int, *, resume: str = "auto", control_group: Any = None):
    from skylift.checkpoint.session import Checkpointing
    from skylift.config.schema import CheckpointConfig
    from skylift.loop.agreement import StepAgreement
    from skylift.loop.distributed import DistributedContext

    config = CheckpointConfig(root=str(root), every_steps=None, every_minutes=None, keep=3, resume=resume)
    context = DistributedContext(rank, world_size, rank, torch.device("cpu"), "gloo" if world_size > 1 else None)
    agreement = StepAgreement(control_group, distributed=world_size > 1)
    return Checkpointing(config, run_dir=root.parent, context=context, agreement=agreement,
                         control_group=control_group)


def train(rank: int, world_size: int, *, root: str, results: str, steps: int, save_at: list[int],
          resume: str = "auto", fault: str | None = None) -> None:
    """Train to ``steps`` from wherever ``root`` resumes, saving at ``save_at``; rank 0
    writes ``full-step<N>.safetensors`` (the state at each save),
    ``full-resumed-step<N>.safetensors``, ``full-final.safetensors``, ``losses.json`` and
    ``saves.json`` (the ``checkpoint`` records) under ``results``."""
    from skylift.checkpoint.session import TrainingObjects
    from skylift.loop.events import TrainState

    if fault:  # a named fault point (skylift.checkpoint.faults), e.g. a SIGKILL before the commit
        os.environ["SKYLIFT_FAULT_INJECTION"] = fault
    out = Path(results)
    group = dist.new_group(backend="gloo") if world_size > 1 else None
    session = checkpointing(Path(root), world_size, rank, resume=resume, control_group=group)
    model, optimizer, scheduler = build(world_size)
    state = TrainState(total_steps=steps, steps_per_epoch=steps, global_batch_size=8 * world_size)
    session.open()
    torch.manual_seed(1000 + rank)  # this rank's batches: restored from the checkpoint on resume
    resumed = session.resume(TrainingObjects(model, optimizer, scheduler, None), state)
    if resumed is not None:
        _write(out / f"full-resumed-step{resumed}.safetensors", full_state(model, optimizer), rank)
    losses = {}
    for step in range(state.step + 1, steps + 1):
        loss = model(torch.randn(8, 5)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        state.step, state.samples_seen = step, state.samples_seen + 8 * world_size
        losses[step] = _mean_over_ranks(loss.detach(), world_size)
        if step in save_at:
            session.save(state)
            _write(out / f"full-step{step}.safetensors", full_state(model, optimizer), rank)
    session.manager.wait()
    _write(out / "full-final.safetensors", full_state(model, optimizer), rank)
    records = session.finished_saves()
    session.close()
    if rank == 0:
        (out / "losses.json").write_text(json.dumps(losses))
        (out / "saves.json").write_text(json.dumps(records))


def resume_replicated(rank: int, world_size: int, *, root: str, results: str) -> None:
    """Resume a replicated checkpoint into the sharded model; write the error it raises."""
    from skylift.checkpoint.session import TrainingObjects
    from skylift.errors import SkyliftConfigError
    from skylift.loop.events import TrainState

    session = checkpointing(Path(root), world_size, rank)
    model, optimizer, scheduler = build(world_size)
    state = TrainState(total_steps=6, steps_per_epoch=6, global_batch_size=8 * world_size)
    session.open()
    try:
        session.resume(TrainingObjects(model, optimizer, scheduler, None), state)
    except SkyliftConfigError as refusal:
        Path(results).write_text(str(refusal))
    finally:
        session.close()


def _mean_over_ranks(loss: torch.Tensor, world_size: int) -> float:
    if world_size > 1:
        dist.all_reduce(loss)
    return (loss / world_size).item()


def _write(path: Path, tensors: dict[str, torch.Tensor], rank: int) -> None:
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path))


def _worker(rank: int, world_size: int, port: int, task: str, kwargs: dict[str, Any]) -> None:
    torch.set_num_threads(1)  # two ranks on two shared cores
    join(rank, world_size, port)
    try:
        globals()[task](rank, world_size, **kwargs)
    finally:
        dist.destroy_process_group()
