"""Datasets: edit this file to train on your own data.

The example's synthetic data (data.name=synthetic) is in synthetic_data.py: once you use
your own data, delete that file and its import and branch here.

What train.py and evaluate.py use from here:
- `DataConfig`: the `data:` section of config.yaml, each key with its default.
- `prepare_data(cfg)`: downloads or unpacks files, if a dataset needs that; it runs on
  one process per node at a time.
- `build_datasets(cfg) -> (train_dataset, val_dataset)`: runs on every process at once
  and only reads. A sample may be anything your `training_step` and `validation_step`
  (model.py) understand: here (image tensor [C, H, W], integer label).
- `collate_fn(samples) -> batch` (optional; this example has none): makes one batch from
  a list of samples, when torch's default (stacking tensors) does not fit, e.g. images of
  different sizes with per-image targets. Any structure of tensors works as a batch:
  lists, tuples, dicts, namedtuples, dataclasses.
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
- `__getitem__` returns fresh tensors, never an object the dataset keeps (a caller that
  mutates it would change the dataset, and workers would copy it on every read).
- Keep per-sample metadata in tensors or arrays, not Python lists of objects.
- Randomness lives in two places, both drawn from torch and seeded by the machinery, so
  they repeat exactly on resume: a sample's transforms (seeded per sample: never repeated
  across ranks or workers) and `build_augment`'s function (seeded per training batch). Not in
  `collate_fn`, which validation batches pass through too.
- Nothing here is distributed: samplers and loaders are the machinery's.
"""

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from engine import ConfigError, UsageError, check_choice, check_positive
from synthetic_data import SyntheticImages

MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


@dataclass
class DataConfig:
    name: str = "synthetic"  # synthetic (made from the seed) | imagefolder | cifar10
    root: str = "data"  # imagefolder: <root>/train/<class>/*, <root>/val/<class>/*; cifar10: its folder
    download: bool = False  # cifar10 only: fetch it into root if missing
    train_size: int = 4096  # synthetic only
    val_size: int = 1000  # synthetic only
    num_classes: int = 10  # synthetic only; imagefolder and cifar10 count their classes
    image_size: int = 32
    augment: bool = True  # random crop and horizontal flip on training images

    # Keys a resumed run may change: where the files are, how they are fetched and augmented.
    may_change_on_resume: ClassVar[tuple[str, ...]] = ("root", "download", "augment")

    def __post_init__(self):
        check_choice("data.name", self.name, ("synthetic", "imagefolder", "cifar10"))
        for key in ("train_size", "val_size", "num_classes", "image_size"):
            check_positive(f"data.{key}", getattr(self, key))


class DataError(UsageError):
    pass


def prepare_data(cfg) -> None:
    """Fetch what build_datasets reads (nothing for synthetic data or an image folder)."""
    if cfg.data.name == "cifar10" and cfg.data.download:
        from torchvision.datasets import CIFAR10

        try:  # one archive holds both splits; the small test split checks it is all there
            CIFAR10(cfg.data.root, train=False, download=True)
        except OSError as error:  # urllib's URLError is an OSError
            reason = getattr(error, "reason", None) or error.strerror or error
            raise DataError(
                f"cifar10: download into {cfg.data.root!r} failed ({reason}); check the network, or put "
                "cifar-10-batches-py there yourself and set data.download=false"
            ) from None


def build_datasets(cfg) -> tuple[Dataset, Dataset]:
    data = cfg.data
    train_tf, val_tf = train_transform(data), val_transform(data)
    if data.name == "synthetic":
        train = SyntheticImages(data.train_size, data.num_classes, data.image_size, cfg.seed, "train", train_tf)
        val = SyntheticImages(data.val_size, data.num_classes, data.image_size, cfg.seed, "val", val_tf)
        return train, val
    if data.name == "imagefolder":
        return image_folder(Path(data.root), train_tf, val_tf)
    if data.name == "cifar10":
        return cifar10(Path(data.root), train_tf, val_tf)
    raise ConfigError(f"unknown data.name {data.name!r}: add it to build_datasets in data.py")


def count_classes(cfg) -> int:
    """The number of classes: data.num_classes for synthetic data, else the data's own."""
    if cfg.data.name == "imagefolder":
        return len(class_names(Path(cfg.data.root) / "train", "train"))
    if cfg.data.name == "cifar10":
        return 10
    return cfg.data.num_classes


def train_transform(data: DataConfig) -> v2.Transform:
    """A training image as read (a PIL image from files, or a tensor) to the model's input:
    yours to replace whole, e.g. v2.RandomResizedCrop and v2.AutoAugment on the original image."""
    size = data.image_size
    augment = [v2.RandomCrop(size, padding=size // 8), v2.RandomHorizontalFlip()] if data.augment else []
    return v2.Compose([as_float_image(size), *augment, v2.Normalize(MEAN, STD)])


def val_transform(data: DataConfig) -> v2.Transform:
    """A validation (or prediction) image as read to the model's input."""
    return v2.Compose([as_float_image(data.image_size), v2.Normalize(MEAN, STD)])


def image_folder(root: Path, train_tf, val_tf) -> tuple[Dataset, Dataset]:
    """<root>/train/<class>/<image> and <root>/val/<class>/<image>. Labels are indices
    in train/'s sorted class folders, in both splits: val/ may lack a class, but a class
    folder train/ does not have is an error (the model never learns it)."""
    classes = class_names(root / "train", "train")
    check_val_classes(root / "val", classes)
    train = ImageFiles(root / "train", classes, train_tf)
    val = ImageFiles(root / "val", classes, val_tf)
    return train, val


def as_float_image(image_size: int) -> functools.partial:
    """A PIL image or tensor as a float image, its shorter side scaled to image_size and its
    centre cut square. A float image of that size already (the synthetic example's) passes as
    it is: the conversions would change nothing, and they cost more than the sample's making."""
    to_float = v2.ToDtype(torch.float32, scale=True)
    convert = v2.Compose([v2.ToImage(), v2.Resize(image_size), v2.CenterCrop(image_size), to_float])
    return functools.partial(float_image, convert=convert, image_size=image_size)


def float_image(image, convert: v2.Transform, image_size: int):
    if isinstance(image, torch.Tensor) and image.is_floating_point() and image.shape[-2:] == (image_size, image_size):
        return image
    return convert(image)


def build_predict_set(cfg, source: str) -> Dataset:
    """Every image file under the folder `source` (its sub-folders too), in sorted path
    order, pre-processed as validation images are; a sample is (image, its path)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    folder = Path(source)
    if not folder.is_dir():
        raise DataError(f"--inputs: {source!r} is not a folder; give the folder that holds the images to predict")
    files = image_files(folder, IMG_EXTENSIONS)
    if not files:
        raise DataError(f"--inputs: {source!r} holds no image files ({', '.join(IMG_EXTENSIONS)}); add some")
    return ImagePaths(files, val_transform(cfg.data))


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
    """Image files by path: (image, path) samples. The paths live in one numpy byte-string
    array, for the reason ImageFiles gives."""

    def __init__(self, paths: list[str], transform):
        self.paths = np.array([os.fsencode(path) for path in paths])
        self.transform = transform

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, index):
        path = os.fsdecode(self.paths[index])
        return self.transform(read_image(path)), path


class ImageFiles(Dataset):
    """A class-per-folder image set (torchvision's ImageFolder layout and file types).

    Paths live in one numpy byte-string array and labels in one tensor, not in a list
    of (path, label) tuples: DataLoader workers touching a list of Python objects bump
    their reference counts, which copies the memory pages into every worker over time.

    `classes` are the label names, in label order: the same list for every split, so
    that a class has one label everywhere; a folder may lack some of them.
    """

    def __init__(self, folder: Path, classes: list[str], transform):
        from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

        class_to_index = {name: label for label, name in enumerate(classes)}
        samples = make_dataset(str(folder), class_to_index, extensions=IMG_EXTENSIONS, allow_empty=True)
        self.classes = list(classes)
        self.paths = np.array([os.fsencode(path) for path, _ in samples])
        self.labels = torch.tensor([label for _, label in samples], dtype=torch.int64)
        self.transform = transform

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        image = read_image(os.fsdecode(self.paths[index]))
        return self.transform(image), int(self.labels[index])


def class_names(folder: Path, split: str) -> list[str]:
    """The sorted class folder names of one split, each checked to hold images."""
    check_class_folders(folder, split)
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def check_val_classes(folder: Path, train_classes: list[str]) -> None:
    unknown = sorted(set(class_names(folder, "val")) - set(train_classes))
    if unknown:
        raise DataError(
            f"data.root: {str(folder)!r} has class folder(s) {', '.join(map(repr, unknown))} that train/ lacks "
            f"(train/ has {', '.join(map(repr, train_classes))}); rename or remove them: labels are train/'s classes"
        )


def check_class_folders(folder: Path, split: str) -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if not folder.is_dir():
        raise DataError(f"data.root: {str(folder)!r} is missing; expected <root>/{split}/<class>/<image files>")
    classes = sorted(p for p in folder.iterdir() if p.is_dir())
    if not classes:
        raise DataError(f"data.root: {str(folder)!r} has no class folders; expected {folder}/<class>/<image files>")
    for class_dir in classes:
        if not any(f.suffix.lower() in IMG_EXTENSIONS for f in class_dir.rglob("*") if f.is_file()):
            raise DataError(
                f"data.root: class folder {str(class_dir)!r} has no images ({', '.join(IMG_EXTENSIONS)}); "
                "add some or remove the folder"
            )


def read_image(path: str):
    """The one place image files are read: whatever is wrong with a file is one line
    naming it."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError:  # not an OSError: PIL refuses to decode it at all
        raise DataError(
            f"image {path} has more pixels than PIL opens (its guard against decompression bombs); resize it, "
            "or if images this large are intended, raise PIL.Image.MAX_IMAGE_PIXELS at the top of data.py"
        ) from None
    except FileNotFoundError:
        raise DataError(f"image {path} is missing (it was there when the run listed data.root); put it back") from None
    except UnidentifiedImageError:
        what = "is empty (0 bytes)" if os.path.getsize(path) == 0 else "is not an image PIL can read"
        raise DataError(f"image {path} {what}; replace or remove it") from None
    except (OSError, ValueError) as error:
        raise DataError(f"cannot read image {path}: {error}; replace or remove it") from None


def cifar10(root: Path, train_tf, val_tf) -> tuple[Dataset, Dataset]:
    from torchvision.datasets import CIFAR10

    try:
        train = CIFAR10(str(root), train=True, transform=train_tf)
        val = CIFAR10(str(root), train=False, transform=val_tf)
    except RuntimeError:  # torchvision's "Dataset not found or corrupted"
        raise DataError(
            f"cifar10: no complete dataset in {str(root / 'cifar-10-batches-py')!r}; set data.download=true "
            "to fetch it, or data.root to the folder that holds cifar-10-batches-py"
        ) from None
    return train, val
