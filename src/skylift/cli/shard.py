"""``skylift shard SOURCE DEST``: write a dataset as tar shards plus an index."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="'digits', an image folder (<class>/<image>), or a .jsonl/.csv file")
    parser.add_argument("dest", help="a local folder or s3://, oss://, cos:// URL")
    parser.add_argument("--shard-size-mib", type=float, default=64.0, help="target shard size (default 64)")
    parser.add_argument("--endpoint-url", default=None, help="S3 API endpoint for S3-compatible stores")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def execute(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.progress import Progress

    from skylift.data import sources
    from skylift.data.shards import ShardWriter
    from skylift.storage import open_store

    kind = sources.describe_source(args.source)
    shard_size_bytes = int(args.shard_size_mib * 2**20)
    outputs = []
    with Progress(transient=True, disable=args.json) as progress:
        for split, samples, metadata in _splits(kind, args.source, sources):
            dest = f"{args.dest.rstrip('/')}/{split}" if split else args.dest
            writer = ShardWriter(open_store(dest, endpoint_url=args.endpoint_url), shard_size_bytes=shard_size_bytes)
            task = progress.add_task(f"sharding {split or Path(args.source).name}", total=None)
            for sample in samples:
                writer.add(sample)
                progress.advance(task)
            index = writer.close(metadata)
            outputs.append({"dest": dest, "samples": index.num_samples, "shards": len(index.shards),
                            "bytes": sum(shard.size for shard in index.shards), "reused_shards": writer.reused})
    if args.json:
        print(json.dumps(outputs, indent=2))
    else:
        for item in outputs:
            print(f"{item['dest']}: {item['samples']:,} samples in {item['shards']} shards "
                  f"({item['bytes'] / 2**20:.1f} MiB; {item['reused_shards']} already there)")
        print(f"Next: skylift run CONFIG --set data.url={outputs[0]['dest']}")
    return 0


def _splits(kind: str, source: str, sources):  # noqa: ANN001, ANN202
    from pathlib import Path

    if kind == "digits":
        classes = {"classes": [str(label) for label in range(10)]}
        return [("train", sources.digits_samples("train"), classes), ("val", sources.digits_samples("val"), classes)]
    if kind == "image_folder":
        classes, samples = sources.image_folder_samples(Path(source))
        return [("", samples, {"classes": classes})]
    return [("", sources.text_samples(Path(source)), {})]
