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


def test_synthetic_data_is_made_from_the_seed():
    a, _ = datasets()
    b, _ = datasets()
    c, _ = datasets("seed=1")
    assert torch.equal(a.images, b.images) and torch.equal(a.masks, b.masks)
    assert not torch.equal(a.masks, c.masks)
    assert set(a.masks.unique().tolist()) == {0, 1, 2, 3}  # background and 3 classes


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
