"""The system sampler without NVML or a GPU: host figures, said once, never a crash."""

from __future__ import annotations

import logging
import time

from skylift.monitor.nvml import Nvml
from skylift.monitor.schema import validate_record
from skylift.monitor.system import SystemSampler


def test_samples_host_without_nvml(caplog):
    records = []
    sampler = SystemSampler(0.05, records.append, node_rank=0, step=lambda: 7)
    with caplog.at_level(logging.INFO, logger="skylift"):
        sampler.start()
        time.sleep(0.3)
        sampler.stop()
    assert len(records) >= 3
    for record in records:
        validate_record(record)
        assert record["gpus"] == [] and record["step"] == 7
    assert records[-1]["host"]["memory_total_gib"] > 0
    assert records[-1]["host"]["disk_read_mb_s"] is not None  # a rate once a previous sample exists
    said = [m for m in caplog.messages if "host figures only" in m]
    assert len(said) == 1


def test_nvml_absence_is_a_reason_not_an_error():
    nvml = Nvml()
    if nvml.available:  # a machine with GPUs: the sample has them
        assert nvml.sample()[0]["name"]
    else:
        assert nvml.reason and nvml.sample() == []
    nvml.close()


def test_a_failing_sink_does_not_stop_the_sampler():
    calls = []

    def sink(record):
        calls.append(record)
        raise OSError("disk full")

    sampler = SystemSampler(0.02, sink)
    sampler.start()
    time.sleep(0.15)
    sampler.stop()
    assert len(calls) >= 3
