from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from skylift.errors import SkyliftConfigError
from skylift.train.precision import DeviceInfo, resolve_precision

A100 = DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", cuda_capability=(8, 0))
H200 = DeviceInfo("cuda", "NVIDIA H200", cuda_capability=(9, 0))
V100 = DeviceInfo("cuda", "Tesla V100-SXM2-16GB", cuda_capability=(7, 0))
T4 = DeviceInfo("cuda", "Tesla T4", cuda_capability=(7, 5))
CPU_BF16 = DeviceInfo("cpu", "Xeon with AMX", cpu_native_bf16=True)
CPU_PLAIN = DeviceInfo("cpu", "old Xeon", cpu_native_bf16=False)


@pytest.mark.parametrize(
    ("device", "name", "scaler"),
    [(A100, "bf16", False), (H200, "bf16", False), (V100, "fp16", True), (T4, "fp16", True),
     (CPU_BF16, "bf16", False), (CPU_PLAIN, "fp32", False)],
)
def test_auto_follows_the_hardware(device, name, scaler):
    policy = resolve_precision("auto", device)
    assert (policy.name, policy.use_grad_scaler) == (name, scaler)
    assert policy.reason.startswith("auto:")


@pytest.mark.parametrize("device", [V100, T4])
def test_bf16_on_a_gpu_without_it_is_an_error(device):
    with pytest.raises(SkyliftConfigError, match="bf16 needs CUDA compute capability >= 8.0"):
        resolve_precision("bf16", device)


def test_bf16_on_a_cpu_without_it_is_an_error():
    with pytest.raises(SkyliftConfigError, match="no native bf16"):
        resolve_precision("bf16", CPU_PLAIN)


def test_tf32_needs_ampere():
    assert resolve_precision("tf32", A100).allow_tf32
    with pytest.raises(SkyliftConfigError, match="tf32"):
        resolve_precision("tf32", CPU_BF16)


def test_fp16_always_uses_a_grad_scaler():
    assert resolve_precision("fp16", CPU_PLAIN).use_grad_scaler
    assert resolve_precision("fp16", A100).autocast_dtype is torch.float16


def test_cpu_detection_honours_the_kernels_pytorch_may_use():
    """ATEN_CPU_CAPABILITY=avx2 stops PyTorch using AVX512 bf16 kernels: no native bf16."""
    code = (
        "import torch; from skylift.train.precision import DeviceInfo;"
        "print(DeviceInfo.detect(torch.device('cpu')).cpu_native_bf16)"
    )
    limited = subprocess.run(
        [sys.executable, "-c", code], env={"ATEN_CPU_CAPABILITY": "avx2", "PATH": ""}, capture_output=True, text=True
    )
    assert limited.stdout.strip() == "False", limited.stderr
