import os

import pytest
import torch

from conftest import project_config
from data import DataError, build_datasets, prepare_data
from engine.distributed import DistEnv
from engine.loader import (
    EvalBatches,
    SeededSamples,
    TrainSampler,
    micro_batches_per_epoch,
)
from engine.seeding import derive_seed, sample_seeds

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def datasets(*overrides):
    return build_datasets(project_config(None, ["data.train_size=64", "data.val_size=13", *overrides]))


def all_samples(dataset):
    images, labels = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(images), torch.tensor(labels)


def test_synthetic_data_is_made_from_the_seed():
    a, a_val = datasets("data.augment=false")
    b, _ = datasets("data.augment=false")
    c, _ = datasets("data.augment=false", "seed=1")
    (a_images, a_labels), (b_images, b_labels) = all_samples(a), all_samples(b)
    assert torch.equal(a_images, b_images) and torch.equal(a_labels, b_labels)
    assert not torch.equal(a_images, all_samples(c)[0])
    assert set(a_labels.tolist()) == set(range(10))
    assert not torch.equal(a_images[:13], all_samples(a_val)[0])  # the splits differ
    # A sample is a function of (seed, split, index): a larger set begins with the same samples.
    larger, _ = datasets("data.augment=false", "data.train_size=100")
    assert torch.equal(all_samples(larger)[0][:64], a_images)


def test_synthetic_data_of_any_size_costs_no_memory():
    """Samples are made when read, so data.train_size=10**9 fits (was: the whole set made
    up front, an allocation error for anything past the machine's memory)."""
    import pickle

    train, _ = datasets("data.augment=false", f"data.train_size={10**12}")
    assert len(train) == 10**12
    image, label = train[10**12 - 1]
    assert image.shape == (3, 32, 32) and 0 <= label < 10
    assert torch.equal(train[10**12 - 1][0], image)
    small, _ = datasets("data.augment=false")
    assert len(pickle.dumps(train)) <= len(pickle.dumps(small)) + 100  # what every DataLoader worker copies


def test_samples_are_fresh_copies():
    train, _ = datasets("data.augment=false")
    image, label = train[3]
    before = train[3][0].clone()
    image.mul_(0).add_(7)
    assert torch.equal(train[3][0], before)


def test_augmentation_is_a_function_of_seed_epoch_and_index():
    train, _ = datasets()
    seeded = SeededSamples(train)
    seed_0, seed_1 = (sample_seeds(derive_seed(0, epoch), [5])[0] for epoch in (0, 1))
    state = torch.get_rng_state()
    first = seeded[(seed_0, 5)][0]
    assert torch.equal(torch.get_rng_state(), state)  # caller's RNG untouched
    assert torch.equal(seeded[(seed_0, 5)][0], first)
    assert not torch.equal(seeded[(seed_1, 5)][0], first)
    # A batch gives each sample what it gets alone, whatever its neighbours.
    batch = seeded.__getitems__([(seed_1, 7), (seed_0, 5), (seed_0, 6)])
    assert torch.equal(batch[1][0], first) and torch.equal(batch[0][0], seeded[(seed_1, 7)][0])
    assert torch.equal(torch.get_rng_state(), state)


def test_train_batches_do_not_depend_on_world_size():
    train, _ = datasets()
    cfg = project_config(None, ["train.batch_size=8"])

    def global_batches(world_size, batch_size):
        ranks = []
        for rank in range(world_size):
            env = DistEnv(rank=rank, world_size=world_size, launcher="torchrun")
            sampler = TrainSampler(
                train, env, seed=0, batch_size=batch_size, num_batches=64 // (world_size * batch_size)
            )
            sampler.set_epoch(3)
            keys = list(sampler)  # (sample seed, index)
            ranks.append([keys[i : i + batch_size] for i in range(0, len(keys), batch_size)])
        return [sorted(sum(step, [])) for step in zip(*ranks, strict=True)]

    assert global_batches(1, 16) == global_batches(2, 8) == global_batches(4, 4)
    assert micro_batches_per_epoch(64, cfg, DistEnv(world_size=2, launcher="torchrun")) == 4


def test_train_sampler_changes_order_every_epoch_and_resumes_mid_epoch():
    train, _ = datasets()
    sampler = TrainSampler(train, DistEnv(), seed=0, batch_size=8, num_batches=8)
    sampler.set_epoch(0)
    epoch0 = [i for _, i in sampler]
    sampler.set_epoch(1)
    epoch1 = [i for _, i in sampler]
    assert epoch0 != epoch1 and sorted(epoch0) == sorted(epoch1)
    sampler.set_epoch(1, start_batch=3)
    assert [i for _, i in sampler] == epoch1[24:] and len(sampler) == 40


def test_eval_batches_cover_every_sample_once_in_the_same_batches_on_any_world_size():
    for world_size in (1, 2, 3, 5):
        shares = [list(EvalBatches(13, 4, DistEnv(rank=r, world_size=world_size))) for r in range(world_size)]
        batches = sorted(sum(shares, []))
        assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12]]


def test_every_sample_of_every_epoch_has_its_own_random_stream():
    # Augmentation is seeded per (seed, epoch, index), so no two ranks or workers (which
    # always load different indices) can draw the same random numbers.
    seeds = {seed for epoch in range(3) for seed in sample_seeds(derive_seed(0, epoch), list(range(5000)))}
    assert len(seeds) == 3 * 5000 and all(0 <= seed < 2**64 for seed in seeds)
    assert derive_seed(0, 1, 2) == derive_seed(0, 1, 2) != derive_seed(1, 1, 2)


def test_missing_cifar10_says_where_it_looked_and_what_to_set(tmp_path):
    cfg = project_config(None, ["data.name=cifar10", f"data.root={tmp_path}"])
    prepare_data(cfg)  # data.download=false: nothing to fetch
    with pytest.raises(DataError, match=r"no complete dataset in .*cifar-10-batches-py'; set data.download=true"):
        build_datasets(cfg)


def test_image_folder_keeps_metadata_in_arrays(tmp_path):
    import numpy as np
    from PIL import Image

    from data import ImageFiles

    for label in ("a", "b"):
        (tmp_path / label).mkdir()
        for i in range(3):
            Image.new("RGB", (4, 4), (i, 0, 0)).save(tmp_path / label / f"{i}.png")
    files = ImageFiles(tmp_path, ["a", "b"], transform=lambda image: image)
    assert isinstance(files.paths, np.ndarray) and isinstance(files.labels, torch.Tensor)
    assert files.classes == ["a", "b"] and len(files) == 6 and files[4][1] == 1


def test_the_transforms_see_the_original_image_and_give_the_model_its_input(tmp_path):
    """data.py's train_transform gets each image as read (here 50 x 40 pixels, PIL), so a
    pipeline of yours (RandomResizedCrop, AutoAugment) starts from the original."""
    from PIL import Image

    import data

    seen = []
    for split in ("train", "val"):
        (tmp_path / split / "a").mkdir(parents=True)
        Image.new("RGB", (50, 40), (200, 10, 10)).save(tmp_path / split / "a" / "0.png")
    cfg = project_config(None, ["data.name=imagefolder", f"data.root={tmp_path}", "data.image_size=16"])
    made = data.train_transform(cfg.data)

    def watched(image):
        seen.append(image.size)
        return made(image)

    train, val = data.image_folder(tmp_path, watched, data.val_transform(cfg.data))
    image, _ = train[0]
    assert seen == [(50, 40)] and image.shape == val[0][0].shape == (3, 16, 16) and image.dtype == torch.float32


def write_image_folder(root, classes_by_split: dict, images_per_class=2):
    """<root>/<split>/<class>/<n>.png, tiny images."""
    from PIL import Image

    for split, classes in classes_by_split.items():
        for name in classes:
            (root / split / name).mkdir(parents=True)
            for n in range(images_per_class):
                Image.new("RGB", (4, 4), (10 * n, 0, 0)).save(root / split / name / f"{n}.png")


def image_folder_datasets(root, *overrides):
    return datasets("data.name=imagefolder", f"data.root={root}", "data.image_size=4", "data.augment=false", *overrides)


def test_val_folder_lacking_a_class_is_labelled_with_train_class_indices(tmp_path):
    """val/ without class b: its c images are label 2, as in train/ (was: val/'s own
    sorted folders made c label 1, so val_acc counted right answers as wrong)."""
    from pathlib import Path

    write_image_folder(tmp_path, {"train": ["a", "b", "c"], "val": ["a", "c"]})
    train, val = image_folder_datasets(tmp_path)
    assert train.classes == val.classes == ["a", "b", "c"]
    val_labels = [val[i][1] for i in range(len(val))]
    val_class_names = [Path(os.fsdecode(path)).parent.name for path in val.paths]
    assert val_labels == [train.classes.index(name) for name in val_class_names] == [0, 0, 2, 2]


@pytest.mark.parametrize(
    "val_classes, unknown",
    [(["a", "b", "c", "d"], "'d'"), (["a", "bee", "c"], "'bee'")],
    ids=["extra", "renamed"],
)
def test_val_class_unknown_to_train_is_one_line(tmp_path, val_classes, unknown):
    write_image_folder(tmp_path, {"train": ["a", "b", "c"], "val": val_classes})
    with pytest.raises(DataError) as error:
        image_folder_datasets(tmp_path)
    message = str(error.value)
    assert "\n" not in message and unknown in message and str(tmp_path / "val") in message, message


def write_huge_png(path, width=40_000, height=40_000):
    """A tiny valid PNG whose header claims width x height pixels (with a correct CRC)."""
    import io
    import struct
    import zlib

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, "PNG")
    png = bytearray(buffer.getvalue())
    png[16:24] = struct.pack(">II", width, height)  # IHDR's data starts after signature, length and type
    png[29:33] = struct.pack(">I", zlib.crc32(bytes(png[12:29])))  # CRC of IHDR's type and data
    path.write_bytes(bytes(png))


BAD_IMAGES = {
    "huge.png": (write_huge_png, "PIL.Image.MAX_IMAGE_PIXELS"),
    "text.png": (lambda path: path.write_text("not an image"), "is not an image"),
    "empty.jpg": (lambda path: path.write_bytes(b""), "is empty"),
}


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_unreadable_images_are_one_line_naming_the_file(tmp_path, name):
    write_image_folder(tmp_path, {"train": ["a"], "val": ["a"]})
    write, advice = BAD_IMAGES[name]
    bad = tmp_path / "train" / "a" / name
    write(bad)
    train, _ = image_folder_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[[os.fsdecode(path) for path in train.paths].index(str(bad))]
    message = str(error.value)
    assert "\n" not in message and str(bad) in message and advice in message, message


def test_a_float_image_of_the_models_size_passes_the_conversions_as_they_would_leave_it():
    """The synthetic example's images skip ToImage, Resize, CenterCrop and ToDtype (their cost
    per sample exceeded the sample's making): the image is the one the conversions give."""
    from torchvision.transforms import v2

    from data import as_float_image

    image = torch.rand(3, 16, 16)
    converted = v2.Compose([v2.ToImage(), v2.Resize(16), v2.CenterCrop(16), v2.ToDtype(torch.float32, scale=True)])
    assert as_float_image(16)(image) is image and torch.equal(converted(image), image)
    assert as_float_image(8)(image).shape == (3, 8, 8)  # another size is converted
