"""The doctor's report: paste-ready text, or JSON with a stable schema.

``skylift doctor --json`` prints one object (``schema_version`` 1)::

    {
      "schema_version": 1,           # bumped only when a field is renamed, removed or changes meaning
      "skylift_version": "0.1.0",
      "exit_code": 0,                # 1 when any verdict is "fail"
      "summary": {"fail": 0, "warn": 1, "info": 2, "pass": 9},
      "verdicts": [                  # worst first
        {"rule": "shm", "status": "warn", "reason": "...", "fix": "docker run --ipc=host ..."}
      ],
      "facts": {...}                 # skylift.machine.facts.Facts: os, cpu, memory, shm, disks, torch,
                                     # driver, gpus, gpu_links, network, environment, nccl_conf, files,
                                     # container, cloud, packages, notes, job
    }

``status`` is one of ``pass``, ``info``, ``warn``, ``fail``; ``fix`` is ``null`` when
nothing is to be done. Byte counts are integers in bytes (``*_bytes``), ``None``/``null``
means unknown. Both forms pass through :class:`~skylift.doctor.redact.Redactor`.
"""

from __future__ import annotations

import json
from typing import Any

from skylift.doctor.redact import Redactor
from skylift.doctor.rules.resources import format_bytes
from skylift.doctor.verdicts import Verdict
from skylift.machine.facts import SCHEMA_VERSION, Facts

__all__ = ["exit_code", "render_json", "render_text", "report_dict", "summary"]

_STATUSES = ("fail", "warn", "info", "pass")


def summary(verdicts: list[Verdict]) -> dict[str, int]:
    return {status: sum(1 for v in verdicts if v.status == status) for status in _STATUSES}


def exit_code(verdicts: list[Verdict]) -> int:
    """0 when nothing fails, 1 otherwise."""
    return 1 if any(verdict.status == "fail" for verdict in verdicts) else 0


def report_dict(facts: Facts, verdicts: list[Verdict], redactor: Redactor | None = None) -> dict[str, Any]:
    """The JSON report as a dict, redacted."""
    redactor = redactor or Redactor()
    facts_json = facts.model_dump(mode="json")
    facts_json["environment"] = redactor.environment(facts.environment)
    facts_json["nccl_conf"] = redactor.environment(facts.nccl_conf)
    return redactor.value(
        {
            "schema_version": SCHEMA_VERSION,
            "skylift_version": facts.skylift_version,
            "exit_code": exit_code(verdicts),
            "summary": summary(verdicts),
            "verdicts": [verdict.model_dump(mode="json") for verdict in verdicts],
            "facts": facts_json,
        }
    )


def render_json(facts: Facts, verdicts: list[Verdict], redactor: Redactor | None = None) -> str:
    return json.dumps(report_dict(facts, verdicts, redactor), indent=2)


def render_text(facts: Facts, verdicts: list[Verdict], redactor: Redactor | None = None) -> str:
    """The report for a terminal or a bug report: verdicts with fixes, then the facts."""
    redactor = redactor or Redactor()
    lines = [f"skylift doctor {facts.skylift_version} at {facts.collected_at} (report schema {SCHEMA_VERSION})", ""]
    lines += _verdict_lines(verdicts)
    lines += ["", "Facts"]
    lines += [f"  {label:<12} {value}" for label, value in _fact_rows(facts, redactor)]
    counts = summary(verdicts)
    lines += ["", ", ".join(f"{counts[s]} {s}" for s in _STATUSES) + f"; exit {exit_code(verdicts)}"]
    return redactor.text("\n".join(lines))


def _verdict_lines(verdicts: list[Verdict]) -> list[str]:
    lines = ["Verdicts"]
    for verdict in verdicts:
        lines.append(f"  {verdict.status.upper():<4}  {verdict.rule:<19} {verdict.reason}")
        if verdict.fix and verdict.status != "pass":
            lines.append(f"  {'':<4}  {'':<19} fix: {verdict.fix}")
    return lines


def _fact_rows(facts: Facts, redactor: Redactor) -> list[tuple[str, str]]:
    os_ = facts.os
    rows = [
        ("os", f"{os_.distribution or os_.system}, kernel {os_.kernel}, glibc {os_.glibc or '?'}, {os_.machine}"),
        ("python", str(os_.python)),
        ("torch", _torch(facts)),
        ("driver", _driver(facts)),
    ]
    rows += [(f"gpu {gpu.index}", _gpu(gpu)) for gpu in facts.gpus] or [("gpus", "none visible")]
    links = [f"{link.gpu_a}-{link.gpu_b} {link.path or '?'}" for link in facts.gpu_links]
    if links:
        rows.append(("topology", ", ".join(links)))
    rows += _host_rows(facts)
    rows += _network_rows(facts)
    env = redactor.environment({**facts.environment, **{f"nccl.conf:{k}": v for k, v in facts.nccl_conf.items()}})
    rows.append(("environment", " ".join(f"{name}={value}" for name, value in env.items()) or "none set"))
    rows.append(("packages", " ".join(f"{name}={version}" for name, version in facts.packages.items() if version)))
    rows += [("note", note) for note in facts.notes]
    return rows


def _torch(facts: Facts) -> str:
    torch = facts.torch
    if not torch.installed:
        return torch.error or "not installed"
    cudnn = f"{torch.cudnn // 10000}.{torch.cudnn // 100 % 100}.{torch.cudnn % 100}" if torch.cudnn else "none"
    build = f"CUDA {torch.cuda}" if torch.cuda else f"ROCm {torch.hip}" if torch.hip else "CPU build"
    return (
        f"{torch.version} ({build}, cuDNN {cudnn}, NCCL {torch.nccl or 'none'}; "
        f"arch {' '.join(torch.arch_list) or 'none'}); CUDA available: {torch.cuda_available}"
    )


def _driver(facts: Facts) -> str:
    driver = facts.driver
    if not driver.nvml:
        return f"unknown: {driver.reason}"
    return f"{driver.version} (supports CUDA {driver.cuda})"


def _gpu(gpu: Any) -> str:
    capability = f"{gpu.capability[0]}.{gpu.capability[1]}" if gpu.capability else "?"
    memory = format_bytes(gpu.memory_total_bytes) if gpu.memory_total_bytes else "?"
    pcie = f"PCIe gen{gpu.pcie_generation} x{gpu.pcie_width}" if gpu.pcie_generation else "PCIe ?"
    return (
        f"{gpu.name}, capability {capability}, {memory}, ECC {_flag(gpu.ecc_enabled)}, MIG {_flag(gpu.mig_enabled)}, "
        f"{pcie}, NVLinks {gpu.nvlinks_active if gpu.nvlinks_active is not None else '?'}"
    )


def _flag(value: bool | None) -> str:
    return "?" if value is None else "on" if value else "off"


def _host_rows(facts: Facts) -> list[tuple[str, str]]:
    cpu, memory, shm = facts.cpu, facts.memory, facts.shm
    quota = f", cgroup quota {cpu.quota:g}" if cpu.quota else ""
    limit = f", cgroup limit {format_bytes(memory.limit_bytes)}" if memory.limit_bytes else ""
    rows = [
        ("cpus", f"{cpu.usable} usable of {cpu.logical}{quota} ({cpu.model}); native bf16: {cpu.native_bf16}"),
        ("memory", f"{_size(memory.total_bytes)} total, {_size(memory.available_bytes)} available{limit}"),
        ("shm", f"{shm.path} {_size(shm.total_bytes)} ({_size(shm.free_bytes)} free)"),
    ]
    rows += [
        (f"disk {d.purpose}", f"{d.path}: {_size(d.free_bytes)} free of {_size(d.total_bytes)}") for d in facts.disks
    ]
    container = facts.container
    rows.append(("container", f"{container.kind} ({container.evidence})" if container.kind else "none detected"))
    cloud = facts.cloud
    where = f"{cloud.name} (from {cloud.source}), instance type {cloud.instance_type or '?'}" if cloud.name else "none"
    rows.append(("cloud", where))
    if facts.job is not None:
        rows.append(("job", _job(facts)))
    return rows


def _job(facts: Facts) -> str:
    job = facts.job
    assert job is not None
    text = (
        f"{job.source} {job.config_path or ''}: device {job.device}, precision {job.precision}, "
        f"{job.nproc} x {job.nnodes} processes, {job.num_workers} loader workers, micro-batch {job.micro_batch_size}"
    )
    if job.memory is not None:
        text += f", estimated {_size(job.memory.total_bytes)} per rank"
        if job.memory.note:
            text += f" ({job.memory.note})"
    return text


def _network_rows(facts: Facts) -> list[tuple[str, str]]:
    network = facts.network
    interfaces = ", ".join(f"{i.name}{'' if i.up else ' (down)'}" for i in network.interfaces) or "none"
    rdma = ", ".join(f"{d.name} ({d.kind}, {d.state or '?'})" for d in network.rdma_devices) or "none"
    plugins = (
        ", ".join(
            f"{p.path}{'' if p.on_search_path else ' (not on the loader path)'}" for p in network.nccl_net_plugins
        )
        or "none"
    )
    return [("interfaces", interfaces), ("rdma", rdma), ("nccl plugins", plugins)]


def _size(count: int | None) -> str:
    return "?" if count is None else format_bytes(count)
