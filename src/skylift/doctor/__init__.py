"""``skylift doctor``: what is wrong with this machine for a training job, and the fix.

Three layers, each testable alone:

* :mod:`~skylift.doctor.gather` reads the machine into a typed
  :class:`~skylift.machine.facts.Facts` object (torch's build, NVML, /dev/shm, disks,
  network, cloud, the run config's needs);
* :mod:`~skylift.doctor.rules` is a table of small functions from facts to
  ``pass | info | warn | fail`` verdicts with the exact fix;
* :mod:`~skylift.doctor.render` prints them, redacted, as text or versioned JSON.

:mod:`~skylift.doctor.gate` runs the job-related rules before ``skylift run`` and
``skylift launch`` start workers; :mod:`~skylift.machine.nccl` decides the NCCL
variables those workers get. Heavy modules (torch, NVML) load only when gathering.
"""

from __future__ import annotations

__all__: list[str] = []
