"""Encoded images on their way to a model: JPEG/PNG decode and torchvision v2 transforms.

Training crops and flips are drawn from a generator seeded by (run seed, epoch, sample
id), not from a DataLoader worker's stream: which worker handles a sample, and whether
the run was resumed mid-epoch, then change nothing, so a resumed run sees the same
augmented pixels as one that never stopped.

``shapes`` is the offline stand-in for a photo dataset: ten classes of drawn shapes
(circle, star, cross...) at random sizes, positions, rotations and colours on noisy
backgrounds, JPEG-encoded at sizes that differ from image to image, so it goes
through the same decode, RandomResizedCrop and collate path as ImageNet.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SHAPE_CLASSES",
    "DeviceDecoder",
    "EncodedBatch",
    "EncodedImage",
    "EncodedImages",
    "ImageDecoder",
    "ImageTransformSpec",
    "RawJpeg",
    "augmentation_seed",
    "encoded_collate",
    "seeded",
    "shapes",
]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
SHAPE_CLASSES = ["circle", "square", "triangle", "diamond", "pentagon", "hexagon", "star", "cross", "ring", "bar"]


def augmentation_seed(run_seed: int, epoch: int, sample_id: int) -> int:
    """A 63-bit seed per (run, epoch, sample): a SplitMix64-style mix, so neighbouring
    ids and epochs get unrelated streams."""
    value = (run_seed * 0x9E3779B97F4A7C15 + epoch * 0xBF58476D1CE4E5B9 + sample_id * 0x94D049BB133111EB)
    value &= 0xFFFFFFFFFFFFFFFF
    value ^= value >> 31
    value = (value * 0xD6E8FEB86659FD93) & 0xFFFFFFFFFFFFFFFF
    return (value ^ (value >> 32)) & 0x7FFFFFFFFFFFFFFF


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block on the CPU generator seeded with ``seed``, then restore the caller's
    state (in the main process, with ``num_workers: 0``, the model's dropout stream
    must not notice that a sample was augmented)."""
    # The CPU generator alone, saved and restored by hand: torch.random.fork_rng costs
    # ~125 us a call here against ~2 us, paid by every streamed sample.
    generator = torch.default_generator
    state = generator.get_state()
    generator.manual_seed(seed)
    try:
        yield
    finally:
        generator.set_state(state)


@dataclass(frozen=True)
class ImageTransformSpec:
    """The torchvision reference pipeline: RandomResizedCrop + flip for training,
    Resize + CenterCrop for evaluation, then float and normalisation."""

    crop_size: int = 224
    resize_size: int = 256
    scale: tuple[float, float] = (0.08, 1.0)
    hflip: bool = True
    mean: tuple[float, float, float] = IMAGENET_MEAN
    std: tuple[float, float, float] = IMAGENET_STD

    def build(self, train: bool):
        from torchvision.transforms import v2

        return v2.Compose([self.geometry(train), self.to_float()])

    def geometry(self, train: bool):
        """The per-image part: crops, resizes, flips (uint8 in, uint8 out)."""
        from torchvision.transforms import v2

        if train:
            steps = [v2.RandomResizedCrop(self.crop_size, scale=self.scale, antialias=True)]
            if self.hflip:
                steps.append(v2.RandomHorizontalFlip())
        else:
            steps = [v2.Resize(self.resize_size, antialias=True), v2.CenterCrop(self.crop_size)]
        return v2.Compose(steps)

    def to_float(self):
        """The elementwise part: float and normalisation (one image or a stacked batch)."""
        from torchvision.transforms import v2

        return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(self.mean, self.std)])


class ImageDecoder:
    """Encoded image bytes -> normalised float CHW tensor; a class (not a closure) so
    that DataLoader workers started by ``spawn`` can receive it too."""

    def __init__(self, spec: ImageTransformSpec, train: bool) -> None:
        self.spec, self.train = spec, train
        self.transform = spec.build(train)

    def __call__(self, data: bytes | torch.Tensor) -> torch.Tensor:
        from torchvision.io import ImageReadMode, decode_image

        buffer = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return self.transform(decode_image(buffer, mode=ImageReadMode.RGB))


@dataclass(frozen=True)
class EncodedImage:
    """A JPEG still encoded, with the augmentation seed its worker was given, for decoding
    on the device (``recipe.decode_on: device``)."""

    data: torch.Tensor
    seed: int


class RawJpeg:
    """The workers' part of decoding on the device: check the bytes are a JPEG, note the
    sample's seed (the one :func:`seeded` set), decode nothing."""

    def __init__(self, train: bool) -> None:
        self.train = train

    def __call__(self, data: bytes | torch.Tensor) -> EncodedImage:
        buffer = data if isinstance(data, torch.Tensor) else torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if buffer.numel() < 2 or buffer[0] != 0xFF or buffer[1] != 0xD8:
            raise ValueError("recipe.decode_on: device decodes JPEGs only (nvJPEG); this image is not a JPEG. "
                             "Use decode_on: workers, or re-encode the images as JPEG")
        return EncodedImage(buffer, torch.initial_seed())


@dataclass
class EncodedBatch:
    """A batch of still-encoded JPEGs and their labels; the runtime moves it as it is."""

    images: list[EncodedImage]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.images)


def encoded_collate(samples: list[tuple[EncodedImage, Any]]) -> EncodedBatch:
    return EncodedBatch([image for image, _ in samples], torch.as_tensor([int(label) for _, label in samples]))


class DeviceDecoder:
    """Decode a whole batch on the device (``torchvision.io.decode_jpeg(list, device=...)``:
    nvJPEG on a GPU), then crop, flip and normalise there: each image with the seed its
    worker noted, so the pixels equal those of decoding in the workers."""

    def __init__(self, spec: ImageTransformSpec, train: bool, channels_last: bool = False) -> None:
        self.train, self.channels_last = train, channels_last
        self.geometry, self.to_float = spec.geometry(train), spec.to_float()

    def __call__(self, batch: EncodedBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        from torchvision.io import ImageReadMode, decode_jpeg

        decoded = decode_jpeg([image.data for image in batch.images], mode=ImageReadMode.RGB, device=device)
        crops = []
        for image, pixels in zip(batch.images, decoded, strict=True):
            with seeded(image.seed) if self.train else contextlib.nullcontext():
                crops.append(self.geometry(pixels))
        # Elementwise, so once over the stacked batch: the same values, far fewer kernel launches.
        stacked = self.to_float(torch.stack(crops))
        if self.channels_last:
            stacked = stacked.contiguous(memory_format=torch.channels_last)
        return stacked, batch.labels.to(device, non_blocking=True)


class EncodedImages(Dataset):
    """Encoded images in memory with labels, decoded and transformed per access.

    A training set is indexed by ``(epoch, index)`` (``keyed_by_epoch``; the sampler
    yields such keys), so each sample's augmentation is fixed by the run seed, the
    epoch and the index; an evaluation set by the plain index.
    """

    def __init__(self, images: Sequence[bytes], labels: Sequence[int], decoder: ImageDecoder | RawJpeg,
                 seed: int) -> None:
        self.images, self.labels = list(images), torch.as_tensor(list(labels), dtype=torch.long)
        self.decoder, self.seed = decoder, seed
        self.keyed_by_epoch = decoder.train

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor | EncodedImage, torch.Tensor]:
        if isinstance(key, tuple):
            epoch, index = key
            with seeded(augmentation_seed(self.seed, epoch, index)):
                return self.decoder(self.images[index]), self.labels[index]
        return self.decoder(self.images[key]), self.labels[key]


def shapes(num_samples: int, seed: int, *, min_size: int = 64, max_size: int = 160,
           quality: int = 90) -> tuple[list[bytes], list[int]]:
    """``num_samples`` JPEGs (balanced over :data:`SHAPE_CLASSES`) and their labels, seeded."""
    rng = np.random.default_rng(seed)
    images, labels = [], []
    for index in range(num_samples):
        label = index % len(SHAPE_CLASSES)
        width, height = (int(side) for side in rng.integers(min_size, max_size + 1, size=2))
        picture = _draw(rng, SHAPE_CLASSES[label], width, height)
        buffer = io.BytesIO()
        picture.save(buffer, format="JPEG", quality=quality)
        images.append(buffer.getvalue())
        labels.append(label)
    order = rng.permutation(num_samples)
    return [images[i] for i in order], [labels[i] for i in order]


def _draw(rng: np.random.Generator, shape: str, width: int, height: int):
    from PIL import Image, ImageDraw

    background = rng.integers(0, 256, size=3)
    noise = rng.normal(0.0, 12.0, size=(height, width, 3))
    canvas = np.clip(background + noise, 0, 255).astype(np.uint8)
    picture = Image.fromarray(canvas)
    draw = ImageDraw.Draw(picture)
    for _ in range(int(rng.integers(0, 3))):  # distractor strokes that belong to no class
        points = [tuple(int(v) for v in rng.integers(0, (width, height))) for _ in range(2)]
        draw.line(points, fill=tuple(int(c) for c in rng.integers(0, 256, size=3)), width=int(rng.integers(1, 4)))
    # The shape's colour is kept well away from the background's, so it is always visible.
    colour = tuple(int(c) for c in (background + 96 + rng.integers(0, 64, size=3)) % 256)
    radius = float(rng.uniform(0.3, 0.45)) * min(width, height)
    centre = (float(rng.uniform(radius, width - radius)), float(rng.uniform(radius, height - radius)))
    _SHAPES[shape](draw, centre, radius, float(rng.uniform(0, 2 * math.pi)), colour)
    return picture


def _polygon(corners: int, inner: float | None = None):
    def draw(canvas, centre, radius, angle, colour) -> None:
        points = []
        for k in range(corners * (2 if inner else 1)):
            r = radius * (inner if inner and k % 2 else 1.0)
            theta = angle + k * math.pi / (corners if inner else corners / 2)
            points.append((centre[0] + r * math.cos(theta), centre[1] + r * math.sin(theta)))
        canvas.polygon(points, fill=colour)

    return draw


def _circle(canvas, centre, radius, angle, colour) -> None:
    canvas.ellipse([centre[0] - radius, centre[1] - radius, centre[0] + radius, centre[1] + radius], fill=colour)


def _ring(canvas, centre, radius, angle, colour) -> None:
    box = [centre[0] - radius, centre[1] - radius, centre[0] + radius, centre[1] + radius]
    canvas.ellipse(box, outline=colour, width=max(2, int(radius / 4)))


def _cross(canvas, centre, radius, angle, colour) -> None:
    for theta in (angle, angle + math.pi / 2):
        _bar(canvas, centre, radius, theta, colour)


def _bar(canvas, centre, radius, angle, colour) -> None:
    half = radius / 4
    dx, dy = math.cos(angle), math.sin(angle)
    corners = [(centre[0] + sx * radius * dx - sy * half * dy, centre[1] + sx * radius * dy + sy * half * dx)
               for sx, sy in ((1, 1), (1, -1), (-1, -1), (-1, 1))]
    canvas.polygon(corners, fill=colour)


_SHAPES = {
    "circle": _circle,
    "square": _polygon(4),
    "triangle": _polygon(3),
    "diamond": _polygon(2, inner=0.55),
    "pentagon": _polygon(5),
    "hexagon": _polygon(6),
    "star": _polygon(5, inner=0.45),
    "cross": _cross,
    "ring": _ring,
    "bar": _bar,
}
