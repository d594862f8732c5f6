"""A collective whose peer does not come says which collective, which rank and what bounds
the wait, in one line (real gloo ranks, a 2 s group timeout)."""

from __future__ import annotations

import json
import time

import pytest

from tests.gloo_group import join, spawn_ranks

pytestmark = [pytest.mark.multiprocess]

TIMEOUT_S = 2.0
"""The group's timeout here: long enough for the first exchange's all_reduce to be issued
on a busy machine, short enough for a fast test; the absent rank stays away 3x that."""


def _rank(rank: int, world_size: int, port: int, out: str) -> None:
    from skylift.loop.agreement import StepAgreement
    from skylift.loop.collectives import CollectiveTimeoutError, PeerLostError

    join(rank, world_size, port, timeout_s=TIMEOUT_S)
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # never joins the agreement; rank 0 must not wait past its timeout
        return
    agreement = StepAgreement(distributed=True)
    agreement.exchange()  # issues the all_reduce; the next exchange waits for it
    try:
        agreement.exchange()
    except (CollectiveTimeoutError, PeerLostError) as error:
        result = {"type": type(error).__name__, "message": str(error)}
    else:
        result = {"type": None, "message": ""}
    with open(out, "w", encoding="utf-8") as file:
        json.dump(result, file)
    import os

    os._exit(0)  # the group is broken: its teardown would wait for the absent rank


@pytest.mark.slow  # two spawned ranks importing torch and a 6 s absence: over 30 s on a busy 2-core machine
def test_a_peer_that_never_joins_the_step_agreement_is_named_in_one_line(tmp_path):
    out = tmp_path / "rank0.json"
    spawn_ranks(_rank, 2, str(out))
    result = json.loads(out.read_text())
    assert result["type"] == "CollectiveTimeoutError", result
    message = result["message"]
    assert "\n" not in message
    assert message.startswith("rank 0 of 2: the step agreement (all_reduce of stop and save requests) waited 2 s "
                              "(distributed.timeout_s) for a peer that did not join"), message


def test_an_error_that_is_not_a_timeout_or_a_lost_peer_passes_through_unchanged():
    from skylift.loop.collectives import CollectiveTimeoutError, PeerLostError, collective

    with pytest.raises(RuntimeError, match="^shape mismatch$"), collective("x"):
        raise RuntimeError("shape mismatch")
    with pytest.raises(PeerLostError, match="^this rank: the metrics flush .* lost a peer"), \
            collective("the metrics flush (all_reduce)"):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:16275")
    with pytest.raises(CollectiveTimeoutError, match="waited 600 s"), collective("y"):
        raise RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 600000ms for recv operation")


def _ddp_rank(rank: int, world_size: int, port: int, out: str) -> None:
    import torch

    from skylift.loop.collectives import CollectiveTimeoutError, PeerLostError
    from skylift.loop.distributed import DistributedContext
    from skylift.train.gradient_step import GradientStep

    join(rank, world_size, port, timeout_s=TIMEOUT_S)
    gradients = GradientStep()
    model = gradients.wrap(torch.nn.Linear(4, 1), DistributedContext(rank, world_size, rank, torch.device("cpu"),
                                                                     "gloo"))
    if rank == 1:
        time.sleep(3 * TIMEOUT_S)  # never runs its backward: rank 0's gradient all-reduce has no peer
        return
    gradients.before_forward()
    try:
        gradients.backward(model(torch.ones(2, 4)).sum())
    except (CollectiveTimeoutError, PeerLostError) as error:
        result = {"type": type(error).__name__, "message": str(error)}
    else:
        result = {"type": None, "message": ""}
    with open(out, "w", encoding="utf-8") as file:
        json.dump(result, file)
    import os

    os._exit(0)


@pytest.mark.slow  # two spawned ranks importing torch and a 6 s absence
def test_a_peer_missing_from_ddps_gradient_all_reduce_is_named(tmp_path):
    out = tmp_path / "rank0.json"
    spawn_ranks(_ddp_rank, 2, str(out))
    result = json.loads(out.read_text())
    assert result["type"] == "CollectiveTimeoutError", result
    assert result["message"].startswith("rank 0 of 2: the gradient all-reduce (DDP, in backward) waited 2 s"), result
