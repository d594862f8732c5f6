"""The CPU's peak, MFU's denominator: measured per CPU-second, raised by the machine's cache."""

from __future__ import annotations

import json

import torch

from skylift.monitor.cpu_peak import cpu_peak_key, measure_cpu_peak_flops


def test_a_measurement_is_kept_per_machine_kernels_threads_and_dtype(tmp_path):
    cache = tmp_path / "cpu_peak.json"
    peak = measure_cpu_peak_flops(torch.float32, budget_s=0.05, cache_path=cache)
    assert peak > 1e8
    key = cpu_peak_key(torch.float32, torch.get_num_threads())
    assert json.loads(cache.read_text()) == {key: peak}
    assert torch.backends.cpu.get_cpu_capability() in key and f"{torch.get_num_threads()} threads" in key
    assert key.endswith("|float32") and cpu_peak_key(torch.bfloat16, 1).endswith("|1 threads|bfloat16")


def test_a_higher_peak_measured_before_on_this_machine_is_the_peak(tmp_path):
    """A reading taken while another process held the core stays no one's peak: the best
    this machine measured is, and a later, better measurement replaces a lower one."""
    cache = tmp_path / "cpu_peak.json"
    key = cpu_peak_key(torch.float32, torch.get_num_threads())
    other = cpu_peak_key(torch.bfloat16, torch.get_num_threads())
    cache.write_text(json.dumps({key: 1e18, other: 5.0}))
    assert measure_cpu_peak_flops(torch.float32, budget_s=0.05, cache_path=cache) == 1e18
    cache.write_text(json.dumps({key: 1.0, other: 5.0}))
    peak = measure_cpu_peak_flops(torch.float32, budget_s=0.05, cache_path=cache)
    assert peak > 1e8 and json.loads(cache.read_text()) == {key: peak, other: 5.0}


def test_a_cache_that_is_not_skylifts_json_is_measured_around(tmp_path):
    cache = tmp_path / "cpu_peak.json"
    for content in (b"\x80\x04\x95 pickled bytes", b"[1, 2]", b'{"k": "fast"}'):
        cache.write_bytes(content)
        assert measure_cpu_peak_flops(torch.float32, budget_s=0.02, cache_path=cache) > 1e8
    blocked = tmp_path / "a file" / "cpu_peak.json"
    blocked.parent.write_text("a file where the folder would be")
    assert measure_cpu_peak_flops(torch.float32, budget_s=0.02, cache_path=blocked) > 1e8
