"""Datasets: edit this file to train on your own data.

The example's synthetic data (data.name=synthetic) is in synthetic_data.py: once you use
your own data, delete that file and its import and branch here.

What train.py and evaluate.py use from here:
- `DataConfig`: the `data:` section of config.yaml, each key with its default.
- `prepare_data(cfg)`: downloads or unpacks files, if a dataset needs that; it runs on
  one process per node at a time.
- `build_datasets(cfg) -> (train_dataset, val_dataset)`: runs on every process at once
  and only reads. A sample here is (image tensor [3, H, W], mask tensor [H, W] of class
  indices, 255 where no class counts).
- `collate_fn(samples) -> batch` (optional; this example has none): makes one batch
  from a list of samples when torch's default stacking does not fit.
- `build_predict_set(cfg, source) -> dataset` (for predict.py): new inputs, pre-processed
  as validation samples are, each with its name: here (image tensor, file path) for every
  image file under the folder `source`.
- `build_augment(cfg, train_set) -> augment(batch) -> batch` (optional): called once, it
  returns the function that augments each whole training batch (e.g. torchvision's
  v2.MixUp or v2.CutMix, built here with what it needs of the data, such as its classes), on
  the device, before `training_step`; validation and prediction batches never pass through it.
- `train_order(num_samples, generator, cfg) -> indices` (optional): the epoch's order of
  training samples over all processes instead of a random permutation of them, e.g. each
  index repeated `cfg.data.repeats` times (a key you add to DataConfig: repeated
  augmentation); integer indices, in a list or a 1-D tensor. Draw from `generator`,
  seeded per epoch: every process must give the same order (checked once an epoch), and
  `torch.randperm(num_samples, generator=generator)` is the built-in order itself. The
  machinery deals it out to the processes in whole steps and resumes in it.

Rules that keep distributed training correct:
- `__getitem__` returns fresh tensors, never an object the dataset keeps.
- Keep per-sample metadata in tensors or arrays, not Python lists of objects.
- Randomness lives in two places, both drawn from torch and seeded by the machinery, so
  they repeat exactly on resume: a sample's transforms (seeded per sample: never repeated
  across ranks or workers) and `build_augment`'s function (seeded per training batch). Not in
  `collate_fn`, which validation batches pass through too.
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

from engine import ConfigError, UsageError, check_choice, check_positive
from synthetic_data import SyntheticShapes

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
        train = ImageMaskFiles(root, "train", data.num_classes, train_tf)
        return train, ImageMaskFiles(root, "val", data.num_classes, val_tf)
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


def build_predict_set(cfg, source: str) -> Dataset:
    """Every image file under the folder `source` (its sub-folders too), in sorted path
    order, resized and normalised as validation images are; a sample is (image, its path)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"--inputs: {source!r} is not a folder; give the folder that holds the images to predict")
    files = image_files(folder, IMG_EXTENSIONS)
    if not files:
        raise DataError(f"--inputs: {source!r} holds no image files ({', '.join(IMG_EXTENSIONS)}); add some")
    return ImagePaths(files, joint_transform(cfg.data.image_size, augment=False))


def image_files(folder: Path, extensions: tuple) -> list[str]:
    """The image files under `folder`, sorted, following links to folders as training's
    ImageFolder does. A folder met again (a link back up the tree, or a second link to one
    folder) is not listed again: a loop ends, and each image is listed once."""
    seen, files = set(), []
    for root, folders, names in os.walk(folder, followlinks=True):
        where = os.stat(root)
        if (where.st_dev, where.st_ino) in seen:
            folders.clear()
            continue
        seen.add((where.st_dev, where.st_ino))
        folders.sort()  # the first of two ways to a folder is the one listed, on every rank alike
        paths = (os.path.join(root, name) for name in names if os.path.splitext(name)[1].lower() in extensions)
        files += [path for path in paths if os.path.isfile(path)]
    return sorted(files)


class ImagePaths(Dataset):
    """Image files by path: (image, path) samples; the paths in one numpy byte-string array."""

    def __init__(self, paths: list[str], transform):
        self.paths = np.array([os.fsencode(path) for path in paths])
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path = os.fsdecode(self.paths[index])
        image = tv_tensors.Image(torch.from_numpy(np.array(read_image(Path(path), "RGB"))).permute(2, 0, 1))
        return self.transform(image).as_subclass(torch.Tensor), path


class ImageMaskFiles(Dataset):
    """Images and masks in the PASCAL VOC layout: <root>/ImageSets/Segmentation/<split>.txt
    lists ids; <root>/JPEGImages/<id>.jpg is the image and <root>/SegmentationClass/<id>.png
    the mask, one class index per pixel (a palette or greyscale PNG the image's size),
    255 for pixels to ignore.

    The ids live in one numpy byte-string array, not a list of Python strings, so
    DataLoader workers do not copy them page by page."""

    def __init__(self, root: Path, split: str, num_classes: int, transform):
        listing = root / "ImageSets" / "Segmentation" / f"{split}.txt"
        if not listing.is_file():
            raise DataError(
                f"data.root: {str(listing)!r} is missing; expected the VOC layout "
                "<root>/ImageSets/Segmentation/{train,val}.txt, <root>/JPEGImages, <root>/SegmentationClass"
            )
        ids = [line.strip() for line in listing.read_text().splitlines() if line.strip()]
        if not ids:
            raise DataError(f"data.root: {str(listing)!r} lists no images")
        self.root, self.num_classes, self.transform = root, num_classes, transform
        self.ids = np.array([os.fsencode(i) for i in ids])

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        name = os.fsdecode(self.ids[index])
        image_path = self.root / "JPEGImages" / f"{name}.jpg"
        mask_path = self.root / "SegmentationClass" / f"{name}.png"
        image = read_image(image_path, "RGB")
        mask = class_indices(read_image(mask_path, None), mask_path, image.size, self.num_classes)
        image = tv_tensors.Image(torch.from_numpy(np.array(image)).permute(2, 0, 1))
        mask = tv_tensors.Mask(torch.from_numpy(mask))
        image, mask = self.transform(image, mask)
        return image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor).long()


MASK_MODES = ("P", "L")  # PIL modes of one 8-bit value per pixel: palette, greyscale


def class_indices(mask, path: Path, image_size: tuple[int, int], num_classes: int) -> np.ndarray:
    """The mask's pixels as an array, checked: a mask must label its image's pixels
    with classes the model has; anything else trains on wrong labels, or fails deep in
    the loss."""
    if mask.mode not in MASK_MODES:
        raise DataError(
            f"mask {path} has PIL mode {mask.mode}, not one class index per pixel; "
            "save it as a palette (P) or greyscale (L) PNG of class indices"
        )
    if mask.size != image_size:
        raise DataError(
            f"mask {path} is {mask.size[0]}x{mask.size[1]} pixels but its image is {image_size[0]}x{image_size[1]}; "
            "a mask labels its image's pixels: make them the same size"
        )
    values = np.array(mask)
    classes = values[values != IGNORE]
    top = int(classes.max()) if classes.size else 0
    if top >= num_classes:
        raise DataError(
            f"mask {path} has class {top}, but data.num_classes={num_classes} allows 0 to {num_classes - 1} "
            f"({IGNORE}: ignored); set data.num_classes={top + 1} or fix the mask"
        )
    return values


def read_image(path: Path, mode: str | None):
    """The one place image and mask files are read: whatever is wrong with a file is
    one line naming it. `mode` None keeps the file's own (a mask keeps its indices)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert(mode) if mode else image.copy()
    except Image.DecompressionBombError:  # not an OSError: PIL refuses to decode it at all
        raise DataError(
            f"image {path} has more pixels than PIL opens (its guard against decompression bombs); resize it, "
            "or if images this large are intended, raise PIL.Image.MAX_IMAGE_PIXELS at the top of data.py"
        ) from None
    except FileNotFoundError:
        raise DataError(
            f"image {path} is missing; ImageSets/Segmentation lists its id: add the file or remove the id"
        ) from None
    except UnidentifiedImageError:
        what = "is empty (0 bytes)" if os.path.getsize(path) == 0 else "is not an image PIL can read"
        raise DataError(f"image {path} {what}; replace or remove it") from None
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read image {path}: {error}; replace or remove it") from None
