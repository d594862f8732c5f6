"""The step clock: sampled steps only, phases that add up, checkpoint stalls split out."""

from __future__ import annotations

import time

import torch

from skylift.monitor.breakdown import StepClock


def _step(clock, *, stall):
    time.sleep(0.01)
    stall[0] += 0.004  # a checkpoint launch between steps, inside the 10 ms above
    clock.mark("between_steps")
    time.sleep(0.02)
    clock.mark("data_wait")
    clock.mark("host_to_device")
    time.sleep(0.03)
    clock.mark("forward_backward")
    time.sleep(0.005)
    clock.mark("optimizer")
    return clock.finish()


def test_only_sampled_steps_are_measured():
    clock = StepClock(3, torch.device("cpu"))
    measured = []
    for step in range(1, 10):
        clock.end_of_previous_step(step)
        clock.mark("between_steps")
        measured.append(clock.finish() is not None)
    assert measured == [False, False, True, False, False, True, False, False, True]


def test_phases_add_up_and_stalls_are_split_out():
    stall = [0.0, 0.0]
    clock = StepClock(1, torch.device("cpu"), checkpoint_stall_s=lambda: tuple(stall))
    started = time.perf_counter()
    clock.end_of_previous_step(1)
    breakdown = _step(clock, stall=stall)
    window_s = time.perf_counter() - started
    assert window_s - 0.005 <= sum(breakdown.values()) <= window_s
    assert breakdown["data_wait"] >= 0.019 and breakdown["forward_backward"] >= 0.029
    assert abs(breakdown["checkpoint"] - 0.004) < 1e-6
    assert breakdown["communication"] == 0.0  # no DDP
    assert breakdown["other"] >= 0.005


def test_time_after_the_optimizer_update_is_the_steps_other_time():
    # What runs between the update and step_end (an EMA update, the loss kept for logging, a
    # descheduled thread) is inside the step's step_time_s, so it must be in its breakdown too.
    clock = StepClock(1, torch.device("cpu"))
    clock.end_of_previous_step(1)
    step_started = time.perf_counter()
    clock.mark("between_steps")
    clock.mark("data_wait")
    clock.mark("host_to_device")
    clock.mark("forward_backward")
    clock.mark("optimizer")
    time.sleep(0.02)
    step_time_s = time.perf_counter() - step_started
    breakdown = clock.finish()
    assert breakdown["other"] >= 0.02
    assert sum(breakdown.values()) >= step_time_s - 7 * 0.5e-6
