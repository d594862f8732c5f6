"""``skylift shard SOURCE DEST``: write a dataset as tar shards plus an index."""

from __future__ import annotations

import argparse
import json
import sys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        help="'digits', an image folder (<class>/<image>) in a local folder or at an s3://, oss://, cos:// URL, "
        "or a .jsonl/.csv file",
    )
    parser.add_argument("dest", help="a local folder or s3://, oss://, cos:// URL")
    parser.add_argument("--shard-size-mib", type=float, default=64.0, help="target shard size (default 64)")
    parser.add_argument(
        "--endpoint-url",
        default=None,
        help="S3 API endpoint for S3-compatible stores: the destination's, and the source's too when the source "
        "is an object store of the same scheme or the destination is local",
    )
    parser.add_argument(
        "--source-endpoint-url", default=None, help="S3 API endpoint of the source, when it differs from DEST's"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="images read in parallel (default 32 from an object store, 8 from a local folder)",
    )
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def execute(args: argparse.Namespace) -> int:
    from skylift.errors import SkyliftConfigError
    from skylift.storage import StorageError, StorageTransientError

    if args.workers is not None and args.workers < 1:
        raise SkyliftConfigError(f"--workers must be at least 1, got {args.workers}")
    try:
        outputs = _shard(args)
    except StorageError as error:  # mid-run: the shards written stay, and a rerun keeps them
        resume = "; run the same command again to resume" if isinstance(error, StorageTransientError) else ""
        print(f"skylift shard: {error}{resume}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(outputs, indent=2))
    else:
        for item in outputs:
            print(f"{item['dest']}: {item['samples']:,} samples in {item['shards']} shards "
                  f"({item['bytes'] / 2**20:.1f} MiB; {item['reused_shards']} already there)")
        print(f"Next: skylift run CONFIG --set data.url={outputs[0]['dest']}")
    return 0


def _shard(args: argparse.Namespace) -> list[dict]:
    from pathlib import Path

    from rich.progress import Progress

    from skylift.data.shards import ShardWriter

    shard_size_bytes = int(args.shard_size_mib * 2**20)
    outputs = []
    with Progress(transient=True, disable=args.json) as progress:
        for split, samples, metadata, total in _splits(args):
            dest = f"{args.dest.rstrip('/')}/{split}" if split else args.dest
            writer = ShardWriter(_open_dest(dest, args.endpoint_url), shard_size_bytes=shard_size_bytes)
            task = progress.add_task(f"sharding {split or Path(args.source.rstrip('/')).name}", total=total)
            for sample in samples:
                writer.add(sample)
                progress.advance(task)
            index = writer.close(metadata)
            outputs.append({"dest": dest, "samples": index.num_samples, "shards": len(index.shards),
                            "bytes": sum(shard.size for shard in index.shards), "reused_shards": writer.reused})
    return outputs


def _splits(args: argparse.Namespace):  # (split, samples, metadata, total) per split
    from pathlib import Path

    from skylift.data import sources

    kind = sources.describe_source(args.source)
    if kind == "digits":
        digit_classes = {"classes": [str(label) for label in range(10)]}
        return [("train", sources.digits_samples("train"), digit_classes, None),
                ("val", sources.digits_samples("val"), digit_classes, None)]  # fmt: skip
    if kind == "image_folder":
        from skylift.data.image_sources import open_image_folder

        folder = open_image_folder(args.source, endpoint_url=_source_endpoint(args))
        return [("", folder.samples(args.workers), {"classes": folder.classes}, len(folder.images))]
    # The class map travels in the index, so every rank and the validation split number
    # labels the same way (names sorted; integer labels as they are).
    from skylift.data import text_rows

    rows, classes = text_rows.text_classes(Path(args.source))
    return [("", text_rows.text_samples(Path(args.source)), {"classes": classes} if classes else {}, rows)]


def _source_endpoint(args: argparse.Namespace) -> str | None:
    """--source-endpoint-url, else --endpoint-url unless DEST is another kind of store (oss:// vs s3://)."""
    if args.source_endpoint_url:
        return args.source_endpoint_url
    source_scheme, dest_scheme = args.source.partition("://")[0], args.dest.partition("://")[0]
    dest_is_local = "://" not in args.dest or dest_scheme == "file"
    return args.endpoint_url if dest_is_local or source_scheme == dest_scheme else None


def _open_dest(dest: str, endpoint_url: str | None):  # a Store
    from skylift.errors import SkyliftConfigError
    from skylift.storage import StoragePermanentError, open_store

    try:
        return open_store(dest, endpoint_url=endpoint_url)
    except StoragePermanentError as error:  # unsupported scheme, no boto3, no endpoint for oss:// or cos://
        message = str(error) if dest.rstrip("/") in str(error) else f"{dest}: {error}"
        raise SkyliftConfigError(f"shard destination {message}") from None
