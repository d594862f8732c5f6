"""The built-in doctor rules, one module per area; importing this package registers them.

* :mod:`.stack`: driver, torch build and GPU architecture, precision, security fixes.
* :mod:`.resources`: /dev/shm, disk, device memory, CPUs against what the job needs.
* :mod:`.nccl`: the settings NCCL reads against the network this machine has.
"""

from __future__ import annotations

from skylift.doctor.rules import nccl, resources, stack

__all__ = ["nccl", "resources", "stack"]
