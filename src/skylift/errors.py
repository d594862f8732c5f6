"""Typed errors and the process exit codes skylift documents.

User mistakes raise :class:`SkyliftConfigError` (exit 2) with a message that names
the field and the fix; internal invariants use ``assert``.
"""

from __future__ import annotations

__all__ = [
    "EXIT_CONFIG_ERROR",
    "EXIT_FAILURE",
    "EXIT_GUARD",
    "EXIT_OK",
    "EXIT_REQUEUE",
    "SkyliftConfigError",
    "SkyliftError",
]

EXIT_OK = 0
"""The run finished."""
EXIT_FAILURE = 1
"""The run failed; the traceback or message says why."""
EXIT_CONFIG_ERROR = 2
"""The configuration or command line is invalid; nothing was started."""


class SkyliftError(Exception):
    """Base class of skylift's own errors."""


class SkyliftConfigError(SkyliftError, ValueError):
    """The configuration is invalid. ``str(error)`` names each bad field and its fix."""

    def __init__(self, problems: list[str] | str, hint: str | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.hint = hint
        lines = [f"  - {problem}" for problem in self.problems]
        text = "invalid configuration:\n" + "\n".join(lines)
        if hint:
            text += f"\n{hint}"
        super().__init__(text)

EXIT_GUARD = 3
"""Stopped by a guard (``monitor.guards``: the budget, an idle GPU, a stall): the state is
saved where a step boundary allowed; raise or remove the limit to resume. Below 128, so
schedulers that retry 128-255 (Kubeflow's ``restartPolicy: ExitCode``) do not retry it."""

EXIT_REQUEUE = 143
"""Preempted (spot notice or SIGTERM): the state is saved as far as the notice window
allowed; run the same command again to resume. 143 (128 + SIGTERM) because schedulers
such as Kubeflow's PyTorchJob ``restartPolicy: ExitCode`` retry codes 128-255 and treat
1-127 as permanent failures."""
