"""Data loading from object storage: samples/s of four loaders against a loopback S3 server.

``python -m benchmarks.data_loading [--quick]`` writes
``benchmarks/results/data_loading[_quick].json``.

Same data for all: ``--images`` (5,000; 600 with ``--quick``) deterministic ~100 KB
256 x 256 JPEGs, on moto's S3 server in its own process on 127.0.0.1. Contenders, each
with 2 DataLoader workers and batches of 32 (see :mod:`benchmarks.data_loading_contenders`):
(a) per-object GETs, (b) skylift streaming, (c) WebDataset on the same tar shards,
(d) MosaicML Streaming on its MDS shards (in its own venv, created on first use).

Conditions: ``loopback`` (straight to moto) and ``latency_50ms`` (through
:mod:`benchmarks.latency_proxy`, which delays each response's first byte by 50 ms,
the latency loopback hides). Modes: ``bytes`` (raw JPEG bytes delivered) and
``decoded`` (JPEG -> uint8 tensors in the workers). Each figure spans the pass from
the loader's creation (``steady_samples_per_s``: after its first batch only, and
``first_batch_s`` apart): a whole epoch for the streaming loaders' bytes mode, ``--decoded-limit`` samples when
decoding (CPU-bound, the same work for all), ``--per-object-limit`` samples for the
per-object loader (~30 samples/s with latency: an epoch would take minutes). The
streaming loaders run ``--repeats`` times in rotated order and the median is kept;
beside each figure the CPU share of the moto process (CPU s / wall s: 1.0 = one of the
machine's two cores) and of the proxy. Finally ``skylift run`` trains ResNet-18 on the
CPU from the shards (``--train-conditions``) and reports the share of step time spent
waiting for data.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment
from benchmarks.data_loading_contenders import (
    BATCH_SIZE,
    NUM_WORKERS,
    FreshDir,
    drain,
    per_object_loader,
    skylift_loader,
    webdataset_loader,
)
from benchmarks.data_loading_data import (
    BUCKET,
    SHARD_SIZE_BYTES,
    generate_images,
    read_images,
    upload_dataset,
)
from benchmarks.data_loading_report import add_ratios, check_targets, markdown_table
from benchmarks.data_loading_servers import (
    Condition,
    CpuMeter,
    MotoProcess,
    open_condition,
    use_fake_credentials,
)
from benchmarks.data_loading_train import measure_data_wait

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).parent / "results"
MOSAIC_VENV = Path(__file__).parent / ".venvs" / "mosaic"
MOSAIC_SCRIPT = Path(__file__).parent / "data_loading_mosaic.py"
MOSAIC_REQUIREMENT = "mosaicml-streaming==0.13.0"
CONTENDERS = ("per_object", "skylift", "webdataset", "mosaic")
MODES = ("bytes", "decoded")
SHARDS_URL = f"s3://{BUCKET}/shards"
MDS_URL = f"s3://{BUCKET}/mds"
FACTS = [
    (
        "s3fs sends a HEAD before every GET when max_concurrency > 1, halving a loopback server's throughput: "
        "the WebDataset opener here uses one streamed boto3 GetObject per shard instead"
    ),
    (
        "moto's server is CPU-bound on this 2-core machine: its CPU share (CPU s / wall s) is reported beside "
        "every figure; near 1.0 the server, not the client, sets the pace"
    ),
]

log = logging.getLogger("benchmarks.data_loading")


def ensure_mosaic_venv() -> Path:
    """The venv's python with mosaicml-streaming, created on first use (its pins clash with
    the project's numpy and transformers); torch stays at the project's pin."""
    python = MOSAIC_VENV / "bin" / "python"
    probe = [str(python), "-c", "import streaming"]
    if python.exists() and subprocess.run(probe, check=False, capture_output=True).returncode == 0:
        return python
    log.warning("creating %s (one-off, a few minutes)", MOSAIC_VENV)
    subprocess.run([sys.executable, "-m", "venv", str(MOSAIC_VENV)], check=True)
    install = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
               "-c", str(ROOT / "requirements" / "constraints.txt"), MOSAIC_REQUIREMENT]
    subprocess.run(install, check=True)
    return python


def run_mosaic(python: Path, arguments: list[str], endpoint_url: str, timeout_s: float = 600) -> dict[str, Any]:
    env = {**os.environ, "S3_ENDPOINT_URL": endpoint_url, "PYTHONWARNINGS": "ignore"}
    finished = subprocess.run([str(python), str(MOSAIC_SCRIPT), *arguments], env=env, check=False, capture_output=True,
                              text=True, timeout=timeout_s)
    if finished.returncode:
        raise RuntimeError(f"mosaic {arguments[0]} failed:\n{finished.stderr[-3000:]}")
    return json.loads(finished.stdout.strip().splitlines()[-1])


def measure(contender: str, mode: str, condition: Condition, moto: MotoProcess, setup: dict[str, Any]) -> dict[str, Any]:
    pids = {"moto": moto.pid} | ({"proxy": condition.proxy.pid} if condition.proxy else {})
    meter, started = CpuMeter(pids), time.perf_counter()
    if contender == "per_object":
        limit = setup["per_object_limit"]
        result = drain(per_object_loader(setup["images"], condition.endpoint_url, mode), meter, started, limit)
        return {**result, "expected_samples": setup["images"] if limit is None else None, "limit_samples": limit}
    # Decoding is CPU-bound and the same for all: part of an epoch measures it as well.
    limit = setup["decoded_limit"] if mode == "decoded" else None
    expected = None if limit else setup["images"]
    if contender == "mosaic":
        arguments = ["read", "--remote", MDS_URL, "--mode", mode, "--batch-size", str(BATCH_SIZE),
                     "--workers", str(NUM_WORKERS), "--moto-pid", str(moto.pid), "--limit", str(limit or 0)]
        result = run_mosaic(setup["mosaic_python"], arguments, condition.endpoint_url)
    elif contender == "webdataset":
        result = drain(webdataset_loader(setup["shard_urls"], condition.endpoint_url, mode), meter, started, limit)
    else:
        with FreshDir() as cache_dir:
            loader = skylift_loader(SHARDS_URL, condition.endpoint_url, mode, cache_dir)
            result = drain(loader, meter, started, limit)
        # StreamingDataset drops the last partial global batch.
        expected = None if limit else setup["images"] // BATCH_SIZE * BATCH_SIZE
    return {**result, "expected_samples": expected, "limit_samples": limit}


def run_condition(name: str, latency_s: float, moto: MotoProcess, contenders: list[str], setup: dict[str, Any]) -> dict:
    """Per-object once (it is slow and far behind); the streaming loaders ``repeats`` times
    in rotated order, so that load from other processes on the machine spreads evenly."""
    condition = open_condition(name, latency_s, moto)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {name: {mode: [] for mode in MODES} for name in contenders}
    limited = dict(setup, per_object_limit=setup["per_object_limit"].get(name))
    streaming = [contender for contender in contenders if contender != "per_object"]
    try:
        for repeat in range(setup["repeats"]):
            rotated = streaming[repeat % len(streaming):] + streaming[: repeat % len(streaming)] if streaming else []
            for contender in (["per_object"] if repeat == 0 and "per_object" in contenders else []) + rotated:
                for mode in MODES:
                    result = measure(contender, mode, condition, moto, limited)
                    runs[contender][mode].append(result)
                    print(f"{name:>13} {contender:>10} {mode:>7}: {result['samples_per_s']:9.1f} samples/s "
                          f"{result['mb_per_s']:8.1f} MB/s  moto CPU {result['moto_cpu_share']:.2f}  "
                          f"load {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        condition.close()
    figures = {contender: {mode: _median_run(mode_runs) for mode, mode_runs in by_mode.items()}
               for contender, by_mode in runs.items()}
    return {"latency_s": latency_s, "endpoint": condition.endpoint_url, "contenders": figures}


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median samples/s (the lower middle one for an even count), plus every run's figure."""
    ordered = sorted(runs, key=lambda run: run["samples_per_s"])
    middle = dict(ordered[(len(ordered) - 1) // 2])
    middle["all_samples_per_s"] = [run["samples_per_s"] for run in runs]
    middle["all_steady_samples_per_s"] = [run["steady_samples_per_s"] for run in runs]
    middle["all_moto_cpu_share"] = [run["moto_cpu_share"] for run in runs]
    return middle


def prepare(args: argparse.Namespace, moto: MotoProcess, contenders: list[str]) -> dict[str, Any]:
    started = time.perf_counter()
    images = read_images(generate_images(args.images), args.images)
    index = upload_dataset(images, moto.endpoint_url)
    setup: dict[str, Any] = {
        "images": args.images,
        "shard_urls": [f"{SHARDS_URL}/{shard.name}" for shard in index.shards],
        "per_object_limit": {"loopback": args.per_object_limit_loopback, "latency_50ms": args.per_object_limit},
        "repeats": args.repeats,
        "decoded_limit": args.decoded_limit,
    }
    if "mosaic" in contenders:
        setup["mosaic_python"] = ensure_mosaic_venv()
        arguments = ["write", "--images", str(generate_images(args.images)), "--count", str(args.images),
                     "--remote", MDS_URL, "--size-limit", str(SHARD_SIZE_BYTES)]
        run_mosaic(setup["mosaic_python"], arguments, moto.endpoint_url)
    sizes = [len(data) for data in images]
    setup["dataset"] = {
        "images": len(images), "image_side_px": 256, "mean_jpeg_bytes": round(statistics.mean(sizes)),
        "total_mb": round(sum(sizes) / 1e6, 1), "skylift_shards": len(index.shards),
        "shard_size_bytes": SHARD_SIZE_BYTES, "prepare_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    return setup


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 images, short training run")
    parser.add_argument("--images", type=int, default=None)
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--conditions", default="loopback,latency_50ms")
    parser.add_argument("--latency-s", type=float, default=0.05)
    parser.add_argument("--per-object-limit", type=int, default=None, help="timed samples, latency condition")
    parser.add_argument("--per-object-limit-loopback", type=int, default=None)
    parser.add_argument("--decoded-limit", type=int, default=None, help="timed samples of streaming loaders, decoded")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each streaming loader (median kept)")
    parser.add_argument("--train-steps", type=int, default=None, help="0: no ResNet-18 run")
    parser.add_argument("--train-conditions", default="latency_50ms")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    args.images = args.images or (600 if args.quick else 5000)
    if args.per_object_limit is None:
        args.per_object_limit = 96 if args.quick else 960
    if args.per_object_limit_loopback is None and not args.quick:
        args.per_object_limit_loopback = 1920
    if args.decoded_limit is None and not args.quick:
        args.decoded_limit = 2400
    # Five, not three: single runs on this 2-core machine spread by about 20%, and a
    # median of three moved between full runs by as much.
    args.repeats = args.repeats or (1 if args.quick else 5)
    args.train_steps = (3 if args.quick else 6) if args.train_steps is None else args.train_steps
    args.output = args.output or RESULTS_DIR / ("data_loading_quick.json" if args.quick else "data_loading.json")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    use_fake_credentials()
    contenders = [name for name in args.contenders.split(",") if name]
    condition_names = [name for name in args.conditions.split(",") if name]
    started = time.perf_counter()
    moto = MotoProcess()
    try:
        setup = prepare(args, moto, contenders)
        conditions = {
            name: run_condition(name, 0.0 if name == "loopback" else args.latency_s, moto, contenders, setup)
            for name in condition_names
        }
        data_wait = train_runs(args, moto, condition_names)
    finally:
        moto.close()
    add_ratios(conditions)
    results = {
        "command": "python -m benchmarks.data_loading" + (" --quick" if args.quick else ""),
        "setup": {
            "workers": NUM_WORKERS, "batch_size": BATCH_SIZE, "latency_s": args.latency_s, "repeats": args.repeats,
            "per_object_limit_samples": setup["per_object_limit"], "decoded_limit_samples": args.decoded_limit,
            "train_steps": args.train_steps, "dataset": setup["dataset"],
        },
        "conditions": conditions,
        "data_wait": data_wait,
        "targets": check_targets(conditions, data_wait),
        "environment": {
            **environment(threads=NUM_WORKERS, packages=_versions(contenders)),
            "mosaicml_streaming": MOSAIC_REQUIREMENT if "mosaic" in contenders else None,
            "load_average_1_5_15_min_at_end": [round(value, 2) for value in os.getloadavg()],
        },
        "facts": FACTS,
        "total_s": round(time.perf_counter() - started, 1),
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(markdown_table(conditions))
    for name, target in results["targets"].items():
        print(f"{'met   ' if target['met'] else 'MISSED'} {name}: {target['measured']}")
    print(f"wrote {args.output} in {results['total_s']} s")
    return results


def train_runs(args: argparse.Namespace, moto: MotoProcess, condition_names: list[str]) -> dict[str, Any]:
    data_wait = {}
    for name in args.train_conditions.split(","):
        if not args.train_steps or name not in condition_names:
            continue
        condition = open_condition(name, 0.0 if name == "loopback" else args.latency_s, moto)
        try:
            data_wait[name] = measure_data_wait(SHARDS_URL, condition.endpoint_url, args.train_steps)
        finally:
            condition.close()
        print(f"{name:>13} ResNet-18 data wait share {data_wait[name]['data_wait_share']:.3f}", flush=True)
    return data_wait


def _versions(contenders: list[str]) -> tuple[str, ...]:
    names = ("torch", "torchvision", "boto3", "moto")
    return names + (("webdataset",) if "webdataset" in contenders else ())


if __name__ == "__main__":
    main()
