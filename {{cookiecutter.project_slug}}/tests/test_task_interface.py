"""Any task through model.py and data.py: a copy of this project whose model.py and
data.py are replaced by a regression task (tests/regression_task: dict samples, a
dataclass batch from its own collate_fn, two named losses, metrics that are not sums)
trains, evaluates exactly and resumes bitwise, with no other file touched."""

import json
import shutil

import pytest
import torch

from conftest import PROJECT, machinery_project, read_metrics, run_script, tensors
from engine.checkpoint import load_checkpoint

TASK = PROJECT / "tests" / "regression_task"
RUN = [
    "train.num_workers=0",
    "train.batch_size=16",
    "train.lr=0.05",
    "train.epochs=2",
    "train.log_every_steps=8",
    "checkpoint.best_metric=val_mse",
    "checkpoint.best_mode=min",
]


@pytest.fixture(scope="module")
def task_project(tmp_path_factory):
    """The machinery's copy of this project with only model.py and data.py replaced."""
    project = tmp_path_factory.mktemp("task") / "project"
    shutil.copytree(machinery_project(), project)
    for name in ("model.py", "data.py"):
        shutil.copy(TASK / name, project / name)
    return project


def run_task(project, script, args, **kwargs):
    return run_script(str(project / script), args, cwd=project, **kwargs)


def test_a_regression_task_trains_evaluates_exactly_and_resumes_bitwise(task_project, tmp_path):
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_task(task_project, "train.py", [*RUN, f"output_dir={whole}"], nproc=2)
    epochs = read_metrics(whole)
    assert [m["num_samples"] for m in epochs] == [97, 97]
    for m in epochs:  # the named losses, and their sum, as exact epoch means
        assert m["train_loss"] == pytest.approx(m["train_main"] + m["train_aux"], rel=1e-6)
        assert {"val_mse", "val_median_abs_error", "val_error_q90", "val_aux_max"} <= m.keys()
    assert epochs[-1]["val_mse"] < 0.25  # the targets' variance is about 1: it learned

    # Evaluation: the same figures on 1, 2 and 3 processes over 97 samples (shards of
    # 49/48 and 33/32/32). Batches of one sample make every forward the same bits.
    results = []
    for nproc in (None, 2, 3):
        args = ["--checkpoint", whole / "checkpoints" / "last.pt", "train.eval_batch_size=1"]
        results.append(json.loads(run_task(task_project, "evaluate.py", args, nproc=nproc).stdout.splitlines()[-1]))
    for result in results[1:]:
        assert result == results[0]
    assert results[0]["num_samples"] == 97

    # A stop in the middle of epoch 1, then the same command: bitwise the run left alone.
    stopped = run_task(task_project, "train.py", [*RUN, f"output_dir={split}", "train.stop_at_step=21"], nproc=2)
    assert "stopped at step 21 at train.stop_at_step" in stopped.stdout
    run_task(task_project, "train.py", [*RUN, f"output_dir={split}"], nproc=2)
    a, b = load_checkpoint(whole / "checkpoints" / "last.pt"), load_checkpoint(split / "checkpoints" / "last.pt")
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"]) == (2, 32)
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert [m["val_median_abs_error"] for m in read_metrics(split)] == [m["val_median_abs_error"] for m in epochs]


def test_a_parameter_unused_in_forward_is_named_with_the_switch(task_project, tmp_path):
    args = [*RUN, "model.unused_layer=true", "train.epochs=1"]
    failed = run_task(task_project, "train.py", [*args, f"output_dir={tmp_path / 'a'}"], nproc=2, check=False)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert failed.returncode != 0 and len(errors) == 1, failed.stderr
    assert "spare.weight" in errors[0] and "set dist.find_unused_parameters=true" in errors[0]

    fine = tmp_path / "b"
    run_task(task_project, "train.py", [*args, "dist.find_unused_parameters=true", f"output_dir={fine}"], nproc=2)
    assert read_metrics(fine)[0]["num_samples"] == 97
