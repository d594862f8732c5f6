"""Driver, wheel architecture, precision, visibility and CVE rules on recorded machines."""

from __future__ import annotations

from skylift.machine.facts import DriverFacts, JobFacts, TorchFacts
from tests.doctor.recorded import load_facts, only, verdicts_of


def test_a_470_driver_fails_a_cu130_wheel_and_names_the_upgrade():
    verdict = only(load_facts("v100_driver470"), "driver-cuda")
    assert verdict.status == "fail"
    assert "470.82.01" in verdict.reason and "580.65.06" in verdict.reason
    assert "upgrade the NVIDIA driver to >= 580.65.06" in verdict.fix
    # torch 2.14's oldest wheel (cu126) needs 525.60.13: no wheel rescues a 470 driver
    assert "no wheel for this driver" in verdict.fix


def test_a_driver_between_the_family_floor_and_the_release_row_warns_of_ptx():
    facts = load_facts(
        "a100_bf16",
        driver=DriverFacts(nvml=True, version="570.26", cuda="12.8"),
        torch=TorchFacts(version="2.9.1+cu129", cuda="12.9", cuda_available=True),
    )
    verdict = only(facts, "driver-cuda")
    assert verdict.status == "warn" and "PTX" in verdict.reason
    assert verdict.fix == "upgrade the NVIDIA driver to >= 575.51.03"


def test_driver_versions_compare_as_numbers_not_strings():
    # "570.124.06" < "570.26" as strings; as numbers it is newer and meets CUDA 12.8.0's 570.26.
    facts = load_facts(
        "a100_bf16",
        driver=DriverFacts(nvml=True, version="570.124.06", cuda="12.8"),
        torch=TorchFacts(version="2.10.0+cu128", cuda="12.8", cuda_available=True),
    )
    assert only(facts, "driver-cuda").status == "pass"


def test_a_driver_too_old_for_cu130_is_pointed_at_the_cu126_wheel():
    facts = load_facts("a100_bf16", driver=DriverFacts(nvml=True, version="550.54.15", cuda="12.4"))
    verdict = only(facts, "driver-cuda")
    assert verdict.status == "fail"
    assert "pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/cu126" in verdict.fix


def test_a_current_driver_passes():
    assert only(load_facts("a100_bf16"), "driver-cuda").status == "pass"


def test_pascal_with_a_cu130_wheel_fails_naming_the_cu126_wheel():
    verdict = only(load_facts("pascal_cu130"), "gpu-arch")
    assert verdict.status == "fail"
    assert "6.1" in verdict.reason and "no kernel image" in verdict.reason
    assert verdict.fix == "pip install torch==2.14.1 --index-url https://download.pytorch.org/whl/cu126"


def test_same_major_cubins_and_older_ptx_count_as_kernels():
    # sm_80 runs on an 8.6 GPU; compute_80 (PTX) JIT-compiles for a 9.0 GPU.
    facts = load_facts("a100_bf16", torch=TorchFacts(version="2.14.1", cuda="13.0", arch_list=["sm_80", "compute_80"]))
    facts.gpus[0].capability = (8, 6)
    assert only(facts, "gpu-arch").status == "pass"
    facts.gpus[0].capability = (9, 0)
    assert only(facts, "gpu-arch").status == "pass"
    facts.torch.arch_list = ["sm_80"]
    assert only(facts, "gpu-arch").status == "fail"


def test_bf16_asked_of_a_v100_or_t4_fails_with_the_config_key():
    v100 = load_facts("v100_driver470")
    v100.torch.cuda_available = True  # as it would be once the driver is upgraded
    for facts in (v100, load_facts("t4")):
        verdict = only(facts, "precision")
        assert verdict.status == "fail"
        assert "bf16 needs CUDA compute capability >= 8.0" in verdict.reason
        assert "precision: fp16" in verdict.fix


def test_bf16_native_reports_the_emulation_trap_on_a_t4():
    verdict = only(load_facts("t4"), "bf16-native")
    assert verdict.status == "info" and "is_bf16_supported() says True" in verdict.reason


def test_bf16_on_an_a100_passes_and_fp16_there_warns():
    facts = load_facts("a100_bf16")
    assert only(facts, "precision").status == "pass"
    facts.job.precision = "fp16"
    verdict = only(facts, "precision")
    assert verdict.status == "warn" and verdict.fix == "set precision: bf16 (or auto)"


def test_tf32_on_a_t4_fails():
    facts = load_facts("t4")
    facts.job.precision = "tf32"
    assert only(facts, "precision").status == "fail"


def test_no_gpu_is_info_on_a_cpu_machine_and_fails_when_the_config_asks_cuda():
    facts = load_facts("no_nvml")
    verdict = only(facts, "gpu-visible")
    assert verdict.status == "fail" and "NVML Shared Library Not Found" in verdict.reason
    facts.job = JobFacts(device="auto")
    verdict = only(facts, "gpu-visible")
    assert verdict.status == "info" and "runs on the CPU" in verdict.reason
    assert verdicts_of(facts, "driver-cuda") == []  # nothing to compare without a driver


def test_a_hidden_gpu_names_cuda_visible_devices():
    facts = load_facts("a100_bf16", environment={"CUDA_VISIBLE_DEVICES": ""})
    facts.torch.cuda_available = False
    verdict = only(facts, "gpu-visible")
    assert verdict.fix == "unset CUDA_VISIBLE_DEVICES"


def test_torch_before_2_6_fails_for_cve_2025_32434():
    facts = load_facts("a100_bf16", torch=TorchFacts(version="2.5.1+cu124", cuda="12.4"))
    verdict = only(facts, "torch-load-cve")
    assert verdict.status == "fail" and "CVE-2025-32434" in verdict.reason
    assert verdict.fix == "pip install -U 'torch>=2.6.0'"
    assert only(load_facts("a100_bf16"), "torch-load-cve").status == "pass"


def test_end_of_life_driver_branches_warn():
    facts = load_facts("t4")  # R535: end of life 2026-06, the fact set is from 2026-12
    assert only(facts, "driver-branch").status == "warn"
    assert only(load_facts("a100_bf16"), "driver-branch").status == "pass"  # R580 until 2028-08
    assert only(load_facts("v100_driver470"), "driver-branch").status == "warn"  # older than any listed
