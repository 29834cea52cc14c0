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

# The task at a small scale for the exactness tests: seconds per run. These are the example's
# settings (data.* sizes are synthetic data's): with your own data, set what makes a run short.
SMALL_TASK = [
    "model.name=mlp",
    "model.hidden_dim=32",
    "model.dropout=0.2",  # in-model randomness: resume must restore every rank's RNG
    "data.image_size=8",
    "data.train_size=512",
    "data.val_size=101",
    "train.batch_size=16",
    "train.epochs=2",
    "train.num_workers=0",
    *QUIET,
]


@pytest.mark.quick
def test_your_task_trains_evaluates_and_saves_on_one_process(tmp_path):
    """The edit loop's run (pytest -m quick): one epoch of the small task, one process."""
    assert_one_epoch_trains_on_one_process(SMALL_TASK, tmp_path)


# The default recipe (lr, warmup, schedule, clipping, weight decay, augmentation) on a
# smaller and cheaper copy of the default data: only sizes are set here, the same for
# every world size (so 4 processes make 4 times fewer, 4 times larger steps).
SMALL_DEFAULT_RUN = [
    "data.image_size=8",
    "data.train_size=2048",
    "data.val_size=200",
    "train.batch_size=32",
    "train.epochs=4",
    "train.num_workers=0",
    *QUIET,
]


# ResNet-18 costs about 30 times the mlp per sample on CPU: half the data, 3 epochs
# (8 steps per epoch on 4 processes; it reaches val_acc 0.87 there, 1.0 on 1 process).
SHORTER = {"mlp": [], "resnet18": ["data.train_size=1024", "train.epochs=3"]}


@pytest.mark.parametrize("model", ["mlp", "resnet18"])
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_default_recipe_learns_on_any_number_of_processes(tmp_path, model, nproc):
    args = [*SMALL_DEFAULT_RUN, *SHORTER[model], f"model.name={model}", f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=nproc, timeout=600, cwd=PROJECT)
    expected_lr = 0.2 * 32 * nproc / 128
    assert f"lr {expected_lr:.4g} = optim.lr 0.2 scaled from batch 128 to 32x{nproc}x1" in result.stdout, (
        "the example recipe's lr line: after changing recipe.py or optim:, write your recipe's lr here"
    )
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(row["train_loss"]) for row in metrics)
    assert_learns(metrics)


def assert_learns(metrics: list[dict]) -> None:
    """The example's bar for 4 small epochs: adapt it to your task (label smoothing and MixUp,
    for one, keep the training loss well above 70% of its start)."""
    adapt = "the example's bar for learning; set what your task reaches in this test (test_task.py)"
    assert metrics[-1]["train_loss"] < 0.7 * metrics[0]["train_loss"], f"{adapt}: {metrics}"
    assert metrics[-1]["val_acc"] > 0.5, f"{adapt}: {metrics}"  # 10 classes: chance is 0.1


@pytest.mark.parametrize("batch_size", [16, 256])
def test_the_default_recipe_learns_at_small_and_large_per_process_batches(tmp_path, batch_size):
    """The same config at 16 and 256 samples per step (128 and 8 steps per epoch): the
    rate scales with the batch, and warmup lasts one epoch whatever its length."""
    args = [*SMALL_DEFAULT_RUN, "model.name=mlp", f"train.batch_size={batch_size}", f"output_dir={tmp_path}"]
    run_script("train.py", args, timeout=600, cwd=PROJECT)
    assert_learns(read_metrics(tmp_path))


def test_evaluation_gives_the_same_metrics_on_1_2_and_3_processes(tmp_path):
    """101 samples: shards of 51/50 and 34/34/33, every one counted once."""
    results = evaluate_on_1_2_and_3_processes(SMALL_TASK, tmp_path)
    assert results[0]["num_samples"] == 101
    assert results[1] == results[0] and results[2] == results[0]


def test_predict_gives_one_result_per_image_alike_on_1_and_2_processes(tmp_path):
    """predict.py on image files of any size: the task's own pre-processing and predict_step."""
    rows = predict_on_1_and_2_processes(SMALL_TASK, tmp_path)
    assert all(0 <= row["label"] < 10 and 0 < row["score"] <= 1 for row in rows), rows


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_run_stopped_mid_epoch_resumes_bitwise(tmp_path, nproc):
    steps_per_epoch = 512 // (16 * (nproc or 1))
    assert_resume_is_bitwise(SMALL_TASK, tmp_path, nproc, stop_at=steps_per_epoch + 3)  # in the second epoch
