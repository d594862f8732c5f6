"""``skylift catalog``: the instances skylift can plan for, with sourced prices."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", action="append", default=[], metavar="MODEL",
                        help="only this GPU model, e.g. A100 (repeatable; A100 includes A100-80GB)")  # fmt: skip
    parser.add_argument("--provider", action="append", default=[], metavar="NAME",
                        help="only this cloud, e.g. aws or gcp (repeatable; any cloud skylift knows)")  # fmt: skip
    parser.add_argument("--spot", action="store_true", help="only rows with a spot price")
    parser.add_argument("--price-file", default=None, metavar="CSV",
                        help="your own prices laid over the shipped ones (columns: provider, instance_type, "
                        "region, on_demand_usd_per_hour, spot_usd_per_hour)")  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def execute(args: argparse.Namespace) -> int:
    from skylift.catalog import filter_rows, load_catalog
    from skylift.cloud.vendors import cloud_names
    from skylift.errors import SkyliftConfigError

    known = set(cloud_names())
    providers = [name.lower() for part in args.provider for name in part.split(",")]
    unknown = sorted(set(providers) - known)
    if unknown:
        raise SkyliftConfigError(f"--provider {', '.join(unknown)}: not a provider; use {', '.join(sorted(known))}",
                                 "list everything with: skylift catalog")  # fmt: skip
    gpus = [name for part in args.gpu for name in part.split(",")]
    rows = filter_rows(load_catalog(args.price_file), gpus=gpus, providers=providers, spot_only=args.spot)
    if args.json:
        print(json.dumps([{**row.model_dump(mode="json"), "spot_notice_window_s": row.spot_notice_window_s}
                          for row in rows], indent=2))  # fmt: skip
        return 0
    print(render_rows(rows))
    return 0


def render_rows(rows: list) -> str:  # rows: list[InstanceRow]
    """The rows as an aligned table, then the sources of the prices shown."""
    from skylift.machine.gpus import gpu_spec

    header = ("provider", "instance", "region", "gpus", "GiB/gpu", "vCPU", "RAM GiB", "link", "net Gb/s",
              "peak bf16 TF", "mem TB/s", "on-demand $/h", "spot $/h (cheapest zone)", "notice s")  # fmt: skip
    lines = [header]
    for row in rows:
        spec = gpu_spec(row.gpu_model)
        unverified = row.price_status == "price_unverified"
        lines.append((
            row.provider, row.instance_type + ("" if row.spec_checked else " *"), row.region,
            f"{row.gpu_count}x{row.gpu_model}", f"{row.gpu_memory_gib:g}", str(row.vcpus), f"{row.ram_gib:g}",
            row.gpu_interconnect,
            f"{row.network_gbps:g}" + ("" if row.network_fabric == "none" else f" {row.network_fabric}"),
            f"{spec.peak_tflops['half']:g}" if spec else "?",
            f"{spec.memory_bandwidth_bytes_per_s / 1e12:.2f}" if spec else "?",
            "price_unverified" if unverified else _usd(row.on_demand_usd_per_hour),
            "price_unverified" if unverified else _spot(row),
            f"{row.spot_notice_window_s:g}" if row.spot_notice_window_s else "?",
        ))  # fmt: skip
    widths = [max(len(line[column]) for line in lines) for column in range(len(header))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines]
    sources = sorted({f"{row.price_source} (read {row.price_read_on})" for row in rows if row.price_source})
    text.append(f"{len(rows)} rows; * = hardware figures not re-read at the source (see the row's spec_source); "
                "spot = the median zone's price, the cheapest zone's in brackets")
    text += ["prices: " + source for source in sources]
    return "\n".join(text)


def _usd(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def _spot(row) -> str:  # row: InstanceRow
    """The median zone's spot price, with the cheapest zone's beside it when it is lower."""
    cheapest = row.spot_cheapest_usd_per_hour
    if row.spot_usd_per_hour is None or cheapest is None or cheapest >= row.spot_usd_per_hour:
        return _usd(row.spot_usd_per_hour)
    return f"{_usd(row.spot_usd_per_hour)} ({_usd(cheapest)} {row.spot_cheapest_zone})"
