"""Every shipped example config must load (litgpt config_hub pattern)."""

from __future__ import annotations

import pytest
import torch

from skylift.config import load_config
from skylift.errors import SkyliftConfigError
from skylift.launch.preflight import preflight
from tests.conftest import EXAMPLES

EXAMPLE_FILES = sorted(EXAMPLES.rglob("*.yaml"))  # presets and the configs of examples in folders


def test_examples_exist():
    assert EXAMPLE_FILES, "examples/ holds no YAML"


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda path: path.name)
def test_example_loads_and_passes_preflight(path):
    config = load_config(path)
    if (getattr(config.recipe, "lora", None) or {}).get("quantize_base") and not torch.cuda.is_available():
        # A 4-bit base (QLoRA) needs bitsandbytes' CUDA kernels: off CUDA, skylift run refuses it here,
        # before any worker starts.
        with pytest.raises(SkyliftConfigError, match="recipe.lora.quantize_base: nf4 .* this run trains on the CPU"):
            preflight(config, world_size=1)
        return
    plan = preflight(config, world_size=1)
    assert (plan["micro_batch_size_per_rank"] or plan["max_tokens_per_micro_batch"]) >= 1
