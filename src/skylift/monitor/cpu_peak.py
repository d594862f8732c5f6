"""A CPU's peak FLOP/s, MFU's denominator where no data sheet applies.

CPUs have no published per-dtype peak that torch's kernels reach, so the peak is measured:
the best rate of dense matmuls in the run's dtype on every thread torch trains with. Two
things made a naive measurement read low, and MFU read above 100%:

* **Another process on the core.** Timed by the wall clock, a matmul that waited for the
  core looks slow. The rate here is FLOPs over this process's CPU time (all its threads,
  ``getrusage``), times the threads: time the core spent on someone else is not counted.
* **One short measurement.** The best of many calls of two sizes (a small one that fits
  a time slice and the cache, a large one that needs the memory system), for about half
  a second; and every measurement on this machine, kept in a small cache per machine,
  kernel family, torch version, thread count and dtype, raises the peak to the best seen,
  so one reading taken on a busy machine does not stay the run's peak.

The cache is a JSON file of numbers (never unpickled): ``$SKYLIFT_CACHE_DIR`` or
``$XDG_CACHE_HOME/skylift`` or ``~/.cache/skylift``, file ``cpu_peak.json``. A cache that
cannot be read or written is measured around, and said at debug level: it only ever
raises a measured figure.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import resource
import time
from pathlib import Path

import torch

__all__ = ["cpu_peak_cache_path", "cpu_peak_key", "measure_cpu_peak_flops"]

log = logging.getLogger("skylift")

_SIZES = (512, 1024)
"""Square matmul sides: 512 fits the caches and a scheduler slice; 1024 is the size the
run's larger layers reach."""


def cpu_peak_cache_path() -> Path:
    """Where measured peaks are kept (``cpu_peak.json`` in skylift's cache folder)."""
    folder = os.environ.get("SKYLIFT_CACHE_DIR")
    if not folder:
        xdg = os.environ.get("XDG_CACHE_HOME")
        folder = os.path.join(xdg, "skylift") if xdg else os.path.expanduser("~/.cache/skylift")
    return Path(folder) / "cpu_peak.json"


def cpu_peak_key(dtype: torch.dtype, threads: int) -> str:
    """What the peak depends on: the CPU model, the kernel family torch picked on it (it
    changes with ``ATEN_CPU_CAPABILITY``), torch's version, the threads and the dtype."""
    capability = torch.backends.cpu.get_cpu_capability()
    dtype_name = str(dtype).removeprefix("torch.")
    return f"{_cpu_model()}|{capability}|torch {torch.__version__}|{threads} threads|{dtype_name}"


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, budget_s: float = 0.5, *,
                           cache_path: Path | None = None) -> float:
    """The peak FLOP/s of this process's torch threads at ``dtype``: this measurement's
    best matmul rate per CPU-second times the threads, or the best one this machine
    measured before (from the cache) when that is higher."""
    threads = torch.get_num_threads()
    measured = _best_matmul_rate(dtype, threads, budget_s)
    path = cpu_peak_cache_path() if cache_path is None else cache_path
    key = cpu_peak_key(dtype, threads)
    known = _read_cache(path)
    best = max(measured, float(known.get(key, 0.0)))
    if best > float(known.get(key, 0.0)):
        known[key] = best
        _write_cache(path, known)
    return best


def _best_matmul_rate(dtype: torch.dtype, threads: int, budget_s: float) -> float:
    best = 0.0
    generator = torch.Generator().manual_seed(0)
    for size in _SIZES:
        a = torch.randn(size, size, generator=generator).to(dtype)
        b = a.clone()
        flops = 2.0 * size**3
        torch.mm(a, b)  # the first call pays for allocation and kernel selection
        deadline = time.perf_counter() + budget_s / len(_SIZES)
        calls = 0
        while calls < 3 or (time.perf_counter() < deadline and calls < 200):
            cpu_before = _process_cpu_s()
            torch.mm(a, b)
            cpu_s = _process_cpu_s() - cpu_before
            # Per CPU-second of this process: time it did not run does not count. Linux sums
            # CPU time from the scheduler's nanosecond clock; a call it saw no time for
            # (another clock) is no reading. torch's idle OpenMP threads spin, so their CPU
            # time is counted, and a rate per thread never reads high from a thread that idled.
            if cpu_s > 0.0:
                best = max(best, flops * threads / cpu_s)
            calls += 1
    return best


def _process_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _read_cache(path: Path) -> dict[str, float]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as error:
        log.debug("CPU peak cache %s not read (%s); measuring without it", path, error)
        return {}
    if not isinstance(loaded, dict):
        return {}
    return {key: float(value) for key, value in loaded.items() if isinstance(value, (int, float)) and value > 0}


def _write_cache(path: Path, peaks: dict[str, float]) -> None:
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text(json.dumps(peaks, indent=1, sort_keys=True), encoding="utf-8")
        os.replace(temporary, path)  # ranks that measure at once: each file whole, the last one kept
    except OSError as error:
        log.debug("CPU peak cache %s not written (%s)", path, error)
        with contextlib.suppress(OSError):  # the folder may be what could not be made
            temporary.unlink(missing_ok=True)
