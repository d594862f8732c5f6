"""The doctor's job checks before ``skylift run``/``launch`` start any worker.

A job that cannot work (driver too old for the wheel, no kernels for the GPU, bf16
on a V100, a /dev/shm too small for the loader, a mistyped ``NCCL_SOCKET_IFNAME``)
stops here in seconds, before an image pull or a rendezvous is wasted on it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from skylift.errors import SkyliftConfigError

if TYPE_CHECKING:
    from skylift.config.schema import RunConfig
    from skylift.doctor.verdicts import Verdict
    from skylift.machine.facts import Facts

__all__ = ["JobCheckFailed", "check_before_start", "gate_failures"]


class JobCheckFailed(SkyliftConfigError):
    """A job check failed before anything started: exit 2, like a bad config."""

    def __init__(self, problems: list[str], hint: str) -> None:
        super().__init__(problems, hint)
        lines = "\n".join(f"  - {problem}" for problem in self.problems)
        self.args = (f"this machine cannot run the job:\n{lines}\n{hint}",)


def gate_failures(verdicts: list[Verdict]) -> list[str]:
    """One line per failed gate verdict: reason and fix."""
    return [f"{v.rule}: {v.reason}" + (f"; fix: {v.fix}" if v.fix else "") for v in verdicts if v.status == "fail"]


def check_before_start(
    config: RunConfig | None,
    *,
    command: str,
    nproc: int,
    nnodes: int,
    config_path: str | None = None,
    enforce: bool = True,
) -> Facts | None:
    """Gather the facts; with ``enforce``, raise on any failed job check, print warnings.

    Returns the facts, which the NCCL settings are decided from; None when checks are
    off and the job is a single process (nothing to decide).

    Raises:
        JobCheckFailed: (a ``SkyliftConfigError``) a check failed; each line names the
            problem and its fix.
    """
    from skylift.doctor.gather import gather_facts
    from skylift.doctor.redact import Redactor
    from skylift.doctor.rules import evaluate

    if not enforce and nproc * nnodes == 1:
        return None
    source = None if config is not None else "launch"
    # The instance type only shapes the NCCL plan (EFA RDMA, Azure ND v5 topology): a job
    # without NCCL does not ask the metadata service for it; `skylift doctor` always does.
    import torch

    # Without the checks the facts only decide the NCCL settings, which need no memory estimate.
    facts = gather_facts(config, config_path=config_path, nproc=nproc, nnodes=nnodes, job_source=source,
                         probe_metadata=nproc * nnodes > 1 and torch.cuda.is_available(), job_memory=enforce)
    if not enforce:
        return facts
    redactor = Redactor()
    verdicts = evaluate(facts, gate_only=True)
    for verdict in verdicts:
        if verdict.status == "warn":
            print(
                redactor.text(f"skylift {command}: doctor warns: {verdict.reason}; fix: {verdict.fix}"), file=sys.stderr
            )
    failures = gate_failures(verdicts)
    if failures:
        again = f"skylift doctor --config {config_path}" if config_path else "skylift doctor"
        raise JobCheckFailed(
            [redactor.text(line) for line in failures],
            hint=f"Nothing was started. Full report: {again}. Start anyway with --no-doctor.",
        )
    return facts
