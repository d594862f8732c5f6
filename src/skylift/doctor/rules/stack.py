"""The software stack: driver against torch's CUDA, kernels for the GPU, precision, CVEs."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from skylift.doctor.tables import (
    DRIVER_BRANCH_EOL,
    OLDEST_LISTED_BRANCH,
    TORCH_LOAD_CVE_FIXED,
    WHEEL_VARIANTS,
    family_floor,
    release_min_driver,
    version_tuple,
    wheels_with_capability,
)
from skylift.doctor.verdicts import Finding, rule
from skylift.machine.facts import Facts, GpuFacts

if TYPE_CHECKING:
    from skylift.train.precision import DeviceInfo

__all__ = [
    "bf16_is_native",
    "driver_branch_supported",
    "driver_supports_torch_cuda",
    "gpu_is_visible",
    "precision_fits_device",
    "torch_has_gpu_kernels",
    "torch_load_is_safe",
]

_ARCH = re.compile(r"^(sm|compute)_(\d+)([a-z]?)$")


@rule("driver-cuda", gate=True)
def driver_supports_torch_cuda(facts: Facts) -> Finding | None:
    """The driver runs torch's CUDA: below the family floor fails, below the release row warns."""
    cuda, driver = facts.torch.cuda, facts.driver.version
    if not cuda or not driver:
        return None
    floor, row = family_floor(cuda), release_min_driver(cuda)
    have = f"driver {driver} (supports CUDA {facts.driver.cuda or '?'})"
    if floor and version_tuple(driver) < version_tuple(floor):
        return Finding(
            "fail",
            f"{have} is older than {floor}, the minimum for torch {facts.torch.version}'s CUDA {cuda} "
            '("The NVIDIA driver on your system is too old")',
            f"upgrade the NVIDIA driver to >= {row or floor}; {_older_wheel_hint(facts)}",
        )
    if row and version_tuple(driver) < version_tuple(row):
        return Finding(
            "warn",
            f"{have} runs CUDA {cuda} only through minor-version compatibility (needs >= {floor}; the "
            f"CUDA {cuda} release row asks >= {row}): PTX from a newer toolkit cannot be JIT-compiled, "
            "so torch.compile/Triton kernels may fail with CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            f"upgrade the NVIDIA driver to >= {row}",
        )
    known = "" if row else f" (CUDA {cuda} is not in skylift's driver table; checked the family floor)"
    return Finding("pass", f"{have} runs torch's CUDA {cuda}{known}")


def _older_wheel_hint(facts: Facts) -> str:
    driver = version_tuple(facts.driver.version or "0")
    release = version_tuple(facts.torch.version or "0")[:2]
    usable = [
        v
        for v in WHEEL_VARIANTS
        if version_tuple(v.torch_from) <= release <= version_tuple(v.torch_to)
        and driver >= version_tuple(family_floor(_variant_cuda(v.variant)) or "999")
    ]
    if not usable:
        return f"torch {facts.torch.version} has no wheel for this driver, so the driver upgrade is the fix"
    wheel = max(usable, key=lambda v: v.variant)
    command = f"pip install torch=={_release(facts)} --index-url {wheel.index_url}"
    return f"or install a wheel built for an older CUDA: {command}"


def _variant_cuda(variant: str) -> str:
    digits = variant.removeprefix("cu")  # cu126 -> 12.6, cu130 -> 13.0
    return f"{digits[:-1]}.{digits[-1]}"


def _release(facts: Facts) -> str:
    return (facts.torch.version or "").split("+", 1)[0]


@rule("driver-branch")
def driver_branch_supported(facts: Facts) -> Finding | None:
    """End-of-life datacenter driver branches warn."""
    if not facts.driver.version:
        return None
    branch = version_tuple(facts.driver.version)[0]
    today = (facts.collected_at or "9999-12")[:7]
    eol = DRIVER_BRANCH_EOL.get(branch)
    fix = "install a supported branch (R580 is supported until 2028-08)"
    if eol is not None and eol < today:
        return Finding("warn", f"driver branch R{branch} reached end of life in {eol}", fix)
    if eol is not None:
        return Finding("pass", f"driver branch R{branch} is supported until {eol}")
    if branch < OLDEST_LISTED_BRANCH:
        return Finding("warn", f"driver branch R{branch} is older than every branch NVIDIA lists as supported", fix)
    return Finding("info", f"driver branch R{branch}: its end of life is not in skylift's table")


@rule("gpu-arch", gate=True)
def torch_has_gpu_kernels(facts: Facts) -> list[Finding] | None:
    """Each GPU model has kernels in the wheel (same-major cubin or older PTX), else fail."""
    models = {(gpu.name, gpu.capability): gpu for gpu in facts.gpus if gpu.capability}
    if not models or not facts.torch.cuda:
        return None
    return [_arch_finding(facts, gpu) for gpu in models.values()]


def _arch_finding(facts: Facts, gpu: GpuFacts) -> Finding:
    assert gpu.capability is not None
    major, minor = gpu.capability
    built = " ".join(facts.torch.arch_list) or "no architectures"
    if _runs_on(facts.torch.arch_list, gpu.capability):
        return Finding("pass", f"{gpu.name} (compute capability {major}.{minor}) has kernels in torch ({built})")
    wheels = wheels_with_capability(facts.torch.version or "0", gpu.capability)
    if wheels:
        fix = " or ".join(f"pip install torch=={_release(facts)} --index-url {w.index_url}" for w in wheels)
    else:
        fix = f"no torch {_release(facts)} wheel skylift knows has sm_{major}{minor}: use an older torch or a newer GPU"
    return Finding(
        "fail",
        f"{gpu.name} (compute capability {major}.{minor}) has no kernels in torch {facts.torch.version} "
        f'(built for {built}) and no PTX it could JIT: "no kernel image is available for execution on the device"',
        fix,
    )


def _runs_on(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """A cubin of the same major and a minor at most the GPU's, or PTX of at most its capability."""
    for entry in arch_list:
        match = _ARCH.match(entry)
        if match is None:
            continue
        kind, number, suffix = match.group(1), int(match.group(2)), match.group(3)
        built = (number // 10, number % 10)
        if kind == "sm" and not suffix and built[0] == capability[0] and built[1] <= capability[1]:
            return True
        if kind == "sm" and suffix and built == capability:  # sm_90a: that exact GPU only
            return True
        if kind == "compute" and built <= capability:
            return True
    return False


@rule("gpu-visible", gate=True)
def gpu_is_visible(facts: Facts) -> Finding:
    """No GPU: info on a CPU machine, fail when the job asks for CUDA."""
    job = facts.job
    wants_cuda = job is not None and job.device == "cuda"
    if facts.torch.cuda_available:
        names = ", ".join(sorted({gpu.name for gpu in facts.gpus})) or "GPU"
        return Finding("pass", f"{facts.torch.device_count} x {names} visible to torch")
    hidden = facts.environment.get("CUDA_VISIBLE_DEVICES", None)
    if facts.gpus and hidden is not None and hidden.strip() in ("", "-1"):
        return Finding(
            "fail" if wants_cuda else "warn",
            f"NVML sees {len(facts.gpus)} GPU(s) but CUDA_VISIBLE_DEVICES={hidden!r} hides them",
            "unset CUDA_VISIBLE_DEVICES",
        )
    if facts.gpus and not facts.torch.cuda:
        return Finding(
            "fail" if wants_cuda else "warn",
            f"NVML sees {len(facts.gpus)} GPU(s) but torch {facts.torch.version} is a CPU build",
            _cuda_wheel_fix(facts),
        )
    if facts.gpus:
        return Finding(
            "fail" if wants_cuda else "warn",
            f"NVML sees {len(facts.gpus)} GPU(s) but torch cannot initialise CUDA",
            "see the driver-cuda verdict; python -c 'import torch; torch.cuda.init()' shows the error",
        )
    why = facts.driver.reason or "NVML found no GPU"
    if wants_cuda:
        return Finding(
            "fail",
            f"device: cuda, but no GPU is visible: {why}",
            "check the driver (nvidia-smi); in a container run with --gpus all; or set device: auto",
        )
    return Finding("info", f"no GPU visible ({why}); training runs on the CPU")


def _cuda_wheel_fix(facts: Facts) -> str:
    capability = next((gpu.capability for gpu in facts.gpus if gpu.capability), None)
    wheels = wheels_with_capability(facts.torch.version or "0", capability) if capability else []
    index = wheels[-1].index_url if wheels else "https://download.pytorch.org/whl/cu130"
    return f"pip install torch=={_release(facts)} --index-url {index}"


@rule("precision", gate=True)
def precision_fits_device(facts: Facts) -> Finding | None:
    """The configured precision runs natively on the device the job trains on."""
    from skylift.errors import SkyliftConfigError
    from skylift.train.precision import resolve_precision

    job = facts.job
    if job is None or job.precision is None:
        return None
    device = _training_device(facts)
    try:
        policy = resolve_precision(job.precision, device)
    except SkyliftConfigError as error:
        return Finding("fail", "; ".join(error.problems), (error.hint or "").removesuffix("."))
    capability = device.cuda_capability or (0, 0)
    if policy.name == "fp16" and job.precision == "fp16" and capability >= (8, 0):
        return Finding(
            "warn",
            f"precision: fp16 on {device.name}, which runs bf16 natively (fp16 needs a GradScaler and can overflow)",
            "set precision: bf16 (or auto)",
        )
    return Finding("pass", f"precision {policy.name} on {device.name}: {policy.reason}")


def _training_device(facts: Facts) -> DeviceInfo:
    from skylift.train.precision import DeviceInfo

    job = facts.job
    gpus = [gpu for gpu in facts.gpus if gpu.capability]
    if job is not None and job.device != "cpu" and facts.torch.cuda_available and gpus:
        weakest = min(gpus, key=lambda gpu: gpu.capability or (0, 0))
        return DeviceInfo("cuda", weakest.name, cuda_capability=weakest.capability)
    return DeviceInfo("cpu", facts.cpu.model or "CPU", cpu_native_bf16=facts.cpu.native_bf16)


@rule("bf16-native")
def bf16_is_native(facts: Facts) -> list[Finding] | None:
    """Says which GPUs run bf16/tf32 natively (capability >= 8.0): torch.cuda.is_bf16_supported()
    answers True on a T4 or V100, where bf16 is emulated."""
    models = {(gpu.name, gpu.capability) for gpu in facts.gpus if gpu.capability}
    if not models:
        return None
    findings = []
    for name, capability in sorted(models):
        assert capability is not None
        text = f"{name} (compute capability {capability[0]}.{capability[1]})"
        if capability >= (8, 0):
            findings.append(Finding("pass", f"{text} runs bf16 and tf32 natively"))
        else:
            findings.append(
                Finding(
                    "info",
                    f"{text} has no native bf16 or tf32; torch.cuda.is_bf16_supported() says True because "
                    "it counts emulation",
                    "use precision: fp16 or auto (auto picks fp16 with a GradScaler here)",
                )
            )
    return findings


@rule("torch-load-cve")
def torch_load_is_safe(facts: Facts) -> Finding | None:
    """torch older than 2.6.0 runs code from a crafted checkpoint (CVE-2025-32434)."""
    if not facts.torch.version:
        return None
    if version_tuple(facts.torch.version) < version_tuple(TORCH_LOAD_CVE_FIXED):
        return Finding(
            "fail",
            f"torch {facts.torch.version} is affected by CVE-2025-32434: torch.load with weights_only=True can "
            "execute code from a crafted checkpoint",
            f"pip install -U 'torch>={TORCH_LOAD_CVE_FIXED}'",
        )
    return Finding("pass", f"torch {facts.torch.version} has the CVE-2025-32434 fix (>= {TORCH_LOAD_CVE_FIXED})")
