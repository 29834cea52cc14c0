"""Datasets: edit this file to train on your own data.

What train.py and evaluate.py use from here:
- `DataConfig`: the `data:` section of config.yaml, each key with its default.
- `prepare_data(cfg)`: downloads or unpacks files, if a dataset needs that; it runs on
  one process per node at a time.
- `build_datasets(cfg) -> (train_dataset, val_dataset)`: runs on every process at once
  and only reads. A sample here is (image tensor [3, H, W], mask tensor [H, W] of class
  indices, 255 where no class counts).
- `collate_fn(samples) -> batch` (optional; this example has none): makes one batch
  from a list of samples when torch's default stacking does not fit.

Rules that keep distributed training correct:
- `__getitem__` returns fresh tensors, never an object the dataset keeps.
- Keep per-sample metadata in tensors or arrays, not Python lists of objects.
- Draw randomness from torch (e.g. torchvision transforms): the machinery seeds it per
  sample, so augmentations repeat exactly on resume and never repeat across ranks or workers.
- Nothing here is distributed: samplers and loaders are the machinery's.
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision import tv_tensors
from torchvision.transforms import v2

from engine.config import check_choice, check_positive
from engine.errors import ConfigError, UsageError

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
IGNORE = 255  # mask value of pixels that count for no class (VOC's object borders)


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic (made from the seed) | voc (image and mask folders, VOC layout)
    root: str = "data"  # voc: <root>/JPEGImages, <root>/SegmentationClass, <root>/ImageSets/Segmentation
    train_size: int = 1024  # synthetic only
    val_size: int = 256  # synthetic only
    num_classes: int = 4  # classes including background (0); VOC has 21
    image_size: int = 64  # images and masks are resized to this square
    augment: bool = True  # random crop and horizontal flip, applied alike to image and mask

    # Keys a resumed run may change: where the files are, how they are augmented.
    may_change_on_resume: ClassVar[tuple[str, ...]] = ("root", "augment")

    def __post_init__(self):
        check_choice("data.name", self.name, ("synthetic", "voc"))
        for key in ("train_size", "val_size", "image_size"):
            check_positive(f"data.{key}", getattr(self, key))
        if not 2 <= self.num_classes < IGNORE:
            raise ConfigError(f"data.num_classes must be in [2, {IGNORE}), got {self.num_classes}")


class DataError(UsageError):
    pass


def prepare_data(cfg) -> None:
    """Nothing to fetch: synthetic data is made from the seed, VOC folders are read."""


def build_datasets(cfg) -> tuple[Dataset, Dataset]:
    data = cfg.data
    train_tf = joint_transform(data.image_size, data.augment)
    val_tf = joint_transform(data.image_size, augment=False)
    if data.name == "synthetic":
        train = SyntheticShapes(data.train_size, data.num_classes, data.image_size, cfg.seed, "train", train_tf)
        val = SyntheticShapes(data.val_size, data.num_classes, data.image_size, cfg.seed, "val", val_tf)
        return train, val
    if data.name == "voc":
        root = Path(data.root)
        return ImageMaskFiles(root, "train", train_tf), ImageMaskFiles(root, "val", val_tf)
    raise ConfigError(f"unknown data.name {data.name!r}: add it to build_datasets in data.py")


def joint_transform(image_size: int, augment: bool) -> v2.Transform:
    """One transform for an (image, mask) pair: torchvision moves both alike and resizes
    masks with nearest-neighbour, so labels stay whole numbers."""
    steps = [v2.Resize((image_size, image_size))]
    if augment:
        pad = image_size // 8
        steps += [v2.RandomCrop(image_size, padding=pad, fill={tv_tensors.Mask: IGNORE}), v2.RandomHorizontalFlip()]
    return v2.Compose(
        [*steps, v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True), v2.Normalize(MEAN, STD)]
    )


class SyntheticShapes(Dataset):
    """Rectangles and ellipses of each foreground class on a noisy background, made from
    the seed alone: no download, the same on every rank. Each class has its own colour
    and the background its own texture, so a small network learns it in minutes.
    Stored as uint8 tensors (not lists of objects)."""

    def __init__(self, size, num_classes, image_size, seed, split, transform):
        colours = torch.rand(num_classes, 3, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed * 2 + (split == "val") + 1)
        masks = torch.zeros(size, image_size, image_size, dtype=torch.uint8)
        ys, xs = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
        for mask in masks:
            for _ in range(int(torch.randint(1, 4, (), generator=g))):
                cls = int(torch.randint(1, num_classes, (), generator=g))
                cy, cx = torch.randint(image_size, (2,), generator=g).tolist()
                h, w = torch.randint(max(1, image_size // 8), max(2, image_size // 3), (2,), generator=g).tolist()
                if torch.rand((), generator=g) < 0.5:
                    inside = ((ys - cy).abs() <= h) & ((xs - cx).abs() <= w)
                else:
                    inside = ((ys - cy) / h) ** 2 + ((xs - cx) / w) ** 2 <= 1
                mask[inside] = cls
        images = colours[masks.long()].permute(0, 3, 1, 2)  # each pixel its class's colour
        images = images + 0.25 * torch.randn(images.shape, generator=g)
        self.images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        self.masks = masks
        self.transform = transform

    def __len__(self):
        return len(self.masks)

    def __getitem__(self, index):
        image = tv_tensors.Image(self.images[index].clone())
        mask = tv_tensors.Mask(self.masks[index].clone())
        image, mask = self.transform(image, mask)
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor).long()


class ImageMaskFiles(Dataset):
    """Images and masks in the PASCAL VOC layout: <root>/ImageSets/Segmentation/<split>.txt
    lists ids; <root>/JPEGImages/<id>.jpg is the image and <root>/SegmentationClass/<id>.png
    the mask, one class index per pixel (a palette PNG), 255 for pixels to ignore.

    The ids live in one numpy byte-string array, not a list of Python strings, so
    DataLoader workers do not copy them page by page."""

    def __init__(self, root: Path, split: str, transform):
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise DataError(
                f"data.root: {str(listing)!r} is missing; expected the VOC layout "
                "<root>/ImageSets/Segmentation/{train,val}.txt, <root>/JPEGImages, <root>/SegmentationClass"
            )
        ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
        if not ids:
            raise DataError(f"data.root: {str(listing)!r} lists no images")
        self.root, self.transform = root, transform
        self.ids = np.array([os.fsencode(i) for i in ids])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        name = os.fsdecode(self.ids[index])
        image = read_image(self.root / "JPEGImages" / f"{name}.jpg", "RGB")
        mask = read_image(self.root / "SegmentationClass" / f"{name}.png", None)
        image = tv_tensors.Image(torch.from_numpy(np.array(image)).permute(2, 0, 1))
        mask = tv_tensors.Mask(torch.from_numpy(np.array(mask)))
        image, mask = self.transform(image, mask)
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor).long()


def read_image(path: Path, mode: str | None):
    from PIL import Image

    try:
        with Image.open(path) as image:
            return image.convert(mode) if mode else image.copy()  # a mask keeps its palette indices
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path}: {error}") from None
