"""Datasets: edit this file to train on your own data.

What train.py and evaluate.py use from here:
- `DataConfig`: the `data:` section of config.yaml, each key with its default.
- `prepare_data(cfg)`: downloads or unpacks files, if a dataset needs that; it runs on
  one process per node at a time.
- `build_datasets(cfg) -> (train_dataset, val_dataset)`: runs on every process at once
  and only reads. A sample here is (image tensor [3, H, W] in [0, 1], target dict with
  "boxes" [K, 4] as x1, y1, x2, y2 in pixels and "labels" [K], 1..num_classes-1).
- `collate_fn(samples) -> batch`: images of different sizes with different numbers of
  boxes do not stack, so a batch is (list of images, list of targets).

Rules that keep distributed training correct:
- `__getitem__` returns fresh tensors, never an object the dataset keeps.
- Keep per-sample metadata in tensors or arrays, not Python lists of objects.
- Draw randomness from torch (e.g. torchvision transforms): the machinery seeds it per
  sample, so augmentations repeat exactly on resume and never repeat across ranks or workers.
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

from engine.config import check_choice, check_positive
from engine.errors import ConfigError, UsageError


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
        train = SyntheticObjects(data.train_size, data.num_classes, data.image_size, cfg.seed, "train", train_tf)
        val = SyntheticObjects(data.val_size, data.num_classes, data.image_size, cfg.seed, "val", val_tf)
        return train, val
    if data.name == "coco":
        root = Path(data.root)
        train = CocoFiles(root, data.train_split, data.num_classes, train_tf)
        return train, CocoFiles(root, data.val_split, data.num_classes, val_tf)
    raise ConfigError(f"unknown data.name {data.name!r}: add it to build_datasets in data.py")


def collate_fn(samples: list) -> tuple[list, list]:
    images, targets = zip(*samples, strict=True)
    return list(images), list(targets)


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


class SyntheticObjects(Dataset):
    """1 to 4 non-overlapping rectangles and ellipses of the foreground classes on a noisy
    background, made from the seed alone: no download, the same on every rank. Each
    class has its own colour, so a small detector learns it in minutes. Stored as
    tensors: images uint8, and every box in one array indexed by per-image offsets."""

    def __init__(self, size, num_classes, image_size, seed, split, transform):
        colours = torch.rand(num_classes, 3, generator=torch.Generator().manual_seed(seed))
        g = torch.Generator().manual_seed(seed * 2 + (split == "val") + 1)
        classes = torch.zeros(size, image_size, image_size, dtype=torch.long)
        ys, xs = torch.meshgrid(torch.arange(image_size), torch.arange(image_size), indexing="ij")
        all_boxes, all_labels, counts = [], [], []
        for canvas in classes:
            boxes = []
            for _ in range(int(torch.randint(1, 5, (), generator=g))):
                w, h = torch.randint(image_size // 6, image_size // 2, (2,), generator=g).tolist()
                x1 = int(torch.randint(image_size - w, (), generator=g))
                y1 = int(torch.randint(image_size - h, (), generator=g))
                box = (x1, y1, x1 + w, y1 + h)
                if any(overlap(box, other) for other in boxes):
                    continue
                cls = int(torch.randint(1, num_classes, (), generator=g))
                inside = (xs >= x1) & (xs < x1 + w) & (ys >= y1) & (ys < y1 + h)
                if torch.rand((), generator=g) < 0.5:
                    inside &= ((2 * (xs - x1) + 1 - w) / w) ** 2 + ((2 * (ys - y1) + 1 - h) / h) ** 2 <= 1
                canvas[inside] = cls
                boxes.append(box)
                all_labels.append(cls)
            all_boxes += boxes
            counts.append(len(boxes))
        images = colours[classes].permute(0, 3, 1, 2)
        images = images + 0.25 * torch.randn(images.shape, generator=g)
        self.images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
        self.boxes = torch.tensor(all_boxes, dtype=torch.float32)
        self.labels = torch.tensor(all_labels, dtype=torch.int64)
        self.offsets = torch.tensor([0, *counts]).cumsum(0)
        self.transform = transform

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        start, end = self.offsets[index], self.offsets[index + 1]
        return make_sample(
            self.images[index].clone(), self.boxes[start:end].clone(), self.labels[start:end].clone(), self.transform
        )


def overlap(a: tuple, b: tuple) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


class CocoFiles(Dataset):
    """A COCO-format split: <root>/annotations/instances_<split>.json describes the
    images in <root>/<split>/. Category ids (any numbers) become labels 1..K in sorted
    order; crowd regions and boxes without area are left out.

    File names, boxes and labels live in numpy arrays (boxes of all images in one array
    with per-image offsets), not lists of Python objects, so DataLoader workers do not
    copy them page by page."""

    def __init__(self, root: Path, split: str, num_classes: int, transform):
        path = root / "annotations" / f"instances_{split}.json"
        coco = read_json(path)
        try:
            categories = sorted(category["id"] for category in coco["categories"])
            images = sorted(coco["images"], key=lambda image: image["id"])
            annotations = coco["annotations"]
            labels = {category_id: label for label, category_id in enumerate(categories, start=1)}
            by_image = {image["id"]: [] for image in images}
            for annotation in annotations:
                x, y, w, h = annotation["bbox"]
                if not annotation.get("iscrowd", 0) and w > 0 and h > 0:
                    by_image[annotation["image_id"]].append((x, y, x + w, y + h, labels[annotation["category_id"]]))
        except (KeyError, TypeError, ValueError) as error:
            raise DataError(f"{path}: not COCO instances format ({type(error).__name__}: {error})") from None
        if len(categories) >= num_classes:
            raise ConfigError(
                f"{path} has {len(categories)} categories: set data.num_classes={len(categories) + 1} (with background)"
            )
        if not images:
            raise DataError(f"{path} lists no images")
        rows = [row for image in images for row in by_image[image["id"]]]
        table = np.array(rows, dtype=np.float32).reshape(-1, 5)
        self.boxes, self.labels = table[:, :4], table[:, 4].astype(np.int64)
        self.offsets = np.cumsum([0] + [len(by_image[image["id"]]) for image in images])
        self.files = np.array([os.fsencode(root / split / image["file_name"]) for image in images])
        self.transform = transform

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        start, end = self.offsets[index], self.offsets[index + 1]
        image = read_rgb(Path(os.fsdecode(self.files[index])))
        boxes, labels = torch.from_numpy(self.boxes[start:end].copy()), torch.from_numpy(self.labels[start:end].copy())
        return make_sample(image, boxes, labels, self.transform)


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
    from PIL import Image

    try:
        with Image.open(path) as image:
            return torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1).contiguous()
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read {path}: {error}") from None
