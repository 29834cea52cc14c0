"""Same math on any number of processes: exact training, exact evaluation, exact resume.

Each test launches real processes (python or torchrun on CPU with gloo).
"""

import json

import pytest
import torch

from conftest import FAST, STRATEGIES, read_metrics, run_script, strategy_args, tensors
from engine.checkpoint import load_checkpoint


def final_state(output_dir):
    return load_checkpoint(output_dir / "checkpoints" / "last.pt")


LAYOUTS = [(2, 8, 1, "ddp"), (1, 8, 2, "ddp"), (2, 4, 2, "ddp"), (2, 8, 1, "fsdp"), (4, 2, 2, "fsdp")]


@pytest.mark.parametrize("nproc, batch_size, accum, strategy", [case for case in LAYOUTS if case[-1] in STRATEGIES])
def test_world_size_and_accumulation_do_not_change_training(tmp_path, nproc, batch_size, accum, strategy):
    """N processes x batch B x accumulation K trains like 1 process with batch N*B*K,
    with DDP and with FSDP (whose ranks start from rank 0's weights, built once)."""
    common = [
        *FAST,
        "data.augment=true",
        "train.epochs=1",
        "checkpoint.resume=none",
        *strategy_args(strategy),
    ]
    reference, other = tmp_path / "reference", tmp_path / "other"
    run_script("train.py", [*common, "train.batch_size=16", f"output_dir={reference}"])
    run_script(
        "train.py",
        [*common, f"train.batch_size={batch_size}", f"train.accum_steps={accum}", f"output_dir={other}"],
        nproc=nproc if nproc > 1 else None,
    )
    a, b = final_state(reference), final_state(other)
    assert a["step"] == b["step"] == 1024 // 16
    for key, weight in a["model"].items():
        torch.testing.assert_close(b["model"][key], weight, rtol=1e-4, atol=1e-5, msg=key)


def test_evaluation_counts_every_sample_once_on_any_world_size(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*FAST, "train.epochs=1", f"output_dir={out}"])
    checkpoint = out / "checkpoints" / "last.pt"
    results = []
    for nproc in (None, 2, 3):
        # 101 samples (prime) in batches of 11 (10 batches): ranks get 4/3/3 of them.
        args = ["--checkpoint", checkpoint, "train.eval_batch_size=11"]
        shown = run_script("evaluate.py", args, nproc=nproc).stdout.strip().splitlines()
        results.append(json.loads(shown[-1]))
    assert [r["num_samples"] for r in results] == [101, 101, 101]
    assert results == [results[0]] * 3  # to the last bit: the same batches on any world size


RESUME = [
    *FAST,
    "data.augment=true",
    "model.dropout=0.2",  # in-model randomness: resume must restore every rank's RNG
    "train.epochs=2",
]


# 3 processes: a sum of three gradients rounds by their order, which must not change at a resume.
STOPS = [(None, 0, 37, "ddp"), (2, 2, 21, "ddp"), (3, 0, 21, "ddp"), (2, 0, 21, "fsdp")]


@pytest.mark.parametrize("nproc, workers, stop_at, strategy", [case for case in STOPS if case[-1] in STRATEGIES])
def test_interrupted_run_resumes_bitwise_identical(tmp_path, nproc, workers, stop_at, strategy):
    """Under FSDP the checkpoints are sharded folders (each rank writes its own shards)."""
    args = [*RESUME, f"train.num_workers={workers}", *strategy_args(strategy)]
    whole, split = tmp_path / "whole", tmp_path / "split"
    run_script("train.py", [*args, f"output_dir={whole}"], nproc=nproc)
    stopped = run_script("train.py", [*args, f"output_dir={split}", f"train.stop_at_step={stop_at}"], nproc=nproc)
    assert f"stopped at step {stop_at}" in stopped.stdout
    assert final_state(split)["step"] == stop_at
    assert (split / "checkpoints" / "last.pt").is_dir() == (strategy == "fsdp")
    resumed = run_script("train.py", [*args, f"output_dir={split}"], nproc=nproc)
    assert "resumed from" in resumed.stdout

    a, b = final_state(whole), final_state(split)
    assert (a["epoch"], a["step"]) == (b["epoch"], b["step"])
    assert tensors(a["model"]).keys() == tensors(b["model"]).keys()
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs after resume"
    assert a["scheduler"] == b["scheduler"]
    assert [m["val_loss"] for m in read_metrics(whole)] == [m["val_loss"] for m in read_metrics(split)]


def test_the_sanity_check_before_training_changes_nothing(tmp_path):
    """It evaluates 2 batches per rank before the first step: with dropout and random
    augmentation on 2 processes, the run ends bitwise as one without it. (Where
    validation_step draws random numbers, the check gives the RNG back: the regression
    task of test_task_interface.py draws some and resumes bitwise mid-epoch.)"""
    args = [*RESUME, "train.epochs=1"]
    checked, unchecked = tmp_path / "checked", tmp_path / "unchecked"
    run_script("train.py", [*args, f"output_dir={checked}"], nproc=2)
    run_script("train.py", [*args, "train.sanity_check=false", f"output_dir={unchecked}"], nproc=2)
    a, b = final_state(checked), final_state(unchecked)
    for part in ("model", "optimizer"):
        for key, value in tensors(a[part]).items():
            assert torch.equal(tensors(b[part])[key], value), f"{part}{key} differs"
    assert a["rng"] == b["rng"]
    assert [m["val_loss"] for m in read_metrics(checked)] == [m["val_loss"] for m in read_metrics(unchecked)]


def test_resume_on_another_world_size_continues_and_says_so(tmp_path):
    out = tmp_path / "run"
    run_script("train.py", [*RESUME, f"output_dir={out}", "train.stop_at_step=10"], nproc=2)
    resumed = run_script("train.py", [*RESUME, f"output_dir={out}"])
    assert resumed.stdout.count("the data order from here differs") == 1
    state = final_state(out)
    assert state["epoch"] == 2 and state["step"] == 10 + 1024 // 16 - 10 * 2 + 1024 // 16


def test_deterministic_switch():
    from engine.seeding import set_determinism

    try:
        set_determinism(True, torch.device("cpu"))
        assert torch.are_deterministic_algorithms_enabled()
    finally:
        set_determinism(False, torch.device("cpu"))
    assert not torch.are_deterministic_algorithms_enabled()
