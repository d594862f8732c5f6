"""Every shipped example config must load (litgpt config_hub pattern)."""

from __future__ import annotations

import pytest

from skylift.config import load_config
from skylift.launch.preflight import preflight
from tests.conftest import EXAMPLES

EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.yaml"))  # presets and the configs of examples in folders


def test_examples_exist():
    assert EXAMPLE_FILES, "examples/ holds no YAML"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda path: path.name)
def test_example_loads_and_passes_preflight(path):
    config = load_config(path)
    plan = preflight(config, world_size=1)
    assert (plan["micro_batch_size_per_rank"] or plan["max_tokens_per_micro_batch"]) >= 1
