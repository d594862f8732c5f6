"""ResNet training steps and the JPEG input pipeline on this CPU.

Part one, training: torchvision ResNet-50 (``--model resnet18`` for the small one, 1,000
classes, random weights) trained on one fixed synthetic batch (``--batch-size`` 32,
``--image-size`` 112 px by default: 224 px on two cores takes minutes per contender),
cross-entropy with label smoothing 0.1 and SGD with Nesterov momentum built by skylift's
``build_optimizer`` (the recipe of ``examples/resnet50-imagenet-8gpu.yaml``). Contenders,
each with its own copy of the same initial weights:

* ``fp32_nchw`` (the reference), ``bf16_nchw`` (autocast), ``fp32_channels_last``,
  ``bf16_channels_last``; bf16 autocast is skipped, with the reason recorded, on a CPU
  that :mod:`skylift.train.precision` says has no native bf16 (what ``precision: auto``
  decides on);
* ``compile_fp32_channels_last``: the model wrapped in ``torch.compile`` (as skylift's
  runtime does with ``compile.enabled``); its first step, which compiles forward and
  backward, is reported as ``first_step_s``/``compile_s`` and excluded from images/s.
  The Inductor cache is a fresh temporary folder, so the compile time is a cold one
  (``--warm-compile-cache`` keeps the user's cache).

Every contender runs ``--warmup-steps`` untimed steps, then all run in rounds, always
in the same order (A B C D E A B C D E ...), ``--steps-per-round`` steps each, so that
the load from other processes falls on all of them alike; reported per contender: the
median of the rounds' images/s, its ratio to ``fp32_nchw`` (of medians, and the median
of per-round ratios) and the CPU share (CPU time / (wall time x threads); well below
1 means other processes took cores).

Part two, input: the training decode path alone, ``EncodedImages`` with
``ImageDecoder(train=True)`` (decode + RandomResizedCrop(scale 0.08-1) + flip + float +
normalize, with the per-sample seeded augmentation) over JPEGs that ``shapes()``
generates: its default 64-160 px images, and ~500x375 px ones (``min_size`` 375,
``max_size`` 500: ImageNet's typical size, which cannot be downloaded here), in this
process with ``torch.set_num_threads(1)``, so the rate is images/s per core. Crops at
the training crop size, and at 224 px on the large JPEGs (the ImageNet recipe's crop).
Then "decode cores per training process" = a contender's training images/s divided by
the decode images/s per core at the same crop.

``python -m benchmarks.resnet_cpu [--quick] [--out benchmarks/results/resnet_cpu.json]``
"""

from __future__ import annotations

import argparse
import copy
import gc
import io
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.common import clock, environment, summarize, window_rates, write_report

REFERENCE = "fp32_nchw"
CONTENDERS = ("fp32_nchw", "bf16_nchw", "fp32_channels_last", "bf16_channels_last", "compile_fp32_channels_last")
NUM_CLASSES = 1000
SEED = 0
LABEL_SMOOTHING = 0.1
# SGD as in resnet50-imagenet-8gpu.yaml, with a learning rate small enough that random
# data cannot drive the weights to inf/NaN (or denormals, which are slow on x86) mid-run.
OPTIM = {"name": "sgd", "lr": 1e-3, "momentum": 0.875, "nesterov": True, "weight_decay": 1 / 16384,
         "implementation": "foreach"}  # fmt: skip
SMALL_JPEGS = {"min_size": 64, "max_size": 160}  # shapes()'s defaults
IMAGENET_LIKE_JPEGS = {"min_size": 375, "max_size": 500}  # ~437x437 px on average, as many pixels as 500x375
RESULTS_DIR = Path(__file__).parent / "results"


@dataclass
class Contender:
    name: str
    precision: str  # "fp32" or "bf16"
    channels_last: bool
    compiled: bool
    skipped: str | None = None
    step: Callable[[], None] | None = None
    warmup_s: list[float] = field(default_factory=list)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table; numbers right-aligned."""
    def cell(value: Any) -> str:
        return "" if value is None else str(value)

    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def imagenet_like_jpegs(num_samples: int, seed: int) -> tuple[list[bytes], list[int]]:
    """``shapes()`` JPEGs of ImageNet's typical size (each side 375-500 px, ~190k pixels)."""
    from skylift.data.images import shapes

    return shapes(num_samples, seed, **IMAGENET_LIKE_JPEGS)


def jpeg_stats(images: Sequence[bytes]) -> dict[str, float]:
    """Mean bytes and pixels of encoded images (ImageNet's training JPEGs average ~110 kB, ~400x350 px)."""
    from PIL import Image

    pixels = []
    for data in images:
        with Image.open(io.BytesIO(data)) as picture:
            pixels.append(picture.width * picture.height)
    return {"count": len(images), "mean_kib": round(statistics.mean(len(d) for d in images) / 1024, 1),
            "mean_pixels": round(statistics.mean(pixels))}  # fmt: skip


# -- part one: training steps ---------------------------------------------------------


def build_contenders(args: argparse.Namespace) -> list[Contender]:
    from types import SimpleNamespace

    from skylift.config.optim import OptimConfig
    from skylift.errors import SkyliftConfigError
    from skylift.recipes.image_classification import build_model
    from skylift.train.optim import build_optimizer
    from skylift.train.precision import DeviceInfo, resolve_precision

    cpu = torch.device("cpu")
    device_info = DeviceInfo.detect(cpu)
    torch.manual_seed(SEED)
    base = build_model(SimpleNamespace(name=args.model, args={}), NUM_CLASSES)
    generator = torch.Generator().manual_seed(SEED)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator)
    contenders = []
    for name in CONTENDERS:
        precision = "bf16" if name.startswith("bf16") else "fp32"
        contender = Contender(name, precision, channels_last="channels_last" in name, compiled=name.startswith("compile"))
        contenders.append(contender)
        if contender.compiled and not args.compile:
            contender.skipped = args.compile_skip_reason
            continue
        try:
            policy = resolve_precision(precision, device_info)  # bf16: raises when the CPU has no native bf16
        except SkyliftConfigError as error:
            contender.skipped = f"no native bf16 on this CPU ({device_info.name}): {error}"
            continue
        model = copy.deepcopy(base).train()
        batch = images.clone()
        if contender.channels_last:
            model = model.to(memory_format=torch.channels_last)
            batch = batch.contiguous(memory_format=torch.channels_last)
        optimizer = build_optimizer(model, OptimConfig(**OPTIM), cpu)
        forward = torch.compile(model) if contender.compiled else model
        contender.step = make_step(forward, optimizer, policy.autocast("cpu"), batch, labels.clone())
    del base
    return contenders


def make_step(model: Any, optimizer: torch.optim.Optimizer, autocast: Any, images: torch.Tensor,
              labels: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        with autocast:
            loss = F.cross_entropy(model(images), labels, label_smoothing=LABEL_SMOOTHING)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure_training(args: argparse.Namespace, threads: int) -> dict[str, Any]:
    contenders = build_contenders(args)
    active = [c for c in contenders if c.step is not None]
    for contender in active:
        for _ in range(args.warmup_steps):
            started = time.perf_counter()
            contender.step()
            contender.warmup_s.append(time.perf_counter() - started)
        print(f"  warm-up {contender.name:<28} steps: {', '.join(f'{s:.2f}' for s in contender.warmup_s)} s")
    runs: dict[str, list[dict[str, float]]] = {c.name: [] for c in active}
    samples = args.batch_size * args.steps_per_round
    for round_index in range(args.rounds):
        for contender in active:  # the same order every round: A B C D E A B C D E ...
            gc.collect()
            start = clock()
            for _ in range(args.steps_per_round):
                contender.step()
            run = window_rates(start, clock(), samples, threads)
            runs[contender.name].append(run)
            print(f"  round {round_index + 1}/{args.rounds} {contender.name:<28} {run['samples_per_s']:8.2f} images/s, "
                  f"CPU share {run['cpu_share']:.2f}")  # fmt: skip
    reference = REFERENCE if REFERENCE in runs else next(iter(runs))
    summary = summarize(runs, reference)
    for contender in active:
        row = summary[contender.name]
        row["warmup_step_s"] = [round(s, 3) for s in contender.warmup_s]
        row["step_s"] = round(args.batch_size / row["samples_per_s"], 4)
        if contender.compiled:
            # The first call compiles forward and (lazily, at the first backward) backward.
            row["first_step_s"] = round(contender.warmup_s[0], 2)
            row["compile_s"] = round(max(0.0, contender.warmup_s[0] - row["step_s"]), 2)
    skipped = {c.name: c.skipped for c in contenders if c.skipped}
    return {"reference": reference, "contenders": summary, "skipped": skipped}


# -- part two: the JPEG decode path ---------------------------------------------------


def measure_decoding(args: argparse.Namespace, training: dict[str, Any]) -> dict[str, Any]:
    from skylift.data.images import EncodedImages, ImageDecoder, ImageTransformSpec, shapes

    sets = {
        "shapes_64-160px": shapes(args.decode_images, SEED, **SMALL_JPEGS),
        "imagenet_like_375-500px": imagenet_like_jpegs(args.decode_images, SEED),
    }
    cases = [(set_name, args.image_size) for set_name in sets]
    if args.image_size != 224 and not args.quick:
        cases.append(("imagenet_like_375-500px", 224))
    datasets = {}
    for set_name, crop in cases:
        spec = ImageTransformSpec(crop_size=crop, resize_size=round(crop / 0.875))
        images, labels = sets[set_name]
        datasets[(set_name, crop)] = EncodedImages(images, labels, ImageDecoder(spec, train=True), SEED)
    threads_before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for dataset in datasets.values():  # warm-up: first-call costs of decoder and kernels
            for index in range(min(4, len(dataset))):
                dataset[(0, index)]
        runs: dict[tuple[str, int], list[dict[str, float]]] = {case: [] for case in datasets}
        for round_index in range(args.decode_rounds):
            for case, dataset in datasets.items():
                start = clock()
                for index in range(len(dataset)):
                    dataset[(round_index + 1, index)]  # a new epoch: other crops and flips
                run = window_rates(start, clock(), len(dataset), 1)
                runs[case].append(run)
                print(f"  decode round {round_index + 1}/{args.decode_rounds} {case[0]} crop {case[1]}: "
                      f"{run['samples_per_s']:7.1f} images/s/core, CPU share {run['cpu_share']:.2f}")  # fmt: skip
    finally:
        torch.set_num_threads(threads_before)
    results = {}
    for (set_name, crop), case_runs in runs.items():
        rates = [run["samples_per_s"] for run in case_runs]
        results[f"{set_name}_crop{crop}"] = {
            "jpegs": set_name, "crop_px": crop, **jpeg_stats(sets[set_name][0]),
            "images_per_s_per_core": round(statistics.median(rates), 2),
            "all_images_per_s_per_core": [round(rate, 2) for rate in rates],
            "all_cpu_share": [round(run["cpu_share"], 3) for run in case_runs],
        }  # fmt: skip
    cores = {}
    for name, row in training["contenders"].items():
        cores[name] = {key: round(row["samples_per_s"] / case["images_per_s_per_core"], 3)
                       for key, case in results.items() if case["crop_px"] == args.image_size}  # fmt: skip
    return {"per_core": results, "decode_cores_per_training_process": cores}


# -- report ---------------------------------------------------------------------------


def print_report(config: dict[str, Any], results: dict[str, Any]) -> None:
    training, decoding = results["training"], results["decoding"]
    reference = training["reference"]
    print(f"\n### {config['model']} training on CPU: {config['image_size_px']} px, batch {config['batch_size']}, "
          f"{config['threads']} threads, median of {config['rounds']} rounds x {config['steps_per_round']} steps\n")
    rows = []
    for name in CONTENDERS:
        if name in training["contenders"]:
            row = training["contenders"][name]
            compile_s = f"{row['compile_s']:.1f}" if "compile_s" in row else ""
            rows.append((name, f"{row['samples_per_s']:.2f}", f"{row[f'ratio_to_{reference}']:.3f}",
                         f"{row[f'paired_ratio_to_{reference}']:.3f}", f"{row['step_s']:.3f}", compile_s,
                         f"{min(row['all_cpu_share']):.2f}", ""))  # fmt: skip
        else:
            rows.append((name, "", "", "", "", "", "", training["skipped"].get(name, "")))
    print(markdown_table(("contender", "images/s", f"ratio to {reference}", "paired ratio", "step s", "compile s",
                          "min CPU share", "note"), rows))  # fmt: skip
    print("\n### JPEG decode + RandomResizedCrop + flip + normalize, one thread\n")
    rows = [(key, f"{case['mean_pixels']:,}", f"{case['mean_kib']:.1f}", case["crop_px"],
             f"{case['images_per_s_per_core']:.1f}", f"{min(case['all_cpu_share']):.2f}")
            for key, case in decoding["per_core"].items()]  # fmt: skip
    print(markdown_table(("JPEGs", "mean pixels", "mean KiB", "crop px", "images/s per core", "min CPU share"), rows))
    print(f"\n### Decode cores needed per training process (training images/s / decode images/s per core, "
          f"crop {config['image_size_px']} px)\n")
    keys = [key for key, case in decoding["per_core"].items() if case["crop_px"] == config["image_size_px"]]
    rows = [(name, *(f"{by_key[key]:.3g}" for key in keys))
            for name, by_key in decoding["decode_cores_per_training_process"].items()]
    print(markdown_table(("contender", *keys), rows))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: resnet18, 64 px, batch 8, 1 warm-up step, 2 rounds x 1 step, no compile, "
                             "16 JPEGs per set")  # fmt: skip
    parser.add_argument("--model", choices=("resnet50", "resnet18"), help="default resnet50 (quick: resnet18)")
    parser.add_argument("--image-size", type=int, help="training crop in px (default 112, quick 64)")
    parser.add_argument("--batch-size", type=int, help="default 32 (quick 8)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per contender (default 2, quick 1)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5, quick 2)")
    parser.add_argument("--steps-per-round", type=int, help="steps per contender per round (default 3, quick 1)")
    parser.add_argument("--threads", type=int,
                        help="intra-op threads for training (default: torch's, one per core); on a loaded machine "
                             "fewer threads than cores avoids OpenMP stalls")  # fmt: skip
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="include the torch.compile contender (default on; off with --quick)")
    parser.add_argument("--warm-compile-cache", action="store_true",
                        help="use the user's Inductor cache instead of a fresh one (compile time then not cold)")
    parser.add_argument("--decode-images", type=int, help="JPEGs per set (default 200, quick 16)")
    parser.add_argument("--decode-rounds", type=int, help="passes over each set (default 3, quick 1)")
    parser.add_argument("--out", "--output", dest="out", type=Path,
                        help="JSON path (default benchmarks/results/resnet_cpu.json, quick resnet_cpu_quick.json)")
    args = parser.parse_args(argv)
    quick = args.quick
    args.model = args.model or ("resnet18" if quick else "resnet50")
    args.image_size = args.image_size or (64 if quick else 112)
    args.batch_size = args.batch_size or (8 if quick else 32)
    args.warmup_steps = args.warmup_steps or (1 if quick else 2)
    args.rounds = args.rounds or (2 if quick else 5)
    args.steps_per_round = args.steps_per_round or (1 if quick else 3)
    args.decode_images = args.decode_images or (16 if quick else 200)
    args.decode_rounds = args.decode_rounds or (1 if quick else 3)
    if args.compile is None:
        args.compile = not quick
        args.compile_skip_reason = "skipped with --quick (a cold CPU compile takes minutes); pass --compile"
    else:
        args.compile_skip_reason = "skipped: --no-compile"
    args.out = args.out or RESULTS_DIR / f"resnet_cpu{'_quick' if quick else ''}.json"
    if min(args.image_size, args.batch_size, args.warmup_steps, args.rounds, args.steps_per_round,
           args.decode_images, args.decode_rounds) < 1:  # fmt: skip
        parser.error("sizes, steps and rounds must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
    started_s = time.perf_counter()
    threads = args.threads or torch.get_num_threads()
    torch.set_num_threads(threads)
    cache_dir = None
    if args.compile and not args.warm_compile_cache:
        cache_dir = tempfile.mkdtemp(prefix="skylift-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # read when Inductor first compiles
    load_start = os.getloadavg()[0]
    try:
        print(f"training: {args.model}, {args.image_size} px, batch {args.batch_size}, {threads} threads")
        training = measure_training(args, threads)
    finally:
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
    gc.collect()
    print("decoding: one thread")
    decoding = measure_decoding(args, training)
    results = {"training": training, "decoding": decoding}
    config = {
        "model": f"{args.model} (torchvision, random weights, {NUM_CLASSES} classes)", "image_size_px": args.image_size,
        "batch_size": args.batch_size, "input": "one fixed synthetic batch (torch.randn), reused every step",
        "loss": f"cross-entropy, label smoothing {LABEL_SMOOTHING}", "optimizer": OPTIM,
        "warmup_steps": args.warmup_steps, "rounds": args.rounds, "steps_per_round": args.steps_per_round,
        "order": "the same every round (A B C D E A B C D E ...)",
        "compile": {"enabled": args.compile, "mode": "default", "what": "the model (as skylift's runtime does)",
                    "inductor_cache": "user's" if args.warm_compile_cache else "fresh temporary (cold compile)"},
        "decode": {"pipeline": "EncodedImages + ImageDecoder(train=True): decode_image, RandomResizedCrop "
                               "(scale 0.08-1), RandomHorizontalFlip, ToDtype(float32), Normalize",
                   "threads": 1, "images_per_set": args.decode_images, "rounds": args.decode_rounds,
                   "jpeg_quality": 90},
        "quick": args.quick, "load_average_1m_start": load_start, "load_average_1m_end": os.getloadavg()[0],
        **environment(threads, ("torch", "torchvision", "pillow", "skylift")),
    }  # fmt: skip
    return write_report(args.out, config, results, started_s, print_report)


if __name__ == "__main__":
    main()
