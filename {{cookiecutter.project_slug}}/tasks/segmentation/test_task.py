"""Your task's tests: they run train.py on your model.py, data.py and config.yaml.

Adapt them when you change the task (the machinery's own tests, in the other files, run
on tests/reference_task and need no change)."""

import math

import pytest

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

# What these tests do not look at: the tracking part's TensorBoard curves.
QUIET = ["tracking.tensorboard=false"] if has("engine/parts/tracking.py") else []

# The task at a small scale for the exactness tests: seconds per run.
SMALL_TASK = [
    "data.image_size=32",
    "data.train_size=128",
    "data.val_size=101",
    "train.batch_size=8",
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
    "data.train_size=1024",
    "data.val_size=64",
    "train.epochs=3",
    "train.num_workers=0",
    *QUIET,
]


def test_the_default_recipe_learns(tmp_path):
    run_script("train.py", [*SMALL_DEFAULT_RUN, f"output_dir={tmp_path}"], nproc=2, timeout=600, cwd=PROJECT)
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(row["train_loss"]) for row in metrics)
    # An untrained model calls every pixel background: a mean IoU near 0.2 here.
    assert metrics[-1]["val_miou"] > 0.6, f"the example's bar; set what your task reaches here: {metrics}"


def test_evaluation_gives_the_same_metrics_on_1_2_and_3_processes(tmp_path):
    """101 samples: shards of 51/50 and 34/34/33, every one counted once."""
    results = evaluate_on_1_2_and_3_processes(SMALL_TASK, tmp_path)
    assert results[0]["num_samples"] == 101
    assert results[1] == results[0] and results[2] == results[0]


def test_predict_gives_one_result_per_image_alike_on_1_and_2_processes(tmp_path):
    """predict.py on image files of any size: the task's own pre-processing and predict_step."""
    rows = predict_on_1_and_2_processes(SMALL_TASK, tmp_path)
    for row in rows:
        height, width = row["size"]
        assert sum(length for _, length in row["mask_runs"]) == height * width, row
        assert all(0 <= label < 4 for label, _ in row["mask_runs"]), row


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_run_stopped_mid_epoch_resumes_bitwise(tmp_path, nproc):
    steps_per_epoch = 128 // (8 * (nproc or 1))
    assert_resume_is_bitwise(SMALL_TASK, tmp_path, nproc, stop_at=steps_per_epoch + 3)  # in the second epoch
