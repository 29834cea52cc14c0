"""Your task's tests: they run train.py on your model.py, data.py and config.yaml.

Adapt them when you change the task (the machinery's own tests, in the other files, run
on tests/reference_task and need no change)."""

import math

import pytest
import torch

from conftest import (
    PROJECT,
    assert_one_epoch_trains_on_one_process,
    assert_resume_is_bitwise,
    evaluate_on_1_2_and_3_processes,
    has,
    predict_on_1_and_2_processes,
    read_metrics,
    run_script,
)
from model import coco_map

# What these tests do not look at: the tracking part's TensorBoard curves.
QUIET = ["tracking.tensorboard=false"] if has("engine/parts/tracking.py") else []

# The task at a small scale for the exactness tests: seconds per run.
SMALL_TASK = [
    "data.image_size=64",
    "model.min_size=64",
    "model.max_size=64",
    "data.train_size=64",
    "data.val_size=37",
    "train.batch_size=4",
    "train.epochs=2",
    "train.num_workers=0",
    *QUIET,
]


@pytest.mark.quick
def test_your_task_trains_evaluates_and_saves_on_one_process(tmp_path):
    """The edit loop's run (pytest -m quick): one epoch of the small task, one process."""
    assert_one_epoch_trains_on_one_process(SMALL_TASK, tmp_path)


# The default recipe on a smaller copy of the default data: only sizes are set here.
SMALL_DEFAULT_RUN = [
    "data.train_size=160",
    "data.val_size=64",
    "train.epochs=4",
    "train.num_workers=0",
    *QUIET,
]


def test_the_default_recipe_learns(tmp_path):
    run_script("train.py", [*SMALL_DEFAULT_RUN, f"output_dir={tmp_path}"], nproc=2, timeout=900, cwd=PROJECT)
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(row["train_loss"]) for row in metrics)
    # An untrained detector finds nothing here (mAP 0); the full default run reaches
    # val_map50 above 0.9.
    assert metrics[-1]["val_map50"] > 0.4, f"the example's bar; set what your task reaches here: {metrics}"


def test_evaluation_gives_the_same_metrics_on_1_2_and_3_processes(tmp_path):
    """37 images: shards of 19/18 and 13/12/12, every one counted once."""
    results = evaluate_on_1_2_and_3_processes(SMALL_TASK, tmp_path)
    assert results[0]["num_samples"] == 37
    assert results[1] == results[0] and results[2] == results[0]


def test_predict_gives_one_result_per_image_alike_on_1_and_2_processes(tmp_path):
    """predict.py on image files of any size: the task's own pre-processing and predict_step."""
    rows = predict_on_1_and_2_processes(SMALL_TASK, tmp_path)
    for row in rows:
        assert len(row["boxes"]) == len(row["labels"]) == len(row["scores"]), row
        assert all(len(box) == 4 and box[0] <= box[2] and box[1] <= box[3] for box in row["boxes"]), row


def test_a_run_stopped_mid_epoch_resumes_bitwise(tmp_path):
    """On 2 processes, where each rank's augmentation and sampling must resume; the
    machinery's own tests cover other world sizes."""
    steps_per_epoch = 64 // (4 * 2)
    assert_resume_is_bitwise(SMALL_TASK, tmp_path, 2, stop_at=steps_per_epoch + 3)  # in the second epoch


def boxes(*rows):
    return torch.tensor(rows, dtype=torch.float32).reshape(-1, 4)


TARGETS = [
    {"boxes": boxes([10, 10, 50, 40], [60, 60, 90, 100]), "labels": torch.tensor([1, 2])},
    {"boxes": boxes([0, 0, 30, 30]), "labels": torch.tensor([3])},
]


def detections(rows_per_image):
    """[(box, label, score), ...] per image, as a detector's eval-mode output."""
    return [
        {
            "boxes": boxes(*(r[0] for r in rows)),
            "labels": torch.tensor([r[1] for r in rows], dtype=torch.int64),
            "scores": torch.tensor([r[2] for r in rows]),
        }
        for rows in rows_per_image
    ]


@pytest.mark.quick
def test_coco_map_is_1_for_perfect_detections_and_0_for_none():
    perfect = [{**t, "scores": torch.ones(len(t["labels"]))} for t in TARGETS]
    assert coco_map(perfect, TARGETS) == {"map": pytest.approx(1.0), "map50": pytest.approx(1.0)}
    assert coco_map(detections([[], []]), TARGETS) == {"map": 0.0, "map50": 0.0}


@pytest.mark.quick
def test_coco_map_counts_wrong_labels_misses_and_loose_boxes():
    # Class 1 is never found (AP 0); class 2's false detection scores below its hit (AP 1).
    wrong_label = detections([[([10, 10, 50, 40], 2, 0.5), ([60, 60, 90, 100], 2, 0.9)], [([0, 0, 30, 30], 3, 0.9)]])
    assert coco_map(wrong_label, TARGETS) == {"map": pytest.approx(2 / 3), "map50": pytest.approx(2 / 3)}
    # IoU 900/1260 = 0.71 for class 3: a hit at IoU thresholds 0.50 to 0.70, 5 of COCO's 10.
    loose = detections([[([10, 10, 50, 40], 1, 0.9), ([60, 60, 90, 100], 2, 0.9)], [([0, 0, 30, 42], 3, 0.9)]])
    assert coco_map(loose, TARGETS) == {"map": pytest.approx((1 + 1 + 0.5) / 3), "map50": pytest.approx(1.0)}
