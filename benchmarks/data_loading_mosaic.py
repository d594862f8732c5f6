"""Contender (d) of the data-loading benchmark: MosaicML Streaming, run in its own venv.

mosaicml-streaming pins numpy < 2.2 and transformers < 5, which the project's venv does
not satisfy, so :mod:`benchmarks.data_loading` runs this file with
``benchmarks/.venvs/mosaic/bin/python`` (it imports neither skylift nor the
benchmarks package) and reads the JSON it prints on its last line:

    python data_loading_mosaic.py write --images DIR --count N --remote s3://B/mds --size-limit BYTES
    python data_loading_mosaic.py read --remote s3://B/mds --mode bytes|decoded --moto-pid PID ...

Reading follows Streaming's docs: ``StreamingDataset(remote=..., local=..., shuffle=True,
batch_size=B)`` under a DataLoader with the same batch size and worker count as the
other contenders. The endpoint comes from ``S3_ENDPOINT_URL``; the caller sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc (psutil is not in this venv)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def write(args: argparse.Namespace) -> dict[str, Any]:
    from streaming import MDSWriter

    folder = Path(args.images)
    with MDSWriter(out=args.remote, columns={"jpg": "bytes", "cls": "int"}, size_limit=args.size_limit) as writer:
        for index in range(args.count):
            writer.write({"jpg": (folder / f"{index:06d}.jpg").read_bytes(), "cls": index % args.num_classes})
    return {"written": args.count}


def _decode(sample: dict[str, Any]) -> Any:
    import torch
    from torchvision.io import ImageReadMode, decode_image

    image = decode_image(torch.frombuffer(bytearray(sample["jpg"]), dtype=torch.uint8), mode=ImageReadMode.RGB)
    return image, sample["cls"]


def _batch_shape(batch: Any) -> tuple[int, int]:
    if isinstance(batch[0], bytes):
        return len(batch), sum(len(data) for data in batch)
    images = batch[0]
    return int(images.shape[0]), images.numel() * images.element_size()


def _loader(args: argparse.Namespace, local: str) -> Any:
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader
    from torch.utils.data._utils.collate import default_collate

    decoded = args.mode == "decoded"

    class Dataset(StreamingDataset):
        def __getitem__(self, index: int) -> Any:
            sample = super().__getitem__(index)
            return _decode(sample) if decoded else sample["jpg"]

    dataset = Dataset(remote=args.remote, local=local, shuffle=True, batch_size=args.batch_size)
    return DataLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                      collate_fn=default_collate if decoded else list)


def read(args: argparse.Namespace) -> dict[str, Any]:
    """One pass, figures as ``benchmarks.data_loading_contenders.drain`` gives them."""
    from streaming.base.util import clean_stale_shared_memory

    clean_stale_shared_memory()
    local = tempfile.mkdtemp(prefix="mosaic-bench-")
    delivered, delivered_bytes, steady_samples, steady_bytes = 0, 0, 0, 0
    first_at = None
    started, moto_cpu_s = time.perf_counter(), process_cpu_s(args.moto_pid)
    try:
        for batch in _loader(args, local):
            samples, payload_bytes = _batch_shape(batch)
            delivered += samples
            delivered_bytes += payload_bytes
            if first_at is None:
                first_at = time.perf_counter()
                continue
            steady_samples += samples
            steady_bytes += payload_bytes
            if args.limit and steady_samples >= args.limit:
                break
        ended = time.perf_counter()
        moto_cpu_s = process_cpu_s(args.moto_pid) - moto_cpu_s
    finally:
        shutil.rmtree(local, ignore_errors=True)
    assert first_at is not None, "the loader delivered nothing"
    wall_s, steady_s = ended - started, ended - first_at
    return {
        "samples_per_s": round(delivered / wall_s, 2),
        "mb_per_s": round(delivered_bytes / wall_s / 1e6, 2),
        "steady_samples_per_s": round(steady_samples / steady_s, 2),
        "steady_mb_per_s": round(steady_bytes / steady_s / 1e6, 2),
        "delivered_samples": delivered,
        "wall_s": round(wall_s, 3),
        "first_batch_s": round(first_at - started, 3),
        "moto_cpu_share": round(moto_cpu_s / wall_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    writer = commands.add_parser("write")
    writer.add_argument("--images", required=True)
    writer.add_argument("--count", type=int, required=True)
    writer.add_argument("--num-classes", type=int, default=10)
    writer.add_argument("--remote", required=True)
    writer.add_argument("--size-limit", type=int, required=True)
    reader = commands.add_parser("read")
    reader.add_argument("--remote", required=True)
    reader.add_argument("--mode", choices=("bytes", "decoded"), required=True)
    reader.add_argument("--batch-size", type=int, default=32)
    reader.add_argument("--workers", type=int, default=2)
    reader.add_argument("--moto-pid", type=int, required=True)
    reader.add_argument("--limit", type=int, default=0, help="timed samples; 0: the whole epoch")
    args = parser.parse_args()
    result = write(args) if args.command == "write" else read(args)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
