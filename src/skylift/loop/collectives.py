"""Collectives that say which they were when a peer does not come.

A gloo collective that times out raises ``RuntimeError: [.../unbound_buffer.cc:78] Timed
out waiting 600000ms for recv operation to complete``; a peer that died raises
"Connection closed by peer"; NCCL's watchdog names an ``OpType`` and a sequence number.
None of them says which of the run's collectives it was, so a hang on a loaded node reads
the same whether the ranks disagreed on a checkpoint, a metrics flush or a step. Each of
skylift's collectives runs inside :func:`collective` with its name, and such an error
leaves it as one line: this rank, the collective, how long it waited and the setting that
bounds it, and where the cause is (the peer's own log).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from skylift.errors import SkyliftError

__all__ = ["CollectiveTimeoutError", "PeerLostError", "collective"]

_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)\s*ms")
_NCCL_TIMEOUT = re.compile(r"(?:collective operation timeout|Timeout\(ms\)=(\d+)|timed out)", re.IGNORECASE)
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited")


class CollectiveTimeoutError(SkyliftError):
    """A collective waited past ``distributed.timeout_s`` for a peer."""


class PeerLostError(SkyliftError):
    """A peer closed its connection during a collective: it exited or crashed."""


@contextmanager
def collective(name: str) -> Iterator[None]:
    """Run one of skylift's collectives as ``name`` (e.g. ``"the step agreement
    (all_reduce)"``); a timeout or a lost peer inside becomes one line naming it and this rank."""
    try:
        yield
    except RuntimeError as error:  # torch.distributed.DistBackendError is a RuntimeError too
        described = describe_failure(error, name)
        if described is None:
            raise
        raise described from error


def describe_failure(error: BaseException, name: str) -> SkyliftError | None:
    """``error`` as skylift's one-line error about collective ``name``, or ``None`` when it
    is neither a timeout nor a lost peer."""
    text = str(error)
    where = _this_rank()
    gloo = _GLOO_TIMEOUT.search(text)
    if gloo or _NCCL_TIMEOUT.search(text):
        waited_ms = gloo.group(1) if gloo else None
        waited = f"{int(waited_ms) / 1000:g} s" if waited_ms else "its timeout"
        return CollectiveTimeoutError(
            f"{where}: {name} waited {waited} (distributed.timeout_s) for a peer that did not join; the slowest "
            "rank's log says what it was doing. Raise distributed.timeout_s only if one step, save or evaluation "
            "legitimately takes longer than that")
    if any(marker in text for marker in _PEER_LOST):
        return PeerLostError(f"{where}: {name} lost a peer (it closed its connection: it exited or crashed); "
                             "that rank's own log has the cause")
    return None


def _this_rank() -> str:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return f"rank {dist.get_rank()} of {dist.get_world_size()}"
    return "this rank"
