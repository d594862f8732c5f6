"""GPU names exactly as drivers report them, matched to their own data-sheet row.

The strings are what ``torch.cuda.get_device_name`` (and ``nvidia-smi --query-gpu=name``,
the same NVML name) returns. Where they were seen: ``NVIDIA A100-SXM4-40GB`` and
``NVIDIA H100 80GB HBM3`` in mosaicml/composer PR #2265 (speed_monitor.py); ``NVIDIA H100
80GB HBM3`` as the SXM part's name in pytorch/pytorch PR #194276 (inductor device table);
RunPod's GPU type ids, which are these names (``Tesla V100-PCIE-16GB``, ``Tesla
V100-SXM2-16GB``, ``Tesla V100-SXM2-32GB``, ``NVIDIA A100 80GB PCIe``, ``NVIDIA
A100-SXM4-80GB``, ``NVIDIA H100 80GB HBM3``, ``NVIDIA H100 NVL``, ``NVIDIA H200``,
``NVIDIA L40S``, ``NVIDIA L4``, ``Tesla T4``); an A100 PCIe device report naming
``NVIDIA A100-PCIE-40GB``. ``NVIDIA A10G`` is the name on AWS G5, ``NVIDIA H100 PCIe`` the
PCIe card's (it has HBM2e, so no ``HBM3`` word).

Expected figures are NVIDIA's data sheets (dense peaks; the sheets print 2:4-sparse ones
for Ampere and later, dense being half), written out here rather than read back from the
table, so a wrong row fails.
"""

from __future__ import annotations

import pytest

from skylift.machine.gpus import GPU_TABLE, gpu_spec, parse_gpu_name
from skylift.monitor.flops import gpu_peak

# driver name -> (table row, dense bf16/fp16 TFLOP/s, fp32 TFLOP/s, memory GB, bandwidth GB/s)
DRIVER_NAMES = {
    "Tesla V100-SXM2-16GB": ("v100-sxm-16gb", 125.0, 15.7, 16, 900.0),
    "Tesla V100-SXM2-32GB": ("v100-sxm-32gb", 125.0, 15.7, 32, 900.0),
    "Tesla V100-PCIE-16GB": ("v100-pcie-16gb", 112.0, 14.0, 16, 900.0),
    "Tesla T4": ("t4-16gb", 65.0, 8.1, 16, 320.0),
    "NVIDIA A10G": ("a10g-24gb", 70.0, 31.2, 24, 600.0),
    "NVIDIA L4": ("l4-24gb", 121.0, 30.3, 24, 300.0),
    "NVIDIA L40S": ("l40s-48gb", 362.05, 91.6, 48, 864.0),
    "NVIDIA A100-SXM4-40GB": ("a100-sxm-40gb", 312.0, 19.5, 40, 1555.0),
    "NVIDIA A100-SXM4-80GB": ("a100-sxm-80gb", 312.0, 19.5, 80, 2039.0),
    "NVIDIA A100-PCIE-40GB": ("a100-pcie-40gb", 312.0, 19.5, 40, 1555.0),
    "NVIDIA A100 80GB PCIe": ("a100-pcie-80gb", 312.0, 19.5, 80, 1935.0),
    "NVIDIA H100 80GB HBM3": ("h100-sxm-80gb", 989.0, 66.9, 80, 3350.0),
    "NVIDIA H100 PCIe": ("h100-pcie-80gb", 756.0, 51.2, 80, 2000.0),
    "NVIDIA H100 NVL": ("h100-nvl-94gb", 835.5, 60.0, 94, 3900.0),
    "NVIDIA H200": ("h200-sxm-141gb", 989.0, 66.9, 141, 4800.0),
}


@pytest.mark.parametrize("name", DRIVER_NAMES)
def test_a_driver_name_gets_its_own_variant(name):
    entry, half_tflops, fp32_tflops, memory_gb, bandwidth_gb_s = DRIVER_NAMES[name]
    spec = gpu_spec(name)
    assert spec is not None, name
    assert spec.table_entry == entry
    assert spec.peak_flops_per_s("bf16") == half_tflops * 1e12
    assert spec.peak_flops_per_s("fp32") == fp32_tflops * 1e12
    assert spec.memory_gb == memory_gb
    assert spec.memory_bandwidth_bytes_per_s == bandwidth_gb_s * 1e9
    assert spec.source.startswith("https://")
    assert gpu_peak(name, "bf16").source == f"table:{entry}"


def test_every_variant_is_reachable_from_its_own_name():
    for row in GPU_TABLE:
        assert gpu_spec(row.table_entry) is row


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA H200 NVL", "NVIDIA A100-SXM4-64GB", "NVIDIA A800-SXM4-80GB",
                                  "NVIDIA GeForce RTX 4090", "Tesla V100S-PCIE-32GB", "Some Future GPU", ""])
def test_a_gpu_not_in_the_table_is_unknown_not_a_near_row(name):
    # Substring matching in table order once gave "NVIDIA L40" the L4's row and the A100
    # 80GB the 40GB's bandwidth; a variant not in the table must say it is unknown.
    assert gpu_spec(name) is None
    unknown = gpu_peak(name, "bf16")
    assert unknown.flops_per_s is None and unknown.source.startswith("unknown: GPU")


@pytest.mark.parametrize(("name", "entry"), [("A100", "a100-sxm-40gb"), ("A100-80GB", "a100-sxm-80gb"),
                                             ("A100-80GB-PCIe", "a100-pcie-80gb"), ("H100", "h100-sxm-80gb"),
                                             ("V100", "v100-sxm-16gb"), ("V100-32GB", "v100-sxm-32gb"),
                                             ("L40S", "l40s-48gb"), ("A10", "a10-24gb")])
def test_catalog_names_without_a_form_factor_mean_the_cloud_part(name, entry):
    assert gpu_spec(name).table_entry == entry


def test_names_are_parsed_into_whole_words():
    assert parse_gpu_name("NVIDIA L40") is None  # not a family of the table, and never "l4"
    identity = parse_gpu_name("NVIDIA A100-SXM4-80GB")
    assert (identity.family, identity.form, identity.memory_gb) == ("a100", "sxm", 80)
    identity = parse_gpu_name("NVIDIA H100 80GB HBM3")
    assert (identity.family, identity.form, identity.memory_gb) == ("h100", "sxm", 80)
