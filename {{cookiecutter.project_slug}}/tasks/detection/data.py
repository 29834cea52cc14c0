"""Datasets: edit this file to train on your own data.

The example's synthetic data (data.name=synthetic) is in synthetic_data.py: once you use
your own data, delete that file and its branch in build_datasets.

What train.py and evaluate.py use from here:
- `DataConfig`: the `data:` section of config.yaml, each key with its default.
- `prepare_data(cfg)`: downloads or unpacks files, if a dataset needs that; it runs on
  one process per node at a time.
- `build_datasets(cfg) -> (train_dataset, val_dataset)`: runs on every process at once
  and only reads. A sample here is (image tensor [3, H, W] in [0, 1], target dict with
  "boxes" [K, 4] as x1, y1, x2, y2 in pixels and "labels" [K], 1..num_classes-1).
- `collate_fn(samples) -> batch`: images of different sizes with different numbers of
  boxes do not stack, so a batch is (list of images, list of targets).
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

import json
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


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic (made from the seed) | coco (COCO-format json and image folder)
    root: str = "data"  # coco: <root>/annotations/instances_<split>.json and <root>/<split>/<file_name>
    train_split: str = "train2017"  # coco only
    val_split: str = "val2017"  # coco only
    train_size: int = 512  # synthetic only
    val_size: int = 128  # synthetic only
    num_classes: int = 4  # classes including background (0); coco's json must have at most num_classes - 1
    image_size: int = 128  # synthetic only: the square canvas (the model resizes any image: model.min_size)
    augment: bool = True  # random horizontal flip of training images and their boxes

    # Keys a resumed run may change: where the files are, how they are augmented.
    may_change_on_resume: ClassVar[tuple[str, ...]] = ("root", "augment")

    def __post_init__(self):
        check_choice("data.name", self.name, ("synthetic", "coco"))
        for key in ("train_size", "val_size", "image_size"):
            check_positive(f"data.{key}", getattr(self, key))
        if self.num_classes < 2:
            raise ConfigError(f"data.num_classes must be at least 2 (background and one class), got {self.num_classes}")


class DataError(UsageError):
    pass


def prepare_data(cfg) -> None:
    """Nothing to fetch: synthetic data is made from the seed, COCO files are read."""


def build_datasets(cfg) -> tuple[Dataset, Dataset]:
    data = cfg.data
    train_tf, val_tf = transform(data.augment), transform(augment=False)
    if data.name == "synthetic":
        from synthetic_data import SyntheticObjects  # here, not at the top: it imports make_sample from this file

        train = SyntheticObjects(data.train_size, data.num_classes, data.image_size, cfg.seed, "train", train_tf)
        val = SyntheticObjects(data.val_size, data.num_classes, data.image_size, cfg.seed, "val", val_tf)
        return train, val
    if data.name == "coco":
        root = Path(data.root)
        train = CocoFiles(root, data.train_split, data.num_classes, train_tf)
        # Labels follow the train split's categories in both splits, as the model learns them.
        return train, CocoFiles(root, data.val_split, data.num_classes, val_tf, train.categories)
    raise ConfigError(f"unknown data.name {data.name!r}: add it to build_datasets in data.py")


def collate_fn(samples: list) -> tuple[list, list]:
    images, targets = zip(*samples, strict=True)
    return list(images), list(targets)


def build_predict_set(cfg, source: str) -> Dataset:
    """Every image file under the folder `source` (its sub-folders too), in sorted path
    order, as floats in [0, 1] (the detector resizes and normalises); a sample is (image, its path)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"--inputs: {source!r} is not a folder; give the folder that holds the images to predict")
    files = image_files(folder, IMG_EXTENSIONS)
    if not files:
        raise DataError(f"--inputs: {source!r} holds no image files ({', '.join(IMG_EXTENSIONS)}); add some")
    return ImagePaths(files)


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

    def __init__(self, paths: list[str]):
        self.paths = np.array([os.fsencode(path) for path in paths])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path = os.fsdecode(self.paths[index])
        return read_rgb(Path(path)).float().div_(255), path


def transform(augment: bool) -> v2.Transform:
    """Moves boxes with their image. No resize or normalisation here: the detector does
    both itself (model.min_size), and maps its predicted boxes back to these pixels."""
    steps = [v2.RandomHorizontalFlip()] if augment else []
    return v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.SanitizeBoundingBoxes()])


def make_sample(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, tf: v2.Transform):
    """(image, {"boxes", "labels"}) through `tf`, as plain tensors. SanitizeBoundingBoxes
    drops degenerate boxes with their labels."""
    size = tuple(image.shape[-2:])
    target = {"boxes": tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=size), "labels": labels}
    image, target = tf(tv_tensors.Image(image), target)
    return image.as_subclass(torch.Tensor), {
        "boxes": target["boxes"].as_subclass(torch.Tensor).float(),
        "labels": target["labels"],
    }


class CocoFiles(Dataset):
    """A COCO-format split: <root>/annotations/instances_<split>.json describes the
    images in <root>/<split>/. Category ids (any numbers) become labels 1..K in sorted
    order; crowd regions and boxes without area are left out.

    `categories` ({id: name}) are the categories labels are made from: the train
    split's, for the val split, so that a category has one label in both (val may lack
    some; one train lacks, or names otherwise, is an error). None: this split's own.

    File names, boxes and labels live in numpy arrays (boxes of all images in one array
    with per-image offsets), not lists of Python objects, so DataLoader workers do not
    copy them page by page."""

    def __init__(self, root: Path, split: str, num_classes: int, transform, categories: dict | None = None):
        path = root / "annotations" / f"instances_{split}.json"
        coco = read_json(path)
        try:
            own_categories = {category["id"]: category["name"] for category in coco["categories"]}
            images = sorted(coco["images"], key=lambda image: image["id"])
            annotations = coco["annotations"]
            by_image = {image["id"]: [] for image in images}
            sizes = [(image.get("height", -1), image.get("width", -1)) for image in images]
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{path}: not COCO instances format ({type(error).__name__}: {error})") from None
        if categories is None:
            categories = own_categories
        else:
            check_same_categories(own_categories, categories, path)
        if len(categories) >= num_classes:
            raise ConfigError(
                f"{path} has {len(categories)} categories: set data.num_classes={len(categories) + 1} (with background)"
            )
        if not images:
            raise DataError(f"{path} lists no images")
        labels = {category_id: label for label, category_id in enumerate(sorted(categories), start=1)}
        try:
            for annotation in annotations:
                x, y, w, h = annotation["bbox"]
                if not annotation.get("iscrowd", 0) and w > 0 and h > 0:
                    label = labels.get(annotation["category_id"])
                    if label is None:
                        raise DataError(
                            f"{path}: annotation {annotation.get('id')} has category_id {annotation['category_id']}, "
                            "which the train split's json does not list; fix it or add the category there"
                        )
                    by_image[annotation["image_id"]].append((x, y, x + w, y + h, label))
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{path}: not COCO instances format ({type(error).__name__}: {error})") from None
        rows = [row for image in images for row in by_image[image["id"]]]
        table = np.array(rows, dtype=np.float32).reshape(-1, 5)
        self.categories = categories
        self.boxes, self.labels = table[:, :4], table[:, 4].astype(np.int64)
        self.offsets = np.cumsum([0] + [len(by_image[image["id"]]) for image in images])
        self.files = np.array([os.fsencode(root / split / image["file_name"]) for image in images])
        self.sizes = np.array(sizes, dtype=np.int64)  # (height, width) as the json says, -1 if it does not
        self.json = str(path)
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        start, end = self.offsets[index], self.offsets[index + 1]
        path = Path(os.fsdecode(self.files[index]))
        image = read_rgb(path)
        check_size(image, self.sizes[index], path, self.json)
        boxes, labels = torch.from_numpy(self.boxes[start:end].copy()), torch.from_numpy(self.labels[start:end].copy())
        return make_sample(image, boxes, labels, self.transform)


def check_same_categories(categories: dict, train_categories: dict, path: Path) -> None:
    """The val split's categories must be the train split's (some may be missing)."""
    for category_id, name in sorted(categories.items()):
        if category_id not in train_categories:
            raise DataError(
                f"{path}: category {category_id} ({name!r}) is not among the train split's categories "
                "(labels are the train split's); remove it here or add it there"
            )
        if name != train_categories[category_id]:
            raise DataError(
                f"{path}: category {category_id} is {name!r} here but {train_categories[category_id]!r} in the "
                "train split's json; give it one name in both"
            )


def check_size(image: torch.Tensor, json_size, path: Path, json_path: str) -> None:
    """Boxes are in the json's pixels: on an image of another size they mark wrong places."""
    height, width = (int(n) for n in json_size)
    if height >= 0 and width >= 0 and tuple(image.shape[-2:]) != (height, width):
        raise DataError(
            f"image {path} is {image.shape[-1]}x{image.shape[-2]} pixels but {json_path} says {width}x{height}, "
            "the pixels its boxes are in; put back the original image or fix the json"
        )


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(
            f"data.root: {str(path)!r} is missing; expected COCO layout <root>/annotations/instances_<split>.json "
            "beside <root>/<split>/ (set data.train_split and data.val_split)"
        ) from None
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path}: {error}") from None


def read_rgb(path: Path) -> torch.Tensor:
    """The one place image files are read: whatever is wrong with a file is one line
    naming it. [3, H, W] uint8."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
    except Image.DecompressionBombError:  # not an OSError: PIL refuses to decode it at all
        raise DataError(
            f"image {path} has more pixels than PIL opens (its guard against decompression bombs); resize it, "
            "or if images this large are intended, raise PIL.Image.MAX_IMAGE_PIXELS at the top of data.py"
        ) from None
    except FileNotFoundError:
        raise DataError(f"image {path} is missing; the json lists it: put it there or fix its file_name") from None
    except UnidentifiedImageError:
        what = "is empty (0 bytes)" if os.path.getsize(path) == 0 else "is not an image PIL can read"
        raise DataError(f"image {path} {what}; replace or remove it") from None
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read image {path}: {error}; replace or remove it") from None
