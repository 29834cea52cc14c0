"""Your task's tests: they run train.py on your model.py, data.py and config.yaml.

Adapt them when you change the task (the machinery's own tests, in the other files, run
on tests/reference_task and need no change)."""

import json
import math

import pytest
import torch
import yaml

from conftest import PROJECT, project_config, read_metrics, run_script
from engine.checkpoint import load_checkpoint
from test_exactness import tensors

# The task at a small scale for the exactness tests: seconds per run.
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
    "train.tensorboard=false",
]


def test_config_yaml_writes_no_default_twice():
    """config.yaml holds only what differs from the schema, so the two cannot drift apart."""
    defaults = project_config(None)
    written = yaml.safe_load((PROJECT / "config.yaml").read_text())
    for section, values in written.items():
        for key, value in values.items() if isinstance(values, dict) else [(None, values)]:
            default = getattr(defaults, section) if key is None else getattr(getattr(defaults, section), key)
            assert value != default, f"{section}.{key} repeats its default {default!r}; delete it from config.yaml"


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
    "train.tensorboard=false",
]


@pytest.mark.parametrize("model", ["mlp", "resnet18"])
@pytest.mark.parametrize("nproc", [1, 2, 4])
def test_the_default_recipe_learns_on_any_number_of_processes(tmp_path, model, nproc):
    args = [*SMALL_DEFAULT_RUN, f"model.name={model}", f"output_dir={tmp_path}"]
    result = run_script("train.py", args, nproc=nproc, timeout=600, cwd=PROJECT)
    expected_lr = 0.2 * 32 * nproc / 128
    assert f"lr {expected_lr:.4g} = train.lr 0.2 scaled from batch 128 to 32x{nproc}x1" in result.stdout
    metrics = read_metrics(tmp_path)
    assert all(math.isfinite(row["train_loss"]) for row in metrics)
    assert metrics[-1]["train_loss"] < 0.7 * metrics[0]["train_loss"]
    assert metrics[-1]["val_acc"] > 0.5, metrics  # 10 classes: chance is 0.1


def test_evaluation_gives_the_same_metrics_on_1_2_and_3_processes(tmp_path):
    """101 samples: shards of 51/50 and 34/34/33. Batches of one sample make every
    forward the same bits, so the metrics must be equal, not only close."""
    run_script("train.py", [*SMALL_TASK, "train.epochs=1", f"output_dir={tmp_path}"], cwd=PROJECT)
    args = ["--checkpoint", tmp_path / "checkpoints" / "last.pt", "train.eval_batch_size=1"]
    results = []
    for nproc in (None, 2, 3):
        result = run_script("evaluate.py", args, nproc=nproc, cwd=PROJECT)
        results.append(json.loads(result.stdout.splitlines()[-1]))
    assert results[0]["num_samples"] == 101
    assert results[1] == results[0] and results[2] == results[0]


@pytest.mark.parametrize("nproc", [None, 2])
def test_a_run_stopped_mid_epoch_resumes_bitwise(tmp_path, nproc):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_script("train.py", [*SMALL_TASK, f"output_dir={whole}"], nproc=nproc, cwd=PROJECT)
    stop_at = 512 // (16 * (nproc or 1)) + 3  # in the second epoch
    args = [*SMALL_TASK, f"output_dir={split}"]
    run_script("train.py", [*args, f"train.stop_at_step={stop_at}"], nproc=nproc, cwd=PROJECT)
    assert "resumed from" in run_script("train.py", args, nproc=nproc, cwd=PROJECT).stdout

    a, b = (load_checkpoint(out / "checkpoints" / "last.pt") for out in (whole, split))
    assert a["step"] == b["step"] == 2 * 512 // (16 * (nproc or 1))
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert validation(read_metrics(whole)) == validation(read_metrics(split))


def validation(epochs: list[dict]) -> list[dict]:
    """Each epoch's validation metrics (a resumed epoch's train_* averages only the
    steps run after the resume)."""
    return [{k: v for k, v in epoch.items() if k.startswith("val_") or k == "num_samples"} for epoch in epochs]
