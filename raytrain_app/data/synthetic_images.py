"""Built-in procedural image dataset: ten classes of small colour images, made in memory.

Every class is a pattern that a horizontal flip maps onto the same class (stripes, a
checkerboard, a disc, a ring, a square, a cross, a triangle), drawn at a random position,
size and phase, in a foreground colour that leans towards the class's own colour, on a
random background, with pixel noise. No downloads: the images are a deterministic
function of the seed and take milliseconds to generate, so every worker builds its own.

Training samples are augmented in ``__getitem__``, i.e. in the DataLoader's worker
processes: a random crop of the zero-padded image and a random horizontal flip. The
random draws come from a generator seeded by (seed, epoch, sample index), never from the
process's global RNG, so a sample looks the same for any world size, number of loader
processes or mid-epoch resume, and different in every epoch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from raytrain_app.errors import BadInputError
from raytrain_app.protocol import DataSplits

CLASS_NAMES = (
    "wide_horizontal_stripes",
    "narrow_horizontal_stripes",
    "wide_vertical_stripes",
    "narrow_vertical_stripes",
    "checkerboard",
    "disc",
    "ring",
    "square",
    "cross",
    "triangle",
)
# The colour each class's foreground leans towards: a cue, not a giveaway.
_CLASS_COLOURS = np.array(
    [
        [0.9, 0.1, 0.1],
        [0.1, 0.9, 0.1],
        [0.1, 0.1, 0.9],
        [0.9, 0.9, 0.1],
        [0.9, 0.1, 0.9],
        [0.1, 0.9, 0.9],
        [0.9, 0.5, 0.1],
        [0.5, 0.1, 0.9],
        [0.9, 0.9, 0.9],
        [0.5, 0.9, 0.5],
    ]
)
_COLOUR_WEIGHT = 0.4  # share of the class colour in the foreground, the rest is random
# Pixel statistics of the generated images, used to standardise them to about N(0, 1).
_PIXEL_MEAN = 0.36
_PIXEL_STD = 0.22

# The ``data.params`` this dataset takes, with their defaults (also in
# docs/users/built-in-workloads.md).
DEFAULTS = {
    "num_train": 4096,
    "num_val": 1024,
    "image_size": 32,
    "noise": 0.1,
    "pad": 4,  # zero padding of the random crop; 0 disables cropping
    "augment": True,
}
PARAMS = tuple(DEFAULTS)


class SyntheticImages(Dataset):
    """Standardised ``[3, size, size]`` images and integer labels, optionally augmented.

    Args:
        images: ``[N, 3, size, size]`` float32 tensor.
        labels: ``[N]`` int64 tensor.
        pad: zero padding of the random crop, in pixels; 0 disables cropping.
        augment: apply the random crop and horizontal flip.
        seed: seed of the augmentation draws.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, pad: int, augment: bool, seed: int
    ) -> None:
        self.images = images
        self.labels = labels
        self.pad = pad
        self.augment = augment
        self.seed = seed
        # In shared memory: DataLoader worker processes (persistent ones included) read the
        # epoch the training process sets, without being restarted.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose augmentation ``__getitem__`` draws (raytrain calls it)."""
        self._epoch.fill_(epoch)

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = self.images[index]
        if self.augment:
            image = self._augment(image, index)
        return image, self.labels[index]

    def _augment(self, image: torch.Tensor, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(
            _augment_seed(self.seed, int(self._epoch), int(index))
        )
        shift_y, shift_x = torch.randint(0, 2 * self.pad + 1, (2,), generator=generator).tolist()
        flip = bool(torch.randint(0, 2, (), generator=generator))
        if self.pad:
            size = image.shape[-1]
            padded = torch.nn.functional.pad(image, (self.pad,) * 4)
            image = padded[:, shift_y : shift_y + size, shift_x : shift_x + size]
        if flip:
            image = image.flip(-1)
        return image.contiguous()


def _augment_seed(seed: int, epoch: int, index: int) -> int:
    """A distinct generator seed per (seed, epoch, sample index)."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63


def _pattern(label: int, y, x, centre, radius, phase, size: int) -> np.ndarray:
    """Foreground coverage in [0, 1] of class ``label`` for the given per-image draws."""
    dy, dx = y - centre[0], x - centre[1]
    wide, narrow = 2 * np.pi * 2 / size, 2 * np.pi * 4 / size  # 2 and 4 cycles per image
    if label < 4:  # stripes: wide or narrow, horizontal or vertical
        frequency = wide if label % 2 == 0 else narrow
        along, offset = (y, phase[0]) if label < 2 else (x, phase[1])
        return 0.5 + 0.5 * np.sin(frequency * along + offset)
    if label == 4:  # checkerboard
        waves = np.sin(narrow * y + phase[0]) * np.sin(narrow * x + phase[1])
        return 0.5 + 0.5 * np.tanh(4 * waves)
    distance = np.sqrt(dy**2 + dx**2)
    box = np.maximum(np.abs(dy), np.abs(dx))
    if label == 5:  # disc
        return np.clip(radius - distance + 0.5, 0, 1)
    if label == 6:  # ring
        return np.clip(1.0 - np.abs(distance - radius), 0, 1)
    if label == 7:  # square
        return np.clip(radius - box + 0.5, 0, 1)
    if label == 8:  # cross
        return np.clip(1.0 - np.minimum(np.abs(dy), np.abs(dx)), 0, 1) * (box <= radius)
    # Triangle, apex up: symmetric under a horizontal flip, like every other class.
    return np.clip(np.minimum(radius - np.abs(dy), (dy + radius) / 2 - np.abs(dx)) + 0.5, 0, 1)


def _patterns(rng: np.random.Generator, labels: np.ndarray, size: int) -> np.ndarray:
    """Foreground coverage in [0, 1] of shape ``[N, size, size]`` for each label's pattern."""
    n = labels.shape[0]
    grid = np.arange(size, dtype=np.float32) + 0.5
    y, x = grid[None, :, None], grid[None, None, :]
    centre = rng.uniform(0.3 * size, 0.7 * size, (2, n, 1, 1)).astype(np.float32)
    radius = rng.uniform(0.15 * size, 0.3 * size, (n, 1, 1)).astype(np.float32)
    phase = rng.uniform(0, 2 * np.pi, (2, n, 1, 1)).astype(np.float32)
    coverage = np.empty((n, size, size), dtype=np.float32)
    for label in range(len(CLASS_NAMES)):
        chosen = labels == label
        pattern = _pattern(label, y, x, centre[:, chosen], radius[chosen], phase[:, chosen], size)
        coverage[chosen] = np.broadcast_to(pattern, (int(chosen.sum()), size, size))
    return coverage


def generate(
    num_samples: int, image_size: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``num_samples`` standardised images ``[N, 3, size, size]`` and their labels ``[N]``."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASS_NAMES), num_samples)
    coverage = _patterns(rng, labels, image_size)[:, None]
    mixed = rng.uniform(0, 1, (num_samples, 3))
    foreground = _COLOUR_WEIGHT * _CLASS_COLOURS[labels] + (1 - _COLOUR_WEIGHT) * mixed
    background = rng.uniform(0, 0.6, (num_samples, 3))
    shape = (num_samples, 3, image_size, image_size)
    images = rng.standard_normal(shape, dtype=np.float32)
    images *= noise
    images += background[:, :, None, None].astype(np.float32)
    images += (foreground - background)[:, :, None, None].astype(np.float32) * coverage
    images -= _PIXEL_MEAN
    images /= _PIXEL_STD
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def _check(params: Mapping[str, Any]) -> dict[str, Any]:
    """Params with defaults filled in; unknown or invalid values name their key."""
    unknown = sorted(set(params) - set(PARAMS))
    if unknown:
        raise BadInputError(
            f"unknown key 'data.params.{unknown[0]}' for synthetic_images; allowed keys are "
            f"{', '.join(PARAMS)}"
        )
    values = {**DEFAULTS, **params}
    for key, low in (("num_train", 1), ("num_val", 1), ("image_size", 8), ("pad", 0)):
        if not isinstance(values[key], int) or isinstance(values[key], bool) or values[key] < low:
            raise BadInputError(f"data.params.{key} must be an integer >= {low}")
    if not isinstance(values["noise"], int | float) or values["noise"] < 0:
        raise BadInputError("data.params.noise must be a number >= 0")
    if not isinstance(values["augment"], bool):
        raise BadInputError("data.params.augment must be true or false")
    if values["pad"] >= values["image_size"]:
        raise BadInputError("data.params.pad must be smaller than data.params.image_size")
    return values


def check(params: Mapping[str, Any]) -> None:
    """Validate ``data.params`` without generating anything (the driver's early check)."""
    _check(params)


def build(params: Mapping[str, Any], seed: int) -> DataSplits:
    """Protocol data factory: train (augmented) and validation (plain) images for ``seed``."""
    values = _check(params)
    num_train, num_val = values["num_train"], values["num_val"]
    images, labels = generate(
        num_train + num_val, values["image_size"], float(values["noise"]), seed
    )
    train = SyntheticImages(
        images[:num_train], labels[:num_train], values["pad"], values["augment"], seed
    )
    val = SyntheticImages(images[num_train:], labels[num_train:], 0, False, seed)
    info = {
        "num_classes": len(CLASS_NAMES),
        "in_channels": 3,
        "image_size": values["image_size"],
        "class_names": list(CLASS_NAMES),
    }
    return DataSplits(train=train, val=val, info=info)
