"""End to end: real processes, launched as a user would (python and torchrun)."""

import json

import pytest
import torch

from checkpoint import load_checkpoint
from conftest import FAST, read_metrics, run_script

FAST_SHORT = [*FAST, "train.epochs=1", "data.train_size=512"]


def test_two_process_run_trains_evaluates_checkpoints_and_resumes(tmp_path, fast_args):
    out = tmp_path / "run"
    first = run_script("train.py", [*fast_args, f"output_dir={out}", "train.epochs=2"], nproc=2)
    assert "training on 2 process(es)" in first.stdout
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1]
    assert all(m["num_samples"] == 101 for m in metrics)  # every val sample once, none padded
    assert metrics[-1]["val_acc"] > 0.3  # 10 classes: chance is 0.1
    assert {p.name for p in (out / "checkpoints").iterdir()} >= {"last.pt", "best.pt"}
    assert (out / "config.yaml").is_file()

    again = run_script("train.py", [*fast_args, f"output_dir={out}", "train.epochs=3"], nproc=2)
    assert f"resumed from {out / 'checkpoints' / 'last.pt'}: epoch 2" in again.stdout
    metrics = read_metrics(out)
    assert [m["epoch"] for m in metrics] == [0, 1, 2]  # appended, not overwritten
    assert load_checkpoint(out / "checkpoints" / "last.pt")["epoch"] == 3

    evaluated = run_script("evaluate.py", ["--checkpoint", out / "checkpoints" / "last.pt"], nproc=2)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["num_samples"] == 101
    assert abs(result["val_acc"] - metrics[-1]["val_acc"]) < 1e-9
    assert abs(result["val_loss"] - metrics[-1]["val_loss"]) < 1e-6


def test_batchnorm_model_evaluates_what_rank_0_saves(tmp_path, fast_args):
    # Without SyncBatchNorm (CPU) each rank's running statistics drift apart; evaluation
    # must use rank 0's, which are the ones in the checkpoint.
    out = tmp_path / "run"
    args = [*fast_args, "model.name=resnet18", "data.train_size=256", "train.epochs=1", f"output_dir={out}"]
    run_script("train.py", args, nproc=2)
    evaluated = run_script("evaluate.py", ["--checkpoint", out / "checkpoints" / "last.pt"], nproc=2)
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    trained = read_metrics(out)[-1]
    assert result["val_acc"] == trained["val_acc"]
    assert abs(result["val_loss"] - trained["val_loss"]) < 1e-6


def test_single_process_run(tmp_path, fast_args):
    out = tmp_path / "run"
    run_script("train.py", [*fast_args, f"output_dir={out}", "train.epochs=1"])
    assert [m["num_samples"] for m in read_metrics(out)] == [101]


def test_bad_config_is_one_line_and_exit_code_2(tmp_path):
    result = run_script("train.py", ["train.lrr=0.1"], check=False)
    assert result.returncode == 2
    assert result.stderr.strip() == "error: unknown config key 'train.lrr' (did you mean 'train.lr'?)"


def test_bad_config_under_torchrun_is_reported_once(tmp_path):
    result = run_script("train.py", ["train.batch_size=0"], nproc=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count("error: train.batch_size must be > 0, got 0") == 1


@pytest.mark.parametrize(
    "switches",
    [["train.compile=true", "train.channels_last=true"], ["dist.static_graph=true", "dist.bucket_cap_mb=0.01"]],
)
def test_speed_switches_keep_the_math(tmp_path, switches):
    """torch.compile, channels_last, DDP static_graph and bucket size change speed only."""
    args = [*FAST_SHORT, "checkpoint.resume=none"]
    plain, switched = tmp_path / "plain", tmp_path / "switched"
    run_script("train.py", [*args, f"output_dir={plain}"], nproc=2)
    run_script("train.py", [*args, *switches, f"output_dir={switched}"], nproc=2)
    a = load_checkpoint(plain / "checkpoints" / "last.pt")["model"]
    b = load_checkpoint(switched / "checkpoints" / "last.pt")["model"]
    for key, value in a.items():
        torch.testing.assert_close(b[key], value, rtol=1e-4, atol=1e-5, msg=key)
