"""The meta trace of a step's memory traffic."""

from __future__ import annotations

import pytest

from skylift.config import load_config
from skylift.plan.traffic import trace_step_traffic


def test_half_precision_halves_the_floating_traffic_and_weights_amortise_over_the_batch():
    config = load_config("examples/resnet18_synthetic.yaml")
    full = trace_step_traffic(config, 8, half=False)
    half = trace_step_traffic(config, 8, half=True)
    # Labels and indices stay integers, so a little less than half.
    assert 0.5 <= half.bytes_per_sample / full.bytes_per_sample < 0.51
    assert half.flops_per_sample == full.flops_per_sample
    assert full.bytes_per_sample == pytest.approx(full.memory_op_bytes_per_sample + full.compute_op_bytes_per_sample)
    # Every op reads the weights once per micro-batch: per sample, a larger batch moves less.
    assert trace_step_traffic(config, 32, half=False).bytes_per_sample < full.bytes_per_sample


def test_streamed_images_cannot_be_traced_and_say_why():
    config = load_config("examples/quickstart.yaml", ["data.url=/nowhere/shards"])
    with pytest.raises(ValueError, match="sample shape"):
        trace_step_traffic(config, 4, half=False)
