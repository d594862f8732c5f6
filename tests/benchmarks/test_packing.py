"""benchmarks/packing.py end to end in its --quick form: both arms train, the packed one
with a small fraction of the padded one's padding, and the JSON holds what the docs quote."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers", reason="needs the text extra (transformers)")

from benchmarks.packing import ARMS, main


@pytest.mark.slow  # two short trainings of the tiny Llama: ~15 s on the shared 2-core machine
def test_quick_run_writes_both_arms_side_by_side(tmp_path):
    threads = torch.get_num_threads()
    try:
        assert main(["--quick", "--out", str(tmp_path / "packing.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads((tmp_path / "packing.json").read_text())
    median = report["results"]["median"]
    assert set(median) == set(ARMS)
    assert median["packed"]["padding_share"] < 0.1 and median["padded"]["padding_share"] > 0.3
    assert report["results"]["ratios"]["padding_share_points_saved"] > 0.2
    assert all(median[arm]["tokens_per_s"] > 0 for arm in ARMS)
