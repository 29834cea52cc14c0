import json

import pytest
import torch

from conftest import project_config
from data import DataError, build_datasets, collate_fn
from engine.errors import ConfigError
from engine.loader import SeededSamples
from engine.seeding import derive_seed, sample_seeds

pytestmark = pytest.mark.quick  # the edit loop: pytest -m quick


def datasets(*overrides):
    return build_datasets(project_config(None, ["data.train_size=16", "data.val_size=5", *overrides]))


def all_samples(dataset):
    """Every image stacked, and every box and label of every image in one tensor each."""
    images, targets = zip(*(dataset[i] for i in range(len(dataset))), strict=True)
    boxes, labels = (torch.cat([target[key] for target in targets]) for key in ("boxes", "labels"))
    return torch.stack(images), boxes, labels


def test_synthetic_data_is_made_from_the_seed():
    a, a_val = datasets("data.augment=false")
    b, _ = datasets("data.augment=false")
    c, _ = datasets("data.augment=false", "seed=1")
    (a_images, a_boxes, a_labels), (b_images, b_boxes, b_labels) = all_samples(a), all_samples(b)
    assert torch.equal(a_images, b_images) and torch.equal(a_boxes, b_boxes) and torch.equal(a_labels, b_labels)
    assert not torch.equal(a_images, all_samples(c)[0])
    assert not torch.equal(a_images[:5], all_samples(a_val)[0])  # the splits differ
    assert set(a_labels.tolist()) == {1, 2, 3}  # 3 classes besides background
    assert a_boxes.min() >= 0 and a_boxes.max() <= 128
    # A sample is a function of (seed, split, index): a larger set begins with the same samples.
    larger, _ = datasets("data.augment=false", "data.train_size=20")
    assert torch.equal(all_samples(larger)[0][:16], a_images)


def test_synthetic_data_of_any_size_costs_no_memory():
    """Samples are made when read, so data.train_size=10**9 fits (was: the whole set made
    up front, an allocation error for anything past the machine's memory)."""
    import pickle

    train, _ = datasets("data.augment=false", f"data.train_size={10**12}")
    assert len(train) == 10**12
    image, target = train[10**12 - 1]
    assert image.shape == (3, 128, 128) and torch.equal(train[10**12 - 1][1]["boxes"], target["boxes"])
    small, _ = datasets("data.augment=false")
    assert len(pickle.dumps(train)) <= len(pickle.dumps(small)) + 100  # what every DataLoader worker copies


def test_samples_are_fresh_copies_and_batches_are_lists():
    train, _ = datasets("data.augment=false")
    image, target = train[3]
    assert image.shape == (3, 128, 128) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    assert target["boxes"].shape == (len(target["labels"]), 4) and target["labels"].dtype == torch.int64
    target["boxes"].fill_(-1)
    assert train[3][1]["boxes"].min() >= 0
    images, targets = collate_fn([train[0], train[1]])
    assert len(images) == len(targets) == 2 and torch.equal(targets[1]["labels"], train[1][1]["labels"])


def test_augmentation_moves_boxes_with_the_image():
    """Each class has one colour here, so the centre of every box of an augmented sample
    must show its label's colour, as it does without augmentation (a box left unflipped
    on a flipped image points at another colour)."""
    plain, _ = datasets("data.augment=false")
    colour = {label: centre_colour(plain, label) for label in (1, 2, 3)}
    train, _ = datasets()
    seeded = SeededSamples(train)
    flipped = 0
    for index in range(len(train)):
        image, target = seeded[(sample_seeds(derive_seed(0, 1), [index])[0], index)]
        flipped += not torch.equal(target["boxes"], plain[index][1]["boxes"])
        for box, label in zip(target["boxes"].int().tolist(), target["labels"].tolist(), strict=True):
            assert (centre(image, box) - colour[label]).abs().max() < 0.3, (index, box, label)
    assert flipped > 0


def centre_colour(dataset, label: int) -> torch.Tensor:
    """The mean colour at the centres of every box of this label."""
    colours = []
    for index in range(len(dataset)):
        image, target = dataset[index]
        for box, box_label in zip(target["boxes"].int().tolist(), target["labels"].tolist(), strict=True):
            if box_label == label:
                colours.append(centre(image, box))
    return torch.stack(colours).mean(dim=0)


def centre(image: torch.Tensor, box: list[int]) -> torch.Tensor:
    """The mean colour of the 3x3 pixels at the box's centre: inside rectangles and
    ellipses alike, and above the pixel noise."""
    x, y = (box[0] + box[2]) // 2, (box[1] + box[3]) // 2
    return image[:, y - 1 : y + 2, x - 1 : x + 2].mean(dim=(1, 2))


def write_coco(root, split, images, annotations, categories=(3, 7), names=None):
    from PIL import Image

    (root / split).mkdir(parents=True)
    (root / "annotations").mkdir(exist_ok=True)
    for image in images:
        Image.new("RGB", (image["width"], image["height"]), (200, 100, 50)).save(root / split / image["file_name"])
    names = names or [str(i) for i in categories]
    categories = [{"id": i, "name": name} for i, name in zip(categories, names, strict=True)]
    coco = {"images": images, "annotations": annotations, "categories": categories}
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))


IMAGES = [
    {"id": 5, "file_name": "b.jpg", "width": 40, "height": 30},
    {"id": 2, "file_name": "a.jpg", "width": 64, "height": 48},
    {"id": 9, "file_name": "empty.jpg", "width": 20, "height": 20},
]
ANNOTATIONS = [
    {"id": 1, "image_id": 2, "category_id": 7, "bbox": [4, 6, 10, 20], "iscrowd": 0},
    {"id": 2, "image_id": 5, "category_id": 3, "bbox": [1, 2, 3, 4], "iscrowd": 0},
    {"id": 3, "image_id": 2, "category_id": 3, "bbox": [0, 0, 64, 48], "iscrowd": 1},  # a crowd region
    {"id": 4, "image_id": 2, "category_id": 3, "bbox": [30, 20, 0, 5], "iscrowd": 0},  # no area
]


def coco_datasets(root, *overrides):
    return datasets("data.name=coco", f"data.root={root}", "data.train_split=t", "data.val_split=v", *overrides)


def test_coco_files_load_in_image_id_order_with_labels_1_to_k(tmp_path):
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[:1], ANNOTATIONS[1:2])
    train, val = coco_datasets(tmp_path, "data.augment=false")
    assert (len(train), len(val)) == (3, 1)
    image, target = train[0]  # image id 2: its category 7 is label 2; crowd and empty boxes left out
    assert image.shape == (3, 48, 64)
    assert target["boxes"].tolist() == [[4, 6, 14, 26]] and target["labels"].tolist() == [2]
    image, target = train[1]
    assert image.shape == (3, 30, 40) and target["labels"].tolist() == [1]
    image, target = train[2]  # an image without objects trains as background
    assert target["boxes"].shape == (0, 4) and target["labels"].shape == (0,)


def test_coco_with_more_categories_than_num_classes_names_the_key(tmp_path):
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS, categories=(1, 2, 3, 7))
    write_coco(tmp_path, "v", IMAGES[:1], [])
    with pytest.raises(ConfigError, match="set data.num_classes=5"):
        coco_datasets(tmp_path)


@pytest.mark.parametrize("missing", ["annotations/instances_v.json", "t/a.jpg"])
def test_missing_coco_files_are_one_line_errors(tmp_path, missing):
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[:1], [])
    (tmp_path / missing).unlink()
    with pytest.raises(DataError) as error:
        train, _ = coco_datasets(tmp_path)
        train[0]
    assert "\n" not in str(error.value) and str(tmp_path / missing) in str(error.value)


def test_val_split_lacking_a_category_is_labelled_with_train_labels(tmp_path):
    """val's json lists only category 7: its boxes are label 2, as in train (was: val's
    own sorted categories made 7 label 1, so val_map scored right boxes as wrong)."""
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[1:2], ANNOTATIONS[:1], categories=(7,))
    _, val = coco_datasets(tmp_path, "data.augment=false")
    assert val[0][1]["labels"].tolist() == [2]


@pytest.mark.parametrize(
    "categories, names, named",
    [((3, 7, 9), ("3", "7", "9"), "category 9 ('9')"), ((3, 7), ("3", "seven"), "category 7 is 'seven'")],
    ids=["extra", "renamed"],
)
def test_val_category_unknown_to_train_is_one_line(tmp_path, categories, names, named):
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[:1], ANNOTATIONS[1:2], categories=categories, names=names)
    with pytest.raises(DataError) as error:
        coco_datasets(tmp_path)
    message = str(error.value)
    assert "\n" not in message and named in message and "instances_v.json" in message, message


def test_annotation_of_an_unlisted_category_is_one_line(tmp_path):
    write_coco(tmp_path, "t", IMAGES, [*ANNOTATIONS, {"id": 5, "image_id": 2, "category_id": 4, "bbox": [1, 1, 2, 2]}])
    write_coco(tmp_path, "v", IMAGES[:1], [])
    with pytest.raises(DataError) as error:
        coco_datasets(tmp_path)
    message = str(error.value)
    assert "\n" not in message and "annotation 5" in message and "category_id 4" in message, message


def test_image_of_another_size_than_its_json_is_one_line(tmp_path):
    """Boxes are in the json's pixels: on an image of another size they would mark the
    wrong places."""
    from PIL import Image

    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[:1], [])
    Image.new("RGB", (32, 24)).save(tmp_path / "t" / "a.jpg")  # the json says 64x48
    train, _ = coco_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[0]
    message = str(error.value)
    assert "\n" not in message and str(tmp_path / "t" / "a.jpg") in message and "64x48" in message, message


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


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_unreadable_images_are_one_line_naming_the_file(tmp_path, kind):
    write_coco(tmp_path, "t", IMAGES, ANNOTATIONS)
    write_coco(tmp_path, "v", IMAGES[:1], [])
    write, advice = BAD_IMAGES[kind]
    bad = tmp_path / "t" / "a.jpg"  # image id 2: sample 0
    write(bad)
    train, _ = coco_datasets(tmp_path)
    with pytest.raises(DataError) as error:
        train[0]
    message = str(error.value)
    assert "\n" not in message and str(bad) in message and advice in message, message
