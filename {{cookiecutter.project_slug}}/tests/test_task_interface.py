"""Any task through model.py and data.py: copies of this project whose model.py and
data.py are replaced, with no other file touched, by
- a regression task (tests/regression_task: dict samples, a dataclass batch from its own
  collate_fn, two named losses, metrics that are not sums): it trains, evaluates exactly
  and resumes bitwise;
- a sequence task (tests/sequence_task: a GRU over padded token sequences, whose output
  for a sample changes with its batch-mates; a loss weight read from the model; a
  token-weighted mean and a two-column AUROC): it evaluates to the same bits on 1, 2
  and 3 processes at the default eval_batch_size, and each mistake users make in
  model.py stops the run in one line before its first step."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import PROJECT, has, import_file, machinery_project, read_metrics, run_script, tensors
from engine.checkpoint import load_checkpoint
from engine.config import load_config

TASK = PROJECT / "tests" / "regression_task"
SEQUENCE_TASK = PROJECT / "tests" / "sequence_task"
RUN = [
    "train.num_workers=0",
    "train.batch_size=16",
    "optim.lr=0.05",
    "train.epochs=2",
    "train.log_every_steps=8",
    "checkpoint.best_metric=val_mse",
    "checkpoint.best_mode=min",
]


def project_with(task: Path, folder: Path) -> Path:
    """The machinery's copy of this project with only model.py and data.py replaced."""
    project = folder / "project"
    shutil.copytree(machinery_project(), project)
    for name in ("model.py", "data.py"):
        shutil.copy(task / name, project / name)
    return project


@pytest.fixture(scope="module")
def task_project(tmp_path_factory):
    return project_with(TASK, tmp_path_factory.mktemp("task"))


@pytest.fixture(scope="module")
def sequence_project(tmp_path_factory):
    project = project_with(SEQUENCE_TASK, tmp_path_factory.mktemp("sequence"))
    (project / "config.yaml").write_text("checkpoint:\n  best_metric: val_auroc\n  best_mode: max\n")
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


SEQUENCE_RUN = ["train.num_workers=0", "train.batch_size=16", "optim.name=adamw", "optim.lr=0.01"]


def test_the_sequence_model_depends_on_its_batch_mates():
    """The premise of the next test: the same samples, batched with 256 or with 85
    samples, get other bits from this GRU (as from most kernels)."""
    data = import_file("sequence_task_data", SEQUENCE_TASK / "data.py")
    task = import_file("sequence_task_model", SEQUENCE_TASK / "model.py")
    cfg = load_config(None, [], data=data.DataConfig, model=task.ModelConfig)
    torch.manual_seed(0)
    model = task.build_model(cfg).eval()
    _, val_set = data.build_datasets(cfg)

    def label_logits(indices):
        batch = data.collate_fn([val_set[i] for i in indices])
        with torch.no_grad():
            return model(batch["tokens"], batch["mask"])[1]

    in_256, in_85 = label_logits(range(256))[:85], label_logits(range(85))
    torch.testing.assert_close(in_256, in_85)  # the same but for rounding
    assert not torch.equal(in_256, in_85)


def test_a_batch_dependent_model_evaluates_to_the_same_bits_on_1_2_and_3_processes(sequence_project, tmp_path):
    out = tmp_path / "run"
    run_task(sequence_project, "train.py", [*SEQUENCE_RUN, "train.epochs=2", f"output_dir={out}"], nproc=2)
    last_epoch = read_metrics(out)[-1]
    assert last_epoch["val_auroc"] > 0.8  # chance is 0.5: it learned, reading cfg.model.token_weight
    if has("engine/parts/throughput.py"):  # the throughput part reads count_items
        # Tokens over both ranks, per second of the same clock; sequences are 3 to 24 tokens, 13.5 on average.
        assert 12 < last_epoch["tokens_per_s"] / last_epoch["samples_per_s"] < 15
    results = []
    for nproc in (None, 2, 3):  # 1009 samples, default eval_batch_size 256: shares of 2/2 and 2/1/1 batches
        args = ["--checkpoint", out / "checkpoints" / "last.pt"]
        results.append(json.loads(run_task(sequence_project, "evaluate.py", args, nproc=nproc).stdout.splitlines()[-1]))
    assert results[0]["num_samples"] == 1009
    assert results == [results[0]] * 3  # equal with ==, every metric to the last bit
    validation = {k: v for k, v in results[0].items() if k.startswith("val_") or k == "num_samples"}
    assert {k: last_epoch[k] for k in validation} == validation  # the epoch's validation on 2 processes too


MISTAKES = [
    ("batch_mean", None, "metric 'acc': Mean.update got shape []; give one row per sample (shape [batch])"),
    ("batch_mean", 2, "metric 'acc': Mean.update got shape []"),
    ("two_columns", None, "metric 'acc': Mean.update got shape [256, 2]"),
    ("loss_none", None, "training_step's loss 'label' has shape [16], not a single number (a 0-dim tensor); reduce it"),
    ("float_loss", None, "training_step's loss 'l2' is a float, not a tensor"),
    ("plain_metric", None, "metric 'auroc' is a function; build_metrics must return engine.metrics"),
    ("", None, "checkpoint.best_metric is 'val_auc', which this task does not report"),
]


@pytest.mark.parametrize("mistake, nproc, message", MISTAKES)
def test_each_mistake_stops_the_run_in_one_line_before_its_first_step(
    sequence_project, tmp_path, mistake, nproc, message
):
    args = [*SEQUENCE_RUN, f"model.mistake={mistake}", f"output_dir={tmp_path}"]
    if not mistake:
        args.append("checkpoint.best_metric=val_auc")
    failed = run_task(sequence_project, "train.py", args, nproc=nproc, check=False)
    errors = [line for line in failed.stderr.splitlines() if line.startswith("error: ")]
    assert failed.returncode != 0 and len(errors) == 1, failed.stderr
    assert message in errors[0] and 'train.py", line' not in failed.stderr  # no traceback of the run's own
    assert not (tmp_path / "checkpoints").exists() and " step " not in failed.stdout


def test_a_raising_validation_step_stops_the_run_before_any_training_step(sequence_project, tmp_path):
    args = [*SEQUENCE_RUN, "model.mistake=raising_step", f"output_dir={tmp_path}"]
    failed = run_task(sequence_project, "train.py", args, nproc=2, check=False)
    assert failed.returncode != 0 and "KeyError: 'labels'" in failed.stderr
    assert "[rank0]: Traceback" in failed.stderr and "[rank1]: Traceback" not in failed.stderr  # one, not one per rank
    assert not (tmp_path / "checkpoints").exists() and " step " not in failed.stdout
