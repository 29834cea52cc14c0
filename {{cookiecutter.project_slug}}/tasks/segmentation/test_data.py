import numpy as np
import pytest
import torch

from conftest import project_config
from data import IGNORE, DataError, build_datasets
from engine.loader import SeededSamples
from engine.seeding import derive_seed, sample_seeds

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def datasets(*overrides):
    return build_datasets(project_config(None, ["data.train_size=16", "data.val_size=5", *overrides]))


def all_samples(dataset):
    images, masks = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    return torch.stack(images), torch.stack(masks)


def test_synthetic_data_is_made_from_the_seed():
    a, a_val = datasets("data.augment=false")
    b, _ = datasets("data.augment=false")
    c, _ = datasets("data.augment=false", "seed=1")
    (a_images, a_masks), (b_images, b_masks) = all_samples(a), all_samples(b)
    assert torch.equal(a_images, b_images) and torch.equal(a_masks, b_masks)
    assert not torch.equal(a_masks, all_samples(c)[1])
    assert not torch.equal(a_masks[:5], all_samples(a_val)[1])  # the splits differ
    assert set(a_masks.unique().tolist()) == {0, 1, 2, 3}  # background and 3 classes
    # A sample is a function of (seed, split, index): a larger set begins with the same samples.
    larger, _ = datasets("data.augment=false", "data.train_size=20")
    assert torch.equal(all_samples(larger)[0][:16], a_images)


def test_synthetic_data_of_any_size_costs_no_memory():
    """Samples are made when read, so data.train_size=10**9 fits (was: the whole set made
    up front, an allocation error for anything past the machine's memory)."""
    import pickle

    train, _ = datasets("data.augment=false", f"data.train_size={10**12}")
    assert len(train) == 10**12
    image, mask = train[10**12 - 1]
    assert image.shape == (3, 64, 64) and torch.equal(train[10**12 - 1][1], mask)
    small, _ = datasets("data.augment=false")
    assert len(pickle.dumps(train)) <= len(pickle.dumps(small)) + 100  # what every DataLoader worker copies


def test_samples_are_fresh_copies_with_integer_masks():
    train, _ = datasets("data.augment=false")
    image, mask = train[3]
    assert image.shape == (3, 64, 64) and image.dtype == torch.float32
    assert mask.shape == (64, 64) and mask.dtype == torch.int64
    mask.fill_(9)
    assert int(train[3][1].max()) < 4


def test_augmentation_moves_image_and_mask_alike():
    """A flip or crop of the image but not of the mask would teach wrong labels. Each
    class has one colour here, so under every mask class the augmented image must show
    that class's colour, as it does without augmentation."""
    plain, _ = datasets("data.augment=false")
    colour = {}
    for image, mask in (plain[i] for i in range(len(plain))):
        for cls in mask.unique().tolist():
            colour.setdefault(cls, []).append(image[:, mask == cls])
    colour = {cls: torch.cat(pixels, dim=1).mean(dim=1) for cls, pixels in colour.items()}
    train, _ = datasets()
    seeded = SeededSamples(train)
    for index in range(len(train)):
        image, mask = seeded[(sample_seeds(derive_seed(0, 1), [index])[0], index)]
        assert set(mask.unique().tolist()) <= {0, 1, 2, 3, IGNORE}  # padding is ignored, not a class
        for cls in set(mask.unique().tolist()) - {IGNORE}:
            pixels = image[:, mask == cls]
            if pixels.shape[1] >= 100:
                assert (pixels.mean(dim=1) - colour[cls]).abs().max() < 0.5, (index, cls)


def write_voc(root, ids_by_split, size=(40, 30)):
    from PIL import Image

    (root / "JPEGImages").mkdir(parents=True)
    (root / "SegmentationClass").mkdir()
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    for split, ids in ids_by_split.items():
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("".join(f"{i}\n" for i in ids))
        for number, name in enumerate(ids):
            Image.new("RGB", size, (10 * number, 100, 200)).save(root / "JPEGImages" / f"{name}.jpg")
            mask = np.zeros(size[::-1], dtype=np.uint8)
            mask[5:15, 5:25] = 1 + number % 3
            mask[0, :] = IGNORE  # a border, as VOC marks object edges
            png = Image.fromarray(mask, mode="P")
            png.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [0, 0, 0] * 252)
            png.save(root / "SegmentationClass" / f"{name}.png")


def test_voc_folders_load_with_their_class_indices(tmp_path):
    write_voc(tmp_path, {"train": ["a", "b", "c"], "val": ["d", "e"]})
    train, val = datasets("data.name=voc", f"data.root={tmp_path}", "data.image_size=32", "data.augment=false")
    assert (len(train), len(val)) == (3, 2)
    image, mask = val[1]
    assert image.shape == (3, 32, 32) and mask.shape == (32, 32)
    assert set(mask.unique().tolist()) == {0, 2, IGNORE}  # resized by nearest neighbour: no new values


@pytest.mark.parametrize("missing", ["ImageSets/Segmentation/val.txt", "SegmentationClass/d.png"])
def test_missing_voc_files_are_one_line_errors(tmp_path, missing):
    write_voc(tmp_path, {"train": ["a"], "val": ["d"]})
    (tmp_path / missing).unlink()
    with pytest.raises(DataError) as error:
        _, val = datasets("data.name=voc", f"data.root={tmp_path}")
        val[0]
    assert "\n" not in str(error.value) and str(tmp_path / missing) in str(error.value)


def voc_datasets(root, *overrides):
    return datasets("data.name=voc", f"data.root={root}", "data.image_size=32", "data.augment=false", *overrides)


def test_mask_with_a_class_past_num_classes_is_one_line(tmp_path):
    """Class 3 with data.num_classes=3 (classes 0-2): cross-entropy's out-of-bounds
    traceback, or a confusion matrix of the wrong shape, before."""
    write_voc(tmp_path, {"train": ["a", "b", "c"], "val": ["d"]})  # c's mask has class 3
    train, _ = voc_datasets(tmp_path, "data.num_classes=3")
    train[1]  # b: classes 0, 2 and 255
    with pytest.raises(DataError) as error:
        train[2]
    message = str(error.value)
    path = tmp_path / "SegmentationClass" / "c.png"
    assert "\n" not in message and str(path) in message and "data.num_classes=4" in message, message


def test_colour_mask_is_one_line(tmp_path):
    """An RGB mask (colours, not class indices) made a [H, W, 3] 'mask'."""
    from PIL import Image

    write_voc(tmp_path, {"train": ["a"], "val": ["d"]})
    path = tmp_path / "SegmentationClass" / "a.png"
    Image.open(path).convert("RGB").save(path)
    train, _ = voc_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[0]
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "class index per pixel" in message, message


def test_mask_of_another_size_than_its_image_is_one_line(tmp_path):
    """Both were resized to data.image_size apart, so the labels landed on other pixels."""
    from PIL import Image

    write_voc(tmp_path, {"train": ["a"], "val": ["d"]})
    path = tmp_path / "SegmentationClass" / "a.png"
    Image.open(path).resize((20, 15), Image.NEAREST).save(path)
    train, _ = voc_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[0]
    message = str(error.value)
    assert "\n" not in message and str(path) in message and "40x30" in message, message


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
    "huge": (write_huge_png, "PIL.Image.MAX_IMAGE_PIXELS"),
    "not an image": (lambda path: path.write_text("not an image"), "is not an image"),
    "empty": (lambda path: path.write_bytes(b""), "is empty"),
}


@pytest.mark.parametrize("file", ["JPEGImages/a.jpg", "SegmentationClass/a.png"])
@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_unreadable_images_and_masks_are_one_line_naming_the_file(tmp_path, kind, file):
    write_voc(tmp_path, {"train": ["a"], "val": ["d"]})
    write, advice = BAD_IMAGES[kind]
    write(tmp_path / file)
    train, _ = voc_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[0]
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / file) in message and advice in message, message
