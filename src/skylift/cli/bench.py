"""``skylift bench CONFIG``: measure a short real run of the config on this machine."""

from __future__ import annotations

import argparse
import json

from skylift.cli.options import add_config_arguments


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--steps", type=int, default=20, help="measured optimizer steps after 3 warm-up (default 20)")
    parser.add_argument("--nproc", type=int, default=1, help="also run N processes and report 1 -> N scaling")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per process (default: CPUs / processes)")
    parser.add_argument("--no-save", action="store_true", help="do not write and time one checkpoint at the end")
    parser.add_argument("--json", action="store_true", help="print the measurement as JSON")


def execute(args: argparse.Namespace) -> int:
    from skylift.plan.bench import BenchRequest, run_bench

    request = BenchRequest(config_path=args.config, overrides=args.overrides, steps=args.steps, nproc=args.nproc,
                           threads_per_process=args.threads, measure_save=not args.no_save)  # fmt: skip
    measurement, path = run_bench(request)
    if args.json:
        print(json.dumps({**measurement.model_dump(mode="json"), "saved_to": str(path)}, indent=2))
        return 0
    print(render_measurement(measurement, path))
    return 0


def render_measurement(measurement, path) -> str:
    """A short human summary of a measurement."""
    m = measurement
    lines = [
        (f"skylift bench: {m.config_path} on {m.device_name} ({m.device}, {m.precision}), "
        f"{m.world_size} process(es) x {m.threads_per_process} thread(s), {m.measured_steps} steps measured"),
        f"  samples/s            {m.samples_per_s:.1f}",
        f"  step                 {m.step_time_s * 1000:.1f} ms = "
        + ", ".join(f"{phase} {seconds * 1000:.1f}" for phase, seconds in m.breakdown_s.items() if seconds > 0),
        f"  FLOPs/sample         {_maybe(m.flops_per_sample, '{:.3g}')}   MFU {_maybe(m.mfu, '{:.1%}')}",
        f"  model                {_maybe(m.model_bytes and m.model_bytes / 2**20, '{:.1f} MiB')}",
        (f"  peak memory          device "
         f"{_maybe(m.peak_device_memory_bytes and m.peak_device_memory_bytes / 2**30, '{:.2f} GiB')}"
        f", host {_maybe(m.peak_host_memory_bytes and m.peak_host_memory_bytes / 2**30, '{:.2f} GiB')}"),
        f"  checkpoint save      {_maybe(m.checkpoint_save_s, '{:.2f} s')}",
    ]
    if m.scaling:
        lines.append(f"  1 -> {m.scaling['nproc']} processes  {m.scaling['samples_per_s_n']:.1f} samples/s, "
                     f"efficiency {m.scaling['efficiency']:.0%}")  # fmt: skip
    lines += [f"  note: {note}" for note in m.notes]
    lines.append(f"saved to {path}; next: skylift plan {m.config_path} --epochs 10")
    return "\n".join(lines)


def _maybe(value, pattern: str) -> str:
    return "n/a" if value is None else pattern.format(value)
